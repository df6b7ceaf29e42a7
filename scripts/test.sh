#!/usr/bin/env bash
# Set up, lint, and run the test suite (what CI runs): every test but those marked `slow`
# (end-to-end runs of the command line, minutes each), of which the `smoke` ones run too.
#   bash scripts/test.sh            the default run (CI's)
#   bash scripts/test.sh --all      everything, the slow tests too (~35 minutes on 2 cores)
#   bash scripts/test.sh ARGS       ARGS go on to pytest (a later -m replaces the default's)
set -euo pipefail
SELECTED=(-m "not slow or smoke")
if [ "${1:-}" = "--all" ]; then
  SELECTED=()
  shift
fi
cd "$(dirname "$0")/.."
# Room for the suite's checkpoints, checked before it starts: a full disk would otherwise show
# as hundreds of failing tests.
TEMP="${TMPDIR:-/tmp}" NEED_MB=2048
if [ ! -d "$TEMP" ]; then
  echo "test.sh: the temporary folder $TEMP (TMPDIR) is not a folder: create it or unset TMPDIR." >&2
  exit 2
fi
FREE_MB=$(df --output=avail -BM "$TEMP" | tail -1 | tr -dc 0-9)
if [ "$FREE_MB" -lt "$NEED_MB" ]; then
  echo "test.sh: $FREE_MB MB free in $TEMP; the tests need about $NEED_MB MB." \
    "Free some space there, or set TMPDIR to a folder on a larger disk." >&2
  exit 2
fi
bash scripts/setup.sh
# TPU's compiler, for the tests of `t5tpu plan`'s compile: beside .venv, not in it (installed,
# libtpu makes every jax start on a machine without TPUs print its complaints).
LIBTPU=$(grep '^libtpu==' constraints.txt)
if [ ! -d ".libtpu/${LIBTPU/==/-}.dist-info" ]; then
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .libtpu "$LIBTPU"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers, each test file on one of them (its module fixtures built once): the suite is
# bound by one-threaded compiles and subprocess start-ups, so two cores finish it ~1.5x sooner.
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 \
  "${SELECTED[@]}" "$@"
