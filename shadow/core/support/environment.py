"""What this process runs on, as evidence records it: this package's version, torch's and torch_npu's, the device.

Torch is imported where it is asked about, not here: the analysis tools (verdict, report) read the metric contract,
which names these, and start without it."""

from __future__ import annotations

import importlib.metadata
import sys

VERSION = "0.1.0"


def device() -> str:
    """This process's device, as reports show it: 'cpu', 'npu x2 (emulated)', 'cuda x8'."""
    import torch

    from shadow.npu import emulated

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return "cpu"
    suffix = " (emulated)" if emulated.installed_devices() else ""
    return f"{accelerator.type} x{torch.accelerator.device_count()}{suffix}"


def versions() -> dict[str, str]:
    """This package, torch and torch_npu (``none`` when absent; torch_npu is never imported to find out)."""
    try:
        torch_npu = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        torch_npu = "none"
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.__version__
    else:  # (a process that never needed torch, the verdict's: the installed one, as metadata has it)
        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            version = "none"
    return {"version": VERSION, "torch": version, "torch_npu": torch_npu}
