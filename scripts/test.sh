#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers, each test file on one of them (its module fixtures built once): the suite is
# bound by one-threaded compiles and subprocess start-ups, so two cores finish it ~1.5x sooner.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
