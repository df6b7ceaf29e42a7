#!/usr/bin/env bash
# The free lane of CI (issue 67): t5tpu as `pip install` gives it to a user today, so that a new
# release of jax, flax, optax or orbax-checkpoint that breaks t5tpu fails CI first.
#   - .[test] resolved without constraints.txt, upgraded eagerly (the newest releases that
#     pyproject.toml's ranges admit), in a Python 3.12 venv of its own ($VENV_LATEST, default
#     .venv312); the versions it got are printed first;
#   - without the `parity` extra (torch, transformers, PEFT): the tests marked `parity` are
#     deselected, and the two files that import torch as they load are left out by name;
#   - the files that exercise jax, flax, optax and orbax-checkpoint (the network, its step and
#     optimizer, partitioning, decoding, checkpoints), quick tests only: the whole suite runs on
#     the pinned set (scripts/test.sh), and the CI run stays within its time.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON_LATEST:-python3.12}
VENV=${VENV_LATEST:-.venv312}
if ! "$PYTHON" --version >/dev/null 2>&1 && command -v pyenv >/dev/null; then
  # pyenv's shim answers only for the versions made global; take its newest 3.12 itself.
  PYTHON="$(pyenv root)/versions/$(pyenv versions --bare | grep '^3\.12' | tail -1)/bin/python"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
start=$SECONDS
"$VENV/bin/python" -m pip install -q --upgrade pip
PYTHONWARNINGS=ignore::UserWarning "$VENV/bin/python" -m pip install -q --no-compile \
  --upgrade --upgrade-strategy eager -e ".[test]"
echo "test_latest.sh: installed in $((SECONDS - start)) s:" \
  "$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null |
    grep -iE '^(jax|jaxlib|flax|optax|orbax-checkpoint|numpy|ml.dtypes|tensorstore)==' |
    tr '\n' ' ')"
STACK_TESTS=()
for name in network train_step optim partitioning decoding engine beam_search scan_layers \
  t5x_format resume lora; do
  STACK_TESTS+=("tests/test_$name.py")
done
"$VENV/bin/python" -m pytest -q -n 2 --dist loadfile -m "not slow and not parity" \
  "${STACK_TESTS[@]}" "$@"
