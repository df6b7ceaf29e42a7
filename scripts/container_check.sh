#!/usr/bin/env bash
# The image, built and checked as someone deploying t5tpu on Vertex AI would before pushing it:
#
#   1. build it from the repository's Dockerfile: with docker where a daemon answers, else with
#      buildah (installed with apt-get if missing), which needs no daemon;
#   2. `--help` answers;
#   3. a tiny train -> eval -> infer into a mounted MODEL_DIR, run as the image's own user (not
#      root), predicts exactly what the same run outside the container predicts;
#   4. as a Vertex AI prediction container (no command; AIP_HTTP_PORT, AIP_STORAGE_URI pointing
#      to that MODEL_DIR, AIP_HEALTH_ROUTE and AIP_PREDICT_ROUTE as Vertex AI sets them) it
#      answers health, and predict equal to `t5tpu infer`'s predictions;
#   5. SIGTERM stops the server cleanly (exit code 0, its "stopped (SIGTERM)" line).
#
# Then it prints the build time, the image size (and what it is made of) and the serving
# start-up time. Containers are removed on exit, whatever happened (trap).
#
#   bash scripts/container_check.sh        # as root where buildah is used (apt-get, storage)
#
# Where the base image (python:3.11-slim) cannot be pulled, as on this project's machines (no
# registry but the package ones), a stand-in is built once from Debian bookworm with debootstrap
# and kept in buildah's storage under the base's name; the output says so.
#
# Settings (environment): T5TPU_CHECK_STEPS (train steps, default 8), T5TPU_CHECK_IMAGE (the
# image's name), T5TPU_CHECK_ENGINE (docker or buildah, default: docker if a daemon answers).
# The comparison run outside the container uses .venv (bash scripts/setup.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=docker.io/library/python:3.11-slim
STAND_IN_LABEL=t5tpu.stand-in
IMAGE=${T5TPU_CHECK_IMAGE:-localhost/t5tpu-check:cpu}
STEPS=${T5TPU_CHECK_STEPS:-8}
EXPERIMENT=configs/experiments/qp_is_duplicate_tiny_cpu.gin
# Bounded waits, seconds: every step that can hang has one.
BUILD_TIMEOUT=${T5TPU_CHECK_BUILD_TIMEOUT:-2400}
RUN_TIMEOUT=900
SERVE_TIMEOUT=1200 # compiling ~200 programs: 90 s on a quiet machine, 8 min at load 10
STOP_TIMEOUT=60

say() { printf 'container_check: %s\n' "$*"; }
fail() {
  printf 'container_check: FAILED: %s\n' "$*" >&2
  exit 1
}

# --- the engine -----------------------------------------------------------------------------

# docker if a daemon answers within 10 s, else buildah.
choose_engine() {
  if [ -n "${T5TPU_CHECK_ENGINE:-}" ]; then
    ENGINE=$T5TPU_CHECK_ENGINE
  elif command -v docker > /dev/null && timeout 10 docker info > /dev/null 2>&1; then
    ENGINE=docker
  else
    ENGINE=buildah
  fi
  case "$ENGINE" in
    docker | buildah) ;;
    *) fail "T5TPU_CHECK_ENGINE=$ENGINE: docker or buildah" ;;
  esac
  if [ "$ENGINE" = buildah ]; then
    ensure_packages buildah
    # Containers here cannot use buildah's default (OCI runtime) isolation; chroot works, and
    # shares the host's network.
    export BUILDAH_ISOLATION=chroot
  fi
  say "engine: $ENGINE"
}

# apt-get installs what is missing (apt-get update once first).
ensure_packages() {
  local missing=() cmd
  for cmd in "$@"; do
    command -v "$cmd" > /dev/null || missing+=("$cmd")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || fail "${missing[*]} missing and not root: apt-get install ${missing[*]}"
  say "installing ${missing[*]} (apt-get)"
  timeout 600 apt-get update -qq || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq "${missing[@]}" > /dev/null \
    || fail "apt-get install ${missing[*]} failed"
}

# --- the base image -------------------------------------------------------------------------

