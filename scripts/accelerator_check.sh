#!/usr/bin/env bash
# The accelerator check, on whatever accelerator jax sees (a GPU, a TPU VM, else the CPU): one
# JSON line per result on stdout, the commands' own output in $CHECK_DIR.
#   1. the device jax runs on;
#   2. `t5tpu bench` of T5 1.1 base in bfloat16 (random weights, no data): train, score and
#      greedy, each with its fraction of the bf16 matmul peak measured in the same run (train's
#      is its MFU: "mfu") or, for greedy, of its memory floor, and the achieved TFLOP/s;
#   3. a CHECK_STEPS-step train -> eval -> infer of the tiny Quora experiment (its cpu topology
#      takes the visible devices: one GPU is a 1-device data mesh). It needs seqio and
#      TensorFlow; where they are missing, one line says so and the check goes on.
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
#   CHECK_STEPS=50      the tiny run's train steps
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
OUT=${CHECK_DIR:-$(mktemp -d /tmp/accelerator_check.XXXXXX)}
mkdir -p "$OUT"

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

# --- 1. the bench --------------------------------------------------------------------------
start=$SECONDS
# shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
if t5tpu bench --gin_file="$MODEL" --gin.T5Config.dtype="'bfloat16'" \
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

# --- 2. the tiny train -> eval -> infer --------------------------------------------------------
if ! "$PYTHON" -c 'import seqio, tensorflow' >/dev/null 2>&1; then
  line check=tiny_train_eval_infer ok=null \
    skipped="seqio and TensorFlow are not installed here: the task's input pipeline needs them (pip install -e . brings them)"
  exit 0
fi
EXPERIMENT=configs/experiments/qp_is_duplicate_tiny_cpu.gin
RUN=(--gin_file="$EXPERIMENT" --gin.MODEL_DIR="'$OUT/tiny'")
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
step train train "${RUN[@]}" --gin.TRAIN_STEPS="$STEPS" --gin.SAVE_PERIOD="$STEPS" \
  --gin.EVAL_PERIOD=0 --gin.BATCH_SIZE=8 || exit 0
step eval eval "${RUN[@]}" --gin.EVAL_NUM_EXAMPLES=64 \
  && "$PYTHON" -c 'import json, sys
metrics = json.load(open(sys.argv[1]))
print(json.dumps({"check": "eval_metrics", "metrics": metrics}), flush=True)' \
    "$OUT/tiny/eval_metrics.json"
step infer infer "${RUN[@]}" --gin.INFER_INPUTS="['is duplicate: How do I learn Python? <SEP> What is the best way to learn Python?']" \
  && "$PYTHON" -c 'import glob, json, sys
rows = [json.loads(l) for path in sorted(glob.glob(sys.argv[1])) for l in open(path)]
print(json.dumps({"check": "infer_predictions", "predictions": rows}), flush=True)' \
    "$OUT/tiny/inference/*.jsonl"
exit 0
