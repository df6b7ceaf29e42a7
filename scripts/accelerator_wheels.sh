#!/usr/bin/env bash
# Downloads into .whl the wheels scripts/accelerator_check.sh lists in its header: what a
# machine with jax (and flax, optax, orbax-checkpoint, absl-py, sentencepiece, etils, numpy,
# tensorboard) but no network needs to run the check from this source tree. Then, on it:
#   T5TPU_WHEELS=.whl bash scripts/accelerator_check.sh
# PYTHON_VERSION (default 3.12) and PLATFORM (default manylinux2014_x86_64) are the target's.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=$(sed -n 's/^#   \([A-Za-z0-9_.-]*==[A-Za-z0-9_.-]*\)$/\1/p' scripts/accelerator_check.sh)
[ -n "$WHEELS" ] || { echo "no wheels listed in scripts/accelerator_check.sh" >&2; exit 1; }
mkdir -p .whl
# shellcheck disable=SC2086  # one argument per wheel
python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
  --platform "${PLATFORM:-manylinux2014_x86_64}" -d .whl $WHEELS
ls -l .whl
