"""``torch.npu`` for the emulated npu: the device-module API that torch and torch_npu-style code call.

Registered as ``torch.npu`` by :func:`shadow.npu.emulated.install`. Device and stream state live in
the C++ backend (thread-local current device and stream, as on a real accelerator); this module is the
thin Python face over ``torch.accelerator`` and the backend's per-device generators.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from shadow.npu.tensor_types import NPU_TENSOR_TYPES

_backend: Any = None  # the compiled extension, set by install()


def _index(device: Any = None) -> int:
    """A device index from None (current), an int, 'npu', 'npu:1' or a torch.device."""
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "npu":
        raise ValueError(f"expected an npu device, got {device}")
    return device.index if device.index is not None else torch.accelerator.current_device_index()


def is_available() -> bool:
    return _backend is not None and _backend.device_count() > 0


#: The SoC the emulated npu reports unless ``$NPU_SHADOW_EMULATED_SOC`` names another: torch_npu's patches read it
#: (the optimizer's foreach devices, Conv3d's weight format).
DEFAULT_SOC = "Ascend910B1"


def get_device_name(device: Any = None) -> str:
    """The SoC's name, as ``torch_npu.npu.get_device_name()`` gives it."""
    _index(device)  # (a bad device raises as it would)
    return os.environ.get("NPU_SHADOW_EMULATED_SOC") or DEFAULT_SOC


def is_initialized() -> bool:
    return _backend is not None


def device_count() -> int:
    return _backend.device_count() if _backend is not None else 0


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: Any) -> None:
    torch.accelerator.set_device_index(_index(device))


class device:
    """Context manager that makes ``device`` current on this thread, then puts the previous one back."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = torch.accelerator.current_device_index()
        torch.accelerator.set_device_index(self.index)

    def __exit__(self, *exc: object) -> None:
        torch.accelerator.set_device_index(self.previous)


class Stream(torch.Stream):
    """A stream of the emulated npu (work is synchronous: it never waits)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        return super().__new__(cls, device=torch.device("npu", _index(device)), priority=priority, **kwargs)


def current_stream(device: Any = None) -> torch.Stream:
    return torch.accelerator.current_stream(_index(device))


@contextlib.contextmanager
def stream(stream: torch.Stream | None) -> Iterator[None]:
    """Make ``stream`` current on its device for the block (None: no change)."""
    if stream is None:
        yield
        return
    with stream:
        yield


def synchronize(device: Any = None) -> None:
    torch.accelerator.synchronize(_index(device))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes, as torch_npu's ``torch.npu.mem_get_info``: a device's where the emulated npu has a
    capacity (:func:`shadow.npu.emulated.set_memory_capacity`), else the host's (its memory is the host's)."""
    index = _index(device)  # (a bad device raises as it would)
    capacity = _backend.memory_capacity() if _backend is not None else 0
    if capacity:
        return max(0, capacity - memory_allocated(index)), capacity
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024 if rest.split() and rest.split()[0].isdigit() else 0
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def memory_allocated(device: Any = None) -> int:
    """Bytes of the device's tensors now (as ``torch.npu.memory_allocated``)."""
    return int(_backend.memory_stats(_index(device))[0])


def max_memory_allocated(device: Any = None) -> int:
    """The most bytes the device's tensors took since the last :func:`reset_peak_memory_stats`."""
    return int(_backend.memory_stats(_index(device))[1])


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start the device's peak again from what it holds now."""
    _backend.reset_peak_memory_stats(_index(device))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    return _backend.get_rng_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    _backend.set_rng_state(new_state, _index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


def manual_seed(seed: int) -> None:
    _backend.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF, current_device())


def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        _backend.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF, index)


def initial_seed() -> int:
    return _backend.initial_seed(current_device())


#: The npu tensor type classes ('torch.npu.FloatTensor', ...) and their dtypes, created by install() as torch
#: and torch_npu make theirs (isinstance, constructor, among ``torch._tensor_classes``).
TENSOR_TYPES = NPU_TENSOR_TYPES


def _bind(backend: Any) -> None:
    """Attach the compiled backend and put its tensor type classes on this module and among torch's."""
    global _backend
    _backend = backend
    for name, cls in backend.tensor_type_classes("torch.npu", list(TENSOR_TYPES.items())).items():
        globals()[name] = cls
        torch._tensor_classes.add(cls)


def _is_in_bad_fork() -> bool:
    """torch.manual_seed asks before seeding a device module's generators; host memory survives fork."""
    return False