# The base from the registry, or the stand-in kept from an earlier run, or a new stand-in.
ensure_base() {
  [ "$ENGINE" = buildah ] || return 0 # docker pulls it itself during the build
  if buildah inspect --type image "$BASE" > /dev/null 2>&1; then
    :
  elif timeout 120 buildah pull -q "$BASE" > /dev/null 2>&1; then
    say "base: $BASE pulled from its registry"
    return 0
  else
    say "base: $BASE cannot be pulled here; building a stand-in from Debian bookworm (~6 min)"
    build_stand_in
  fi
  if [ -n "$(buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$STAND_IN_LABEL\"}}" "$BASE")" ]; then
    say "base: a STAND-IN for $BASE (Debian bookworm's python3 by debootstrap, not the official image)"
  else
    say "base: $BASE"
  fi
}

# Debian bookworm's python3 shaped like the official python:3.11-slim where the Dockerfile
# relies on it: `python` and `pip` in /usr/local/bin, pip allowed to install system-wide (no
# EXTERNALLY-MANAGED marker), PATH with the sbin folders (useradd lives there).
build_stand_in() {
  ensure_packages debootstrap
  local rootfs ctr
  rootfs=$(mktemp -d /var/tmp/t5tpu-stand-in.XXXXXX)
  timeout 1800 debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian > "$rootfs.log" 2>&1 \
    || fail "debootstrap failed (last lines of $rootfs.log: $(tail -n 3 "$rootfs.log" | tr '\n' ' '))"
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python3"
  ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
  ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip3"
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  # What the official image leaves out too: apt's lists and caches, man pages.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/*
  ctr=$(buildah from scratch)
  buildah copy -q "$ctr" "$rootfs" / > /dev/null
  buildah config \
    --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --cmd python3 \
    --label "$STAND_IN_LABEL=debootstrap bookworm minbase python3" "$ctr"
  buildah commit -q --rm "$ctr" "$BASE" > /dev/null
  rm -rf "$rootfs" "$rootfs.log"
}

# --- building -------------------------------------------------------------------------------

# `-v SRC:SRC:ro` for buildah's build: pip inside it reaches the package index only with this
# host's pip settings (its CA certificates, local indexes and wheel folders), so the files that
# hold those settings and the folders they point into are mounted read-only at the same places.
pip_mounts() {
  local pip=(python3 -m pip) line path files=() folders=() seen=" "
  [ -x "$ROOT/.venv/bin/python" ] && pip=("$ROOT/.venv/bin/python" -m pip)
  # `pip config debug` names the config files ("  /etc/pip.conf, exists: True") and their
  # values ("    global.cert: /etc/ssl/certs/ca-certificates.crt"), the environment's too
  # ("  PIP_CERT='...'"); extra-index-url may list several.
  while IFS= read -r line; do
    case "$line" in
      *", exists: True") files+=("$(echo ${line%, exists: True})") ;;
      *cert:* | *find-links:* | *index-url:* | *constraint:* | *PIP_CERT=* | *PIP_FIND_LINKS=* \
        | *INDEX_URL=* | *PIP_CONSTRAINT=*)
        path=${line#*[:=]} path=${path//\'/}
        for path in $path; do
          path=${path#file://}
          [ "${path:0:1}" = / ] && [ -e "$path" ] || continue # URLs reach the net themselves
          # A file's folder (a CA bundle's neighbours are links into it); a local index's
          # root (its pages link to files beside /simple).
          [ -d "$path" ] || path=$(dirname "$path")
          folders+=("${path%/simple}")
        done
        ;;
    esac
  done < <("${pip[@]}" config debug 2> /dev/null)
  PIP_MOUNTS=()
  for path in "${folders[@]}" "${files[@]}"; do
    case "$seen" in *" $path "* | *" ${path%/*} "*) continue ;; esac # mounted already
    seen+="$path "
    PIP_MOUNTS+=(-v "$path:$path:ro")
  done
}

