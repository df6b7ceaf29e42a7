#!/usr/bin/env bash
# Creates .venv (if missing) and installs t5tpu with the pinned, tested dependency set.
# Idempotent: a second run with the same pyproject.toml and constraints.txt installs nothing
# (pip would rebuild the editable install and repeat setuptools' warnings every time).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
STAMP=.venv/.t5tpu-installed
WANTED=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANTED" ] && [ -x .venv/bin/t5tpu ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# pip byte-compiles every module one at a time; compileall spreads them over the cores
# (docs/PERFORMANCE.md). Its errors are Python 2 files some packages ship, which pip skips too.
# PYTHONWARNINGS: setuptools' notes on how editable installs work (a box of asterisks) stay out.
PYTHONWARNINGS=ignore::UserWarning \
  .venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[test,parity]"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages > /dev/null || true
echo "$WANTED" > "$STAMP"
