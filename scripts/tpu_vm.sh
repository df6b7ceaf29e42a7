#!/usr/bin/env bash
# Cloud TPU VM helper: create a TPU VM (one host or a pod slice), install t5tpu on every worker,
# launch the same t5tpu command on every worker, follow its log, delete the VM.
#
#   scripts/tpu_vm.sh [--dry-run] --name=NAME --zone=ZONE [--project=PROJECT] ACTION [OPTIONS]
#
#   create  --accelerator=TYPE [--version=RUNTIME] [--spot]
#           TYPE is gcloud's (v2-8, v3-32, v4-8, v5litepod-8, v5p-8, v6e-8, ...) or a t5tpu
#           topology name (v5e-8 = v5litepod-8); RUNTIME defaults to the image for that family.
#   install [--package=SPEC]       pip install SPEC on every worker (default: a wheel of this
#                                  checkout, built here and copied to every worker, with the
#                                  'tpu' extra; SPEC may be a git URL or anything pip takes).
#   launch  -- COMMAND...          run COMMAND (e.g. t5tpu train --gin_file=...) on every worker
#                                  at once, in the background, logging to ~/t5tpu.log. On a pod
#                                  slice each worker is one JAX process; t5tpu starts
#                                  jax.distributed by itself.
#   logs    [--worker=N|all]       follow ~/t5tpu.log (default: worker 0, the one that writes
#                                  summaries and metrics).
#   delete                         delete the TPU VM.
#
# --dry-run prints the gcloud commands instead of running them. NAME, ZONE and PROJECT may also
# come from TPU_NAME, TPU_ZONE and CLOUDSDK_CORE_PROJECT.
#
# Example, a v3-32 (4 hosts) end to end:
#   scripts/tpu_vm.sh --name=t5 --zone=europe-west4-a create --accelerator=v3-32
#   scripts/tpu_vm.sh --name=t5 --zone=europe-west4-a install
#   scripts/tpu_vm.sh --name=t5 --zone=europe-west4-a launch -- t5tpu train \
#       --gin_file=configs/experiments/squad_v1_large_v3-32.gin --gin.MODEL_DIR="'gs://b/run'"
#   scripts/tpu_vm.sh --name=t5 --zone=europe-west4-a logs
#   scripts/tpu_vm.sh --name=t5 --zone=europe-west4-a delete
set -euo pipefail

DRY_RUN=0
NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${CLOUDSDK_CORE_PROJECT:-}"
LOG='~/t5tpu.log'

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "tpu_vm.sh: error: $*" >&2
  exit 2
}

# One argument as the shell reads it back: bare when plain, else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./=:@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

quote_all() {
  local out=() arg
  for arg in "$@"; do out+=("$(quote "$arg")"); done
  echo "${out[*]}"
}

# Runs (or with --dry-run prints, quoted so that it can be pasted) one command.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    quote_all "$@"
  else
    "$@"
  fi
}

gcloud_tpu() {
  local project=()
  [[ -n "$PROJECT" ]] && project=(--project="$PROJECT")
  run gcloud compute tpus tpu-vm "$@" --zone="$ZONE" "${project[@]}"
}

# t5tpu topology names -> gcloud accelerator types.
accelerator_type() {
  case "$1" in
    v5e-*) echo "v5litepod-${1#v5e-}" ;;
    *) echo "$1" ;;
  esac
}

# The TPU VM software image for an accelerator family.
runtime_version() {
  case "$1" in
    v2-* | v3-* | v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "unknown accelerator type $1; pass --version=RUNTIME" ;;
  esac
}

create() {
  local accelerator="" version="" spot=()
  for arg in "$@"; do
    case "$arg" in
      --accelerator=*) accelerator="$(accelerator_type "${arg#*=}")" ;;
      --version=*) version="${arg#*=}" ;;
      --spot) spot=(--spot) ;;
      *) die "create: unknown option $arg" ;;
    esac
  done
  [[ -n "$accelerator" ]] || die "create needs --accelerator=TYPE (e.g. v3-32)"
  [[ -n "$version" ]] || version="$(runtime_version "$accelerator")"
  gcloud_tpu create "$NAME" --accelerator-type="$accelerator" --version="$version" "${spot[@]}"
}

install() {
  local package=""
  for arg in "$@"; do
    case "$arg" in
      --package=*) package="${arg#*=}" ;;
      *) die "install: unknown option $arg" ;;
    esac
  done
  if [[ -z "$package" ]]; then
    # t5tpu is not on PyPI: a wheel of this checkout goes to every worker's home directory.
    local root version wheel
    root="$(cd "$(dirname "$0")/.." && pwd)"
    version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")"
    wheel="t5tpu-$version-py3-none-any.whl"
    run python3 -m pip wheel --no-deps --wheel-dir="$root/dist" "$root"
    gcloud_tpu scp "$root/dist/$wheel" "$NAME:$wheel" --worker=all
    package="./$wheel[tpu]"
  fi
  local remote
  remote="python3 -m pip install --upgrade pip && python3 -m pip install $(quote "$package")"
  gcloud_tpu ssh "$NAME" --worker=all --command="$remote"
}

launch() {
  [[ "${1:-}" == "--" ]] && shift
  [[ $# -gt 0 ]] || die "launch needs the command to run: launch -- t5tpu train --gin_file=..."
  # Every worker starts the same command; nohup keeps it running after ssh returns.
  gcloud_tpu ssh "$NAME" --worker=all --command="nohup $(quote_all "$@") > $LOG 2>&1 &"
}

logs() {
  local worker=0
  for arg in "$@"; do
    case "$arg" in
      --worker=*) worker="${arg#*=}" ;;
      *) die "logs: unknown option $arg" ;;
    esac
  done
  gcloud_tpu ssh "$NAME" --worker="$worker" --command="tail -n 100 -f $LOG"
}

delete() {
  [[ $# -eq 0 ]] || die "delete takes no options"
  gcloud_tpu delete "$NAME" --quiet
}

main() {
  local action=""
  while [[ $# -gt 0 && -z "$action" ]]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      --name=*) NAME="${1#*=}" ;;
      --zone=*) ZONE="${1#*=}" ;;
      --project=*) PROJECT="${1#*=}" ;;
      -h | --help) usage ;;
      create | install | launch | logs | delete) action="$1" ;;
      *) die "unknown argument $1 (actions: create, install, launch, logs, delete)" ;;
    esac
    shift
  done
  [[ -n "$action" ]] || usage
  [[ -n "$NAME" ]] || die "no TPU VM name: pass --name=NAME or set TPU_NAME"
  [[ -n "$ZONE" ]] || die "no zone: pass --zone=ZONE or set TPU_ZONE"
  if [[ "$DRY_RUN" == 0 ]] && ! command -v gcloud > /dev/null; then
    die "gcloud not found; install the Google Cloud CLI (or use --dry-run to see the commands)"
  fi
  "$action" "$@"
}

main "$@"