build_image() {
  local start log=$WORK/build.log
  start=$(date +%s)
  say "building $IMAGE from $ROOT/Dockerfile (log: $log)"
  if [ "$ENGINE" = docker ]; then
    timeout "$BUILD_TIMEOUT" docker build -t "$IMAGE" "$ROOT" > "$log" 2>&1 || build_failed $?
  else
    pip_mounts
    say "pip's settings mounted into the build: ${PIP_MOUNTS[*]}"
    # --layers: one layer per instruction, as docker makes them (so the size is docker's too).
    timeout "$BUILD_TIMEOUT" buildah build --pull=never --isolation=chroot --layers \
      "${PIP_MOUNTS[@]}" -t "$IMAGE" "$ROOT" > "$log" 2>&1 || build_failed $?
  fi
  BUILD_S=$(($(date +%s) - start))
  if grep -q -i 'using cache' "$log"; then
    say "built in ${BUILD_S} s, with layers cached from an earlier build"
  else
    say "built in ${BUILD_S} s"
  fi
}

build_failed() {
  tail -n 20 "$WORK/build.log" >&2
  [ "$1" -eq 124 ] && fail "the build took over ${BUILD_TIMEOUT} s"
  fail "the build failed (exit code $1; its last lines above)"
}

# --- running --------------------------------------------------------------------------------

# Runs a new container of the image, named NAME, whose entrypoint gets ARGS, for at most LIMIT
# seconds; the environment is given as -e NAME=VALUE pairs before `--`. It runs as the image's
# user with $WORK/container mounted at /work, and shares the host's network (buildah) or
# publishes $PORT on 127.0.0.1 only (docker). Output goes to $WORK/NAME.log.
run_in_image() {
  local name=$1 limit=$2 envs=() ctr
  shift 2
  while [ "$1" != -- ]; do
    envs+=("$1" "$2")
    shift 2
  done
  shift
  ctr=t5tpu-check-$name-$$
  if [ "$ENGINE" = docker ]; then
    timeout "$limit" docker run --name "$ctr" -v "$WORK/container:/work" \
      ${PORT:+-p "127.0.0.1:$PORT:$PORT"} "${envs[@]}" "$IMAGE" "$@"
  else
    buildah from --pull=never --name "$ctr" "$IMAGE" > /dev/null
    # buildah run runs a command, not the image's ENTRYPOINT: the entrypoint is named here.
    timeout "$limit" buildah run --isolation=chroot -v "$WORK/container:/work" "${envs[@]}" \
      "$ctr" -- "${ENTRYPOINT[@]}" "$@"
  fi > "$WORK/$name.log" 2>&1
}

# `t5tpu ARGS` in the image (the run NAME); fails with the log's end unless it exits 0.
in_image() {
  local name=$1 code=0
  shift
  run_in_image "$name" "$RUN_TIMEOUT" -- "$@" || code=$?
  [ "$code" -eq 0 ] || run_failed "$name" "$code"
}

# `t5tpu ARGS` with the checkout's .venv, outside any container (the run NAME).
on_host() {
  local name=$1 code=0
  shift
  (cd "$ROOT" && timeout "$RUN_TIMEOUT" .venv/bin/t5tpu "$@") > "$WORK/$name.log" 2>&1 || code=$?
  [ "$code" -eq 0 ] || run_failed "$name" "$code"
}

run_failed() {
  tail -n 15 "$WORK/$1.log" >&2
  [ "$2" -eq 124 ] && fail "$1 took over its time limit"
  fail "$1 exited $2 (the end of $WORK/$1.log above)"
}

# `sh -c COMMAND` in the image, as its user (the run NAME; output on stdout).
shell_in_image() {
  local name=$1 command=$2 ctr=t5tpu-check-$1-$$
  if [ "$ENGINE" = docker ]; then
    timeout "$RUN_TIMEOUT" docker run --name "$ctr" --entrypoint sh "$IMAGE" -c "$command"
  else
    buildah from --pull=never --name "$ctr" "$IMAGE" > /dev/null
    timeout "$RUN_TIMEOUT" buildah run --isolation=chroot "$ctr" -- sh -c "$command"
  fi
}

# The process ids under PID (children, theirs, ...), one a line.
descendants() {
  local pid child
  for pid in "$@"; do
    for child in $(ps -o pid= --ppid "$pid" 2> /dev/null); do
      echo "$child"
      descendants "$child"
    done
  done
}

