"""npu-shadow's start-up hook (on PYTHONPATH only under ``npu-shadow run``); chains to any other
sitecustomize, then arms the monitor."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the sitecustomize this one hides, if there is one further down sys.path."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()

import npu_shadow_boot  # noqa: E402  (this folder is on sys.path)

npu_shadow_boot.arm()
