"""npu-shadow: run torch_npu's legacy patches and upstream PyTorch side by side on sampled calls.

>>> import shadow
>>> with shadow.install(sample_rate=0.01) as monitor:
...     train()
>>> monitor.stats()

The public names load on first use: ``import shadow`` alone imports neither torch nor the engine, so a job may
import it before torch (under ``npu-shadow run`` the monitor is installed right after torch is imported, and finds
no module of this package half-imported), and the ``npu-shadow`` commands that need no torch (the receiver, the
verdict's help) start at once.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name and the module that defines it.
_PUBLIC = {
    "Comparison": "shadow.core.judging.compare",
    "compare": "shadow.core.judging.compare",
    "Experiment": "shadow.core.calls.engine",
    "Exporter": "shadow.core.calls.record.exporting",
    "Monitor": "shadow.core.calls.monitor",
    "install": "shadow.core.calls.monitor",
    "HARD_REASONS": "shadow.core.model.observation",
    "MISMATCH_REASONS": "shadow.core.model.observation",
    "OUTCOMES": "shadow.core.model.observation",
    "SKIP_REASONS": "shadow.core.model.observation",
    "Observation": "shadow.core.model.observation",
    "TargetStats": "shadow.core.model.observation",
    "BUILTINS": "shadow.core.model.targets",
    "Target": "shadow.core.model.targets",
    "Tolerance": "shadow.core.model.tolerance",
    "install_from_env": "shadow.launcher.launch",
    "patch_target": "shadow.launcher.patch_targets",
}

_SUBPACKAGES = ("analysis", "core", "launcher", "npu")

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("npu-shadow")
        except PackageNotFoundError:
            value = "0+unknown"
    elif name in _PUBLIC:
        import torch  # noqa: F401  (torch first: see the module's docstring)

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"shadow.{name}")
    else:
        raise AttributeError(f"module 'shadow' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
