#!/usr/bin/env bash
# The accelerator check, on whatever accelerator jax sees (a GPU, a TPU VM, else the CPU): one
# JSON line per result on stdout, the commands' own output in $CHECK_DIR.
#   1. the device jax runs on;
#   2. `t5tpu bench` of T5 1.1 base in bfloat16 (random weights, no data): train, score and
#      greedy, each with its fraction of the bf16 matmul peak measured in the same run (train's
#      is its MFU: "mfu") or, for greedy, of its memory floor, and the achieved TFLOP/s;
#   3. a CHECK_STEPS-step train -> eval -> infer of the tiny Quora experiment (its cpu topology
#      takes the visible devices: one GPU is a 1-device data mesh). With seqio and TensorFlow
#      it reads the task; without them (a GPU image) it reads CHECK_PREPARED, written before on
#      a machine that has them, and runs train with a SIGTERM mid-run and a resume, eval, infer
#      of a file and one `t5tpu serve` request, none importing TensorFlow (each line says so):
#
#        bash scripts/accelerator_check.sh prepare   # CPU side, with TensorFlow: writes
#                                                    # CHECK_PREPARED and its CPU metrics
#        bash scripts/accelerator_check.sh           # the accelerator: the tree, the file with it
#
#      The file (~100 KB, git-ignored) must travel with the tree; a copy of tracked files only
#      must be told to bring it.
# t5tpu runs from this source tree (PYTHONPATH), on the machine's own jax (0.10 is the tested
# range; a later one is used as it is).
#
#   bash scripts/accelerator_check.sh
#
# Settings (environment):
#   T5TPU_WHEELS=DIR    wheels installed first: pip install --no-index --no-deps --target
#                       $T5TPU_SITE (default /tmp/t5tpu-site), put on PYTHONPATH
#   CHECK_MODEL         the bench's model gin (default configs/models/t5_1_1/base.gin)
#   CHECK_BENCH_FLAGS   the bench's shapes and repetitions (default below)
#   CHECK_BENCH=1       0 skips the bench
#   CHECK_STEPS=50      the tiny run's train steps (prepare with the same)
#   CHECK_PREPARED      the prepared file (default .prepared/qp_tiny.npz)
#   CHECK_WITHOUT_TF=0  1 takes the prepared path where TensorFlow is installed too
#   CHECK_DIR           where outputs go (default: a new temporary folder)
#   PYTHON=python3
#
# A machine with jax, flax, optax, orbax-checkpoint, absl-py, sentencepiece, etils, numpy and
# tensorboard needs these wheels for the bench (scripts/accelerator_wheels.sh downloads them
# into .whl; pure Python, any platform):
#   gin-config==0.5.0
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODEL=${CHECK_MODEL:-configs/models/t5_1_1/base.gin}
BENCH_FLAGS=${CHECK_BENCH_FLAGS:---batch_size=64 --input_length=512 --target_length=128 --decode_batch_size=32 --decode_length=64 --steps=5 --warmup=2 --limit_probes=5}
STEPS=${CHECK_STEPS:-50}
PREPARED=${CHECK_PREPARED:-.prepared/qp_tiny.npz}
OUT=${CHECK_DIR:-$(mktemp -d /tmp/accelerator_check.XXXXXX)}
mkdir -p "$OUT"
EXPERIMENT=configs/experiments/qp_is_duplicate_tiny_cpu.gin
# The tiny run's settings: the prepared file holds their batches and eval examples.
DATA=(--gin_file="$EXPERIMENT" --gin.TRAIN_STEPS="$STEPS" --gin.BATCH_SIZE=8
  --gin.EVAL_NUM_EXAMPLES=64 --gin.SAVE_PERIOD="$STEPS" --gin.EVAL_PERIOD=0)

line() { # a JSON line from key=value pairs (values as JSON, or strings)
  "$PYTHON" -c 'import json, sys
out = {}
for pair in sys.argv[1:]:
    key, value = pair.split("=", 1)
    try:
        out[key] = json.loads(value)
    except ValueError:
        out[key] = value
print(json.dumps(out), flush=True)' "$@"
}