# --- the checks -----------------------------------------------------------------------------

check_help() {
  in_image help -- --help
  grep -q 'train' "$WORK/help.log" && grep -q 'serve' "$WORK/help.log" \
    || fail "--help in the image does not list train and serve (see $WORK/help.log)"
  say "ok: --help"
}

# The tiny experiment's flags: STEPS steps, a checkpoint at the end, no eval during training.
tiny_flags() {
  TINY=(--gin_file="$EXPERIMENT" --gin.TRAIN_STEPS="$STEPS" --gin.SAVE_PERIOD="$STEPS"
    --gin.EVAL_PERIOD=0)
}

# Model inputs for infer and predict: 32 pairs of the bundled validation sample, in the
# `is duplicate: Q1 <SEP> Q2` form of examples/questions.txt.
write_inputs() {
  mkdir -p "$WORK/container" "$WORK/host"
  chmod 755 "$WORK"
  chmod 777 "$WORK/container" # the image's user writes MODEL_DIR here
  awk -F'\t' 'NR > 1 && NR <= 33 { printf "is duplicate: %s <SEP> %s\n", tolower($4), tolower($5) }' \
    "$ROOT/t5tpu/assets/quora_sample/validation.tsv" > "$WORK/container/inputs.txt"
  cp "$WORK/container/inputs.txt" "$WORK/host/inputs.txt"
}

# train -> eval -> infer with the checkout's .venv; runs in the background during the build.
host_runs() {
  local model=$WORK/host/model
  on_host host-train train "${TINY[@]}" --gin.MODEL_DIR="'$model'"
  on_host host-eval eval --gin_file="$EXPERIMENT" --gin.MODEL_DIR="'$model'"
  on_host host-infer infer --gin_file="$EXPERIMENT" --gin.MODEL_DIR="'$model'" \
    --gin.INFER_INPUT_FILE="'$WORK/host/inputs.txt'"
}

# The same runs in the image, into the mounted /work, as the image's user; then both compared.
check_runs() {
  in_image train train "${TINY[@]}" --gin.MODEL_DIR="'/work/model'"
  in_image eval eval --gin_file="$EXPERIMENT" --gin.MODEL_DIR="'/work/model'"
  in_image infer infer --gin_file="$EXPERIMENT" --gin.MODEL_DIR="'/work/model'" \
    --gin.INFER_INPUT_FILE="'/work/inputs.txt'"
  local owner
  owner=$(stat -c %u "$WORK/container/model/config.gin")
  [ "$owner" -ne 0 ] || fail "the image's runs wrote MODEL_DIR as root"
  say "ok: train ($STEPS steps) -> eval -> infer in the image, MODEL_DIR written by uid $owner"

  local code=0 outside
  wait "$HOST_PID" || code=$?
  HOST_PID=
  if [ "$code" -ne 0 ]; then
    cat "$WORK/host.log" >&2
    fail "the same runs outside the container failed (their output above)"
  fi
  INFERRED=$(ls "$WORK"/container/model/inference/inputs-*.jsonl)
  outside=$WORK/host/model/inference/$(basename "$INFERRED")
  cmp -s "$INFERRED" "$outside" \
    || fail "the image's predictions differ from those outside it: diff $INFERRED $outside"
  cmp -s "$WORK/container/model/eval_metrics.json" "$WORK/host/model/eval_metrics.json" \
    || fail "the image's eval metrics differ from those outside it (eval_metrics.json)"
  # The training's losses too (printed to 4 decimals): a tiny model this young predicts "0"
  # for most inputs, so its predictions alone would miss a small difference.
  [ "$(losses train)" = "$(losses host-train)" ] && [ -n "$(losses train)" ] \
    || fail "the image's training losses differ from those outside it: $(losses train) vs" \
      "$(losses host-train)"
  say "ok: the image's training losses ($(losses train | tail -n 1)), eval metrics and" \
    "$(wc -l < "$INFERRED") predictions equal those of the same runs outside it"
}

