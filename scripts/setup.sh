#!/usr/bin/env bash
# Create .venv (once) with torch 2.13.0 and this project with its dev extras; g++ from Debian's
# build-essential when no C++ compiler is found.
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# The emulated npu (shadow/npu/emulated) is a C++ extension built on first use: it needs a C++ compiler.
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends build-essential >/dev/null
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0
# (PYTHONWARNINGS: setuptools' editable build prints a BuildBackendWarning banner on every install otherwise)
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[dev]"
