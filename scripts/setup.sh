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
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
echo "$WANTED" > "$STAMP"