# The "step N/M  loss L  token_acc A" lines of the run NAME's log.
losses() {
  grep -o 'step [0-9]*/[0-9]*  loss [0-9.]*  token_acc [0-9.]*' "$WORK/$1.log" || true
}

# A free TCP port on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# As Vertex AI starts a prediction container: no command, the port and the model's folder in
# AIP_HTTP_PORT and AIP_STORAGE_URI, the routes in AIP_HEALTH_ROUTE and AIP_PREDICT_ROUTE (in
# the form Vertex AI gives them). Health, then predict equal to `t5tpu infer`'s, then SIGTERM.
check_serving() {
  local route=/v1/endpoints/1234567890/deployedModels/9876543210 flags=(--gin_file="$EXPERIMENT")
  local health predict url start code
  health=$route predict=$route:predict
  PORT=$(free_port)
  url=http://127.0.0.1:$PORT
  # buildah's containers share the host's network: listen on the loopback only (docker's listen
  # on 0.0.0.0 inside the container, as on Vertex AI, published on 127.0.0.1 only).
  [ "$ENGINE" = buildah ] && flags+=(--host=127.0.0.1)
  start=$(date +%s.%N)
  run_in_image serve $((SERVE_TIMEOUT + STOP_TIMEOUT)) -e AIP_HTTP_PORT="$PORT" \
    -e AIP_STORAGE_URI=/work/model -e AIP_HEALTH_ROUTE="$health" -e AIP_PREDICT_ROUTE="$predict" \
    -- "${flags[@]}" &
  SERVER_PID=$!

  while :; do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url$health" || true)
    [ "$code" = 200 ] && break
    if ! kill -0 "$SERVER_PID" 2> /dev/null; then
      code=0
      wait "$SERVER_PID" || code=$?
      run_failed serve "$code"
    fi
    (($(date +%s) - ${start%.*} < SERVE_TIMEOUT)) \
      || fail "the server was not healthy in ${SERVE_TIMEOUT} s (see $WORK/serve.log)"
    sleep 0.5
  done
  STARTUP_S=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  say "ok: GET $health answered 200, ${STARTUP_S} s after the container started"

  python3 -c 'import json, sys; print(json.dumps({"instances": open(sys.argv[1]).read().splitlines()}))' \
    "$WORK/container/inputs.txt" > "$WORK/request.json"
  code=$(curl -s -o "$WORK/answer.json" -w '%{http_code}' --max-time 120 \
    -H 'Content-Type: application/json' --data @"$WORK/request.json" "$url$predict" || true)
  [ "$code" = 200 ] || fail "POST $predict answered $code: $(head -c 300 "$WORK/answer.json")"
  python3 - "$WORK/answer.json" "$INFERRED" << 'PY' || fail "predict's answers differ from t5tpu infer's"
import json, sys
served = json.load(open(sys.argv[1]))["predictions"]
inferred = [json.loads(line)["prediction"] for line in open(sys.argv[2])]
for i, (a, b) in enumerate(zip(served, inferred)):
    if a != b:
        sys.exit(f"container_check: instance {i}: served {a!r}, infer wrote {b!r}")
if len(served) != len(inferred):
    sys.exit(f"container_check: {len(served)} predictions served, {len(inferred)} inferred")
PY
  say "ok: POST $predict answered t5tpu infer's $(wc -l < "$INFERRED") predictions"
  stop_server
}

# SIGTERM to the server (PID 1 of a docker container; under buildah, the t5tpu process among
# buildah run's descendants), then its exit code and its last line.
stop_server() {
  local pid code=0 waited=0
  if [ "$ENGINE" = docker ]; then
    docker kill --signal=TERM "t5tpu-check-serve-$$" > /dev/null
  else
    pid=$(for p in $(descendants "$SERVER_PID"); do
      ps -o pid=,args= -p "$p" | awk '/t5tpu serve/ { print $1 }'
    done | head -n 1)
    [ -n "$pid" ] || fail "no t5tpu serve process under buildah run (pid $SERVER_PID)"
    kill -TERM "$pid"
  fi
  while kill -0 "$SERVER_PID" 2> /dev/null; do
    ((waited++ < STOP_TIMEOUT * 2)) || fail "the server still runs ${STOP_TIMEOUT} s after SIGTERM"
    sleep 0.5
  done
  wait "$SERVER_PID" || code=$?
  SERVER_PID=
  [ "$code" -eq 0 ] || run_failed serve "$code"
  grep -q 'stopped (SIGTERM)' "$WORK/serve.log" \
    || fail "no 'stopped (SIGTERM)' line from the server (see $WORK/serve.log)"
  say "ok: SIGTERM: exit code 0, \"$(grep -o 'stopped (SIGTERM).*' "$WORK/serve.log" | tail -n 1)\""
}

