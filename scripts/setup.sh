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
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "== setup: installing torch 2.13.0 into .venv (about 200 MB for the CPU build: a few minutes on a slow link)" >&2
  .venv/bin/python -m pip install -q torch==2.13.0
fi
# (PYTHONWARNINGS: setuptools' editable build prints a BuildBackendWarning banner on every install otherwise)
[ -x .venv/bin/npu-shadow ] || echo "== setup: installing npu-shadow and its dev tools into .venv (a minute)" >&2
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[dev]"
