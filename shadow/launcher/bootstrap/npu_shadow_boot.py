"""Start-up of every process of a job run by ``npu-shadow run``; imports nothing heavy.

Kept outside the ``shadow`` package's import path (``shadow/__init__`` imports torch): processes that never
import torch pay only for this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from typing import Any

ENABLED = "NPU_SHADOW_ENABLED"
METRICS_DIR = "NPU_SHADOW_METRICS_DIR"  # set by the launcher when metrics are served
METRICS_LAYOUT = "NPU_SHADOW_METRICS_LAYOUT"  # "rank": a directory per local rank; "node": one for all
FAILED = "NPU_SHADOW_FAILED_FILE"  # where a process whose monitor could not start says why (the launcher reads it)


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` right after module ``name`` has finished importing."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            self.then()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _metrics_dir() -> None:
    """Point prometheus-client's multiprocess mode at this rank's (or this node's) directory, before it loads."""
    base = os.environ.get(METRICS_DIR)
    if not base or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return  # not serving, or inherited from the rank that started this worker
    rank = os.environ.get("LOCAL_RANK", "0")
    directory = os.path.join(base, f"rank{rank}") if os.environ.get(METRICS_LAYOUT) == "rank" else base
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def _after_torch() -> None:
    """Right after ``import torch``: install, and watch for a later ``import torch_npu``."""
    from shadow.launcher import launch

    try:
        launch.install_from_env()
    except Exception as exc:  # never break the job's `import torch`; the launcher ends with 2 (FAILED)
        print(f"npu-shadow: not installed: {exc}", file=sys.stderr)
        _say_failed(f"{type(exc).__name__}: {exc}")
        return
    if "torch_npu" not in sys.modules:
        sys.meta_path.insert(0, AfterImport("torch_npu", launch.refresh))


def _say_failed(reason: str) -> None:
    path = os.environ.get(FAILED)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as file:  # (one short line: appended whole)
            file.write(reason.replace("\n", " ")[:500] + "\n")
    except OSError:
        pass


def arm() -> None:
    """Install the monitor right after torch is imported (now, if it already is)."""
    if os.environ.get(ENABLED) != "1":
        return
    _metrics_dir()
    if "torch" in sys.modules:
        _after_torch()
    else:
        sys.meta_path.insert(0, AfterImport("torch", _after_torch))