if [ -n "${T5TPU_WHEELS:-}" ]; then
  SITE=${T5TPU_SITE:-/tmp/t5tpu-site}
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "$T5TPU_WHEELS"/*.whl \
    >"$OUT/wheels.log" 2>&1; then
    line check=wheels ok=false log="$OUT/wheels.log" error="$(tail -1 "$OUT/wheels.log")"
    exit 1
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Compiled programs and data sets beside $OUT, not in it (it may be copied back whole); nothing
# is read from the network.
CACHE=${TMPDIR:-/tmp}/accelerator_check_cache
export T5TPU_COMPILATION_CACHE="$CACHE/jax" TFDS_DATA_DIR="$CACHE/tfds"
t5tpu() { "$PYTHON" -m t5tpu.cli.main "$@"; }

"$PYTHON" -c 'import json, jax
d = jax.devices()[0]
print(json.dumps({"check": "device", "backend": jax.default_backend(), "device": d.device_kind,
                  "devices": jax.device_count(), "jax": jax.__version__}), flush=True)' \
  2>"$OUT/device.log" || { line check=device ok=false error="$(tail -1 "$OUT/device.log")"; exit 1; }

step() { # name, then the command's arguments: one line with its exit status and seconds
  local name=$1 begun=$SECONDS
  shift
  if t5tpu "$@" >"$OUT/$name.stdout" 2>"$OUT/$name.log"; then
    line check="$name" ok=true seconds=$((SECONDS - begun))
  else
    line check="$name" ok=false seconds=$((SECONDS - begun)) error="$(tail -1 "$OUT/$name.log")"
    return 1
  fi
}

if [ "${1:-}" = prepare ]; then # the CPU side: the file, and the CPU run's metrics beside it
  mkdir -p "$(dirname "$PREPARED")"
  step prepare_data prepare-data "${DATA[@]}" --gin.PREPARED_DATA="'$PREPARED'" || exit 1
  step cpu_train train "${DATA[@]}" --gin.MODEL_DIR="'$OUT/cpu'" || exit 1
  step cpu_eval eval "${DATA[@]}" --gin.MODEL_DIR="'$OUT/cpu'" || exit 1
  cp "$OUT/cpu/eval_metrics.json" "${PREPARED%.npz}.cpu_metrics.json"
  line check=prepared path="$PREPARED" bytes="$(wc -c <"$PREPARED")" \
    cpu_metrics="$(cat "${PREPARED%.npz}.cpu_metrics.json")"
  exit 0
fi

# --- 1. the bench --------------------------------------------------------------------------
start=$SECONDS
# shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
if [ "${CHECK_BENCH:-1}" = 0 ]; then
  line check=bench ok=null skipped="CHECK_BENCH=0"
elif t5tpu bench --gin_file="$MODEL" --gin.T5Config.dtype="'bfloat16'" \
  --workloads=train,score,greedy --json --output="$OUT/bench.jsonl" $BENCH_FLAGS \
  >"$OUT/bench.stdout" 2>"$OUT/bench.log"; then
  "$PYTHON" - "$OUT/bench.jsonl" "$MODEL" <<'EOF'
import json, sys
results = [json.loads(line) for line in open(sys.argv[1])]
ours = {r["workload"]: r for r in results if r.get("impl") == "t5tpu"}
for name in ("train", "score", "greedy"):
    r = ours[name]
    out = {"check": "bench", "workload": name, "model": sys.argv[2], "dtype": "bfloat16"}
    keys = ("batch_size", "tokens_per_s", "new_tokens_per_s", "examples_per_s", "step_ms",
            "seconds_per_step", "compile_seconds", "fraction_of_limit", "mfu", "limit",
            "memory_floor_ms", "compute_floor_ms")
    out |= {k: r[k] for k in keys if k in r}
    if "achieved_flops_per_s" in r:
        out["achieved_tflops_per_s"] = r["achieved_flops_per_s"] / 1e12
    print(json.dumps(out), flush=True)
EOF
  line check=bench_done ok=true seconds=$((SECONDS - start))
else
  line check=bench ok=false log="$OUT/bench.log" error="$(tail -1 "$OUT/bench.log")"
fi

# Section 2 without TensorFlow: every command through scripts/without_tensorflow.py, which makes
# tensorflow, seqio and clu absent and writes what was imported all the same ("imported": []).
free() { # name, then the command's arguments; its output in $OUT/name.*
  local name=$1
  shift
  "$PYTHON" scripts/without_tensorflow.py "$OUT/$name.imports" "$@" >"$OUT/$name.stdout" \
    2>"$OUT/$name.log"
}
imports() { # what the command imported of them, as a JSON list (null: no report)
  "$PYTHON" -c 'import json, sys
print(json.dumps(json.load(open(sys.argv[1]))["imported"]))' "$OUT/$1.imports" 2>/dev/null \
    || echo null
}
failed() { # name, seconds since: the failure line
  line check="$1" ok=false seconds=$((SECONDS - $2)) error="$(tail -1 "$OUT/$1.log")"
}
free_train_with_sigterm() { # trains from the file; SIGTERM once step CHECK_STEPS/2 is reported
  local begun=$SECONDS at=$((STEPS / 2)) pid rc saved
  rm -f "$OUT/train.fifo" && mkfifo "$OUT/train.fifo"
  "$PYTHON" scripts/without_tensorflow.py "$OUT/train.imports" train "${FREE[@]}" \
    --gin.train.log_period=1 >"$OUT/train.fifo" 2>"$OUT/train.log" &
  pid=$!
  while IFS= read -r out; do
    printf '%s\n' "$out" >>"$OUT/train.stdout"
    case $out in "step $at/"*) kill -TERM "$pid" ;; esac
  done <"$OUT/train.fifo"
  wait "$pid"
  rc=$?
  saved=$(sed -n 's/^SIGTERM: saved checkpoint_\([0-9]*\);.*/\1/p' "$OUT/train.stdout")
  [ "$rc" = 0 ] || { failed train "$begun"; return 1; }
  line check=train_sigterm ok="$([ -n "$saved" ] && echo true || echo false)" \
    saved_step="${saved:-null}" seconds=$((SECONDS - begun)) imported="$(imports train)"
}
free_serve() { # one /v1/predict to `t5tpu serve` on 127.0.0.1, within SERVE_SECONDS
  local begun=$SECONDS port pid
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PYTHON" scripts/without_tensorflow.py "$OUT/serve.imports" serve --model="$OUT/tiny" \
    --host=127.0.0.1 --port="$port" --no_warmup >"$OUT/serve.log" 2>&1 &
  pid=$!
  "$PYTHON" - "$port" "${SERVE_SECONDS:-300}" examples/questions.txt >"$OUT/serve.stdout" <<'EOF2'
import json, sys, time, urllib.request
port, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
lines = open(sys.argv[3]).read().splitlines()[:3]
url = f"http://127.0.0.1:{port}"
while time.monotonic() < deadline:
    try:
        if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
            break
    except OSError:
        time.sleep(0.5)
body = json.dumps({"instances": lines}).encode()
ask = urllib.request.Request(f"{url}/v1/predict", body, {"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(ask, timeout=120))))
EOF2
  local rc=$?
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  if [ "$rc" = 0 ]; then
    line check=serve ok=true seconds=$((SECONDS - begun)) answer="$(cat "$OUT/serve.stdout")" \
      imported="$(imports serve)"
  else
    line check=serve ok=false seconds=$((SECONDS - begun)) error="$(tail -1 "$OUT/serve.log")"
  fi
}
without_tensorflow() {
  local begun
  if [ ! -f "$PREPARED" ]; then
    line check=tiny_train_eval_infer ok=null skipped="seqio and TensorFlow are not installed \
here and $PREPARED is missing: run \`bash scripts/accelerator_check.sh prepare\` where they are \
and bring the file with the tree"
    return
  fi
  FREE=("${DATA[@]}" "${RUN[@]}" --gin.PREPARED_DATA="'$PREPARED'")
  free_train_with_sigterm || return
  begun=$SECONDS
  free train_resume train "${FREE[@]}" || { failed train_resume "$begun"; return; }
  line check=train_resume ok=true seconds=$((SECONDS - begun)) imported="$(imports train_resume)" \
    resumed="$(grep -c '^resuming from' "$OUT/train_resume.stdout")"
  begun=$SECONDS
  free eval eval "${FREE[@]}" || { failed eval "$begun"; return; }
  line check=eval_metrics ok=true seconds=$((SECONDS - begun)) imported="$(imports eval)" \
    metrics="$(cat "$OUT/tiny/eval_metrics.json")" \
    cpu_metrics="$(cat "${PREPARED%.npz}.cpu_metrics.json" 2>/dev/null || echo null)"
  begun=$SECONDS
  free infer infer "${FREE[@]}" --gin.INFER_INPUT_FILE="'examples/questions.txt'" \
    || { failed infer "$begun"; return; }
  line check=infer_file ok=true seconds=$((SECONDS - begun)) imported="$(imports infer)" \
    predictions="$(cat "$OUT"/tiny/inference/*.jsonl | "$PYTHON" -c 'import json, sys
print(json.dumps([json.loads(l)["prediction"] for l in sys.stdin]))')"
  free_serve
}

# --- 2. the tiny train -> eval -> infer --------------------------------------------------------
RUN=(--gin.MODEL_DIR="'$OUT/tiny'")
if [ "${CHECK_WITHOUT_TF:-0}" = 1 ] || ! "$PYTHON" -c 'import seqio, tensorflow' >/dev/null 2>&1; then
  without_tensorflow
  exit 0
fi
step train train "${DATA[@]}" "${RUN[@]}" || exit 0
step eval eval "${DATA[@]}" "${RUN[@]}" \
  && "$PYTHON" -c 'import json, sys
metrics = json.load(open(sys.argv[1]))
print(json.dumps({"check": "eval_metrics", "metrics": metrics}), flush=True)' \
    "$OUT/tiny/eval_metrics.json"
step infer infer "${DATA[@]}" "${RUN[@]}" --gin.INFER_INPUTS="['is duplicate: How do I learn Python? <SEP> What is the best way to learn Python?']" \
  && "$PYTHON" -c 'import glob, json, sys
rows = [json.loads(l) for path in sorted(glob.glob(sys.argv[1])) for l in open(path)]
print(json.dumps({"check": "infer_predictions", "predictions": rows}), flush=True)' \
    "$OUT/tiny/inference/*.jsonl"
exit 0
