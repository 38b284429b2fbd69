#!/usr/bin/env bash
# Set up (see setup.sh) and run the demo: a small training job shadowed by npu-shadow.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/quickstart.py "$@"
