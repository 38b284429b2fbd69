#!/usr/bin/env bash
# Validate npu-shadow on this host's accelerator (an NPU, a GPU; the emulated npu where there is none) and write
# the bundle a team attaches to the pull request: device-check.json and device-check.md in
# ${NPU_SHADOW_DEVICE_CHECK_OUT:-npu-shadow-device-check}. Under 5 minutes on one device; --small for a quick run
# (CI runs it so on the emulated npu). Exit 0: training stayed bitwise unchanged; 1: it did not.
#
# Python: $PYTHON where set (the job's, on a device host with its own torch and no network); else .venv's where set
# up; else a python3 that already has torch; else .venv is set up first (scripts/setup.sh). It runs from this
# checkout and installs nothing into an environment of the job's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  :
elif [ -x .venv/bin/python ]; then
  PYTHON=.venv/bin/python
elif python3 -c "import torch" >/dev/null 2>&1; then
  PYTHON=python3
else
  bash scripts/setup.sh
  PYTHON=.venv/bin/python
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore exec "$PYTHON" -m shadow validate "$@"
