#!/usr/bin/env bash
# Create .venv (once) with torch 2.13.0 and this project with its dev extras; g++ from Debian's
# build-essential when no C++ compiler is found.
# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# Every step whose result is already there is skipped: on a set-up clone this takes a fraction of a second. The
# editable install is redone only when its stamp (pyproject.toml, the top-level packages, this checkout's path)
# changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The emulated npu (shadow/npu/emulated) is a C++ extension built on first use: it needs a C++ compiler.
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "== setup: installing a C++ compiler (Debian's build-essential, a minute)" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends build-essential >/dev/null
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== setup: creating .venv (about 5 s)" >&2
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
# (the installed distribution's metadata, not `import torch`: that alone takes seconds)
if ! compgen -G ".venv/lib/python*/site-packages/torch-2.13.0*.dist-info" >/dev/null; then
  echo "== setup: installing torch 2.13.0 into .venv (about 200 MB for the CPU build: 20 s on a fast link, minutes on a slow one)" >&2
  .venv/bin/python -m pip install -q torch==2.13.0
fi
stamp=.venv/.npu-shadow-installed
wanted=$( (pwd; cat pyproject.toml; ls -d -- */__init__.py 2>/dev/null) | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/npu-shadow ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  echo "== setup: installing npu-shadow and its dev tools into .venv (about 15 s)" >&2
  # (PYTHONWARNINGS: setuptools' editable build prints a BuildBackendWarning banner on every install otherwise)
  PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$wanted" >"$stamp"
fi
