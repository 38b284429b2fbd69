"""What torch_npu's legacy code sees on this host, where the accelerator is not a real NPU: ``torch`` whose ``npu``
is the device module (the emulated npu's, CUDA's), ``torch_npu.npu`` with torch_npu's defaults for what the patches
read of its settings, the memory-format functions of a host with one format, the emulator's ``torch_npu._C``, and the
device string ``'npu'`` renamed to the accelerator's type (:mod:`shadow.npu.torch_npu_source` binds them)."""

from __future__ import annotations

import ast
import types
from typing import Any

import torch

from shadow.npu.emulated import formats, torch_npu_c
from shadow.npu.release_files import LegacySourceError


class DeviceRename(ast.NodeTransformer):
    """``'npu'`` -> the accelerator's type, for hosts whose accelerator is not an npu."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if node.value == "npu":
            return ast.copy_location(ast.Constant(self.device_type), node)
        return node


class TorchView(types.ModuleType):
    """``torch`` as torch_npu's code sees it where ``torch.npu`` is not torch_npu's (the emulated npu, CUDA)."""

    def __init__(self, device_module: Any) -> None:
        super().__init__("torch")
        self.npu = device_module

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class NpuModule(types.ModuleType):
    """``torch_npu.npu`` (which torch_npu also makes ``torch.npu``) where the accelerator is not a real NPU:
    torch_npu's runtime functions from its source (set on it by the loader), then torch_npu's defaults for what
    the patches read of its settings, anything else the device module's."""

    def __init__(self, device_module: Any) -> None:
        super().__init__("torch_npu.npu")
        self._device_module = device_module

    @staticmethod
    def get_mm_bmm_format_nd() -> bool:
        return True  # (torch_npu's default: matmul weights keep the ND format)

    @staticmethod
    def is_jit_compile_false() -> bool:
        return True  # (torch_npu's default on the 910B and later)

    def get_device_name(self, device: Any = None) -> str:
        getter = getattr(self._device_module, "get_device_name", None)
        return getter(device) if getter is not None else "unknown"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device_module, name)


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """``torch_npu.npu_format_cast`` on a host whose accelerator is not an npu (CUDA): one memory format, nothing to
    cast (torch_npu returns the tensor itself where its format is the one asked for)."""
    return tensor


def get_npu_format(tensor: torch.Tensor) -> int:
    """``torch_npu.get_npu_format`` on a host whose accelerator is not an npu: every tensor is ND."""
    return int(formats.Format.ND)


def emulated_torch_npu_c() -> Any:
    """The emulator's ``torch_npu._C`` where the accelerator is the emulated npu, else None."""
    from shadow.npu import emulated

    return torch_npu_c if emulated.installed_devices() else None


def device_module() -> tuple[str, Any]:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise LegacySourceError(
            "torch_npu's legacy needs an accelerator (an NPU, CUDA, or the emulated npu: --emulate-npu); "
            "this host has none"
        )
    return accelerator.type, torch.get_device_module(accelerator.type)