# --- the numbers ----------------------------------------------------------------------------

report() {
  local bytes
  if [ "$ENGINE" = docker ]; then
    bytes=$(docker image inspect --format '{{.Size}}' "$IMAGE")
  else
    # the layers' sizes, as `buildah images` adds them up (uncompressed)
    bytes=$(buildah inspect --type image "$IMAGE" | python3 -c 'import json, sys
print(sum(layer["size"] for layer in json.loads(json.load(sys.stdin)["Manifest"])["layers"]))')
  fi
  say "what the image holds (MB, du), the largest first:"
  # (du counts a file once: the whole image apart from its parts.)
  shell_in_image du 'du -xsm / 2> /dev/null; du -sm /usr/local/lib/python3*/*-packages/* \
    /usr/lib/* 2> /dev/null | sort -rn | head -n 12' | sed 's/^/    /'
  # The machine's load beside them: on a shared machine, start-up time follows it.
  say "numbers: build_s=$BUILD_S image_mb=$((bytes / 1000000)) startup_s=$STARTUP_S" \
    "train_steps=$STEPS engine=$ENGINE load_avg=$(cut -d' ' -f1-3 /proc/loadavg | tr ' ' /)"
}

# --- cleaning up ----------------------------------------------------------------------------

# On any exit: the server and the runs outside (if still going) are stopped and every container
# made here removed; the work folder too after a success (kept for its logs after a failure).
cleanup() {
  local code=$? ctr pid p
  trap - EXIT INT TERM
  for pid in ${SERVER_PID:-} ${HOST_PID:-}; do
    kill -0 "$pid" 2> /dev/null || continue
    for p in $(descendants "$pid") "$pid"; do kill -TERM "$p" 2> /dev/null || true; done
  done
  # Every container is named t5tpu-check-NAME-$$ (some are made in subshells).
  if [ "$ENGINE" = docker ]; then
    for ctr in $(docker ps -a --format '{{.Names}}' | grep -- "^t5tpu-check-.*-$$\$"); do
      docker rm -f "$ctr" > /dev/null 2>&1 || true
    done
  elif [ "$ENGINE" = buildah ]; then
    for ctr in $(buildah containers --format '{{.ContainerName}}' | grep -- "^t5tpu-check-.*-$$\$"); do
      buildah rm "$ctr" > /dev/null 2>&1 || true
    done
  fi
  if [ "$code" -eq 0 ]; then
    rm -rf "$WORK"
  else
    say "logs kept in $WORK" >&2
  fi
  exit "$code"
}

main() {
  [ -x "$ROOT/.venv/bin/t5tpu" ] || fail "no .venv for the runs outside the container: bash scripts/setup.sh"
  ENGINE=
  WORK=$(mktemp -d /tmp/t5tpu-container-check.XXXXXX)
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  choose_engine
  ensure_packages curl
  tiny_flags
  write_inputs
  host_runs > "$WORK/host.log" 2>&1 &
  HOST_PID=$!
  ensure_base
  build_image
  if [ "$ENGINE" = buildah ]; then
    # buildah run does not run the ENTRYPOINT: read it from the image, to run it as docker would.
    mapfile -t ENTRYPOINT < <(buildah inspect --type image "$IMAGE" | python3 -c \
      'import json, sys; print("\n".join(json.load(sys.stdin)["OCIv1"]["config"]["Entrypoint"]))')
    [ "${#ENTRYPOINT[@]}" -gt 0 ] || fail "no ENTRYPOINT in $IMAGE"
  fi
  check_help
  check_runs
  check_serving
  report
  say "all checks passed"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
