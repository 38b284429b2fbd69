#!/usr/bin/env bash
# Set up (see setup.sh) and run the whole test suite and the linter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest -q "$@"
