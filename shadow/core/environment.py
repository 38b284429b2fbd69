"""What this process runs on, as evidence records it: this package's version, torch's and torch_npu's, the device."""

from __future__ import annotations

import importlib.metadata

import torch

from shadow.npu import emulated

VERSION = "0.1.0"


def device() -> str:
    """This process's device, as reports show it: 'cpu', 'npu x2 (emulated)', 'cuda x8'."""
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
    return {"version": VERSION, "torch": torch.__version__, "torch_npu": torch_npu}
