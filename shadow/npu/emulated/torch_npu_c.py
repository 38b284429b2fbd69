"""The emulator's ``torch_npu._C``: the few C functions and base classes torch_npu's own Python runtime
(``torch_npu/npu/utils.py``, ``torch_npu/npu/streams.py``) calls, over the emulated npu's backend.

:mod:`shadow.npu.torch_npu_source` runs torch_npu's ``set_device``, ``device``, ``current_stream``, ``stream``,
``Stream`` and their helpers from a wheel over this module, so that legacy's device and stream handling is
torch_npu's code, not a re-implementation. What torch_npu does in C++, this module does as torch_npu's sources
have it (``NPUFunctions.cpp``, ``npu/Module.cpp``, ``npu/Stream.cpp``):

- the current device is thread-local and ``-1`` until set (``_npu_getLocalDevice``); reading the current device
  of a thread that has none makes it device 0 (``_npu_getDevice``); the state is the backend's, the one
  ``torch.accelerator`` and device guards read and write;
- ``_npu_setStream`` makes the stream's device current first, then the stream;
- ``_tensor_construct_from_storage`` (torch_npu's serialization and storage copies size a storage by it);
- CPU affinity (``_npu_set_thread_affinity``, ``_npu_reset_thread_affinity``) as ``NPUAffinityController.cpp``
  sets it (:mod:`shadow.npu.emulated.affinity`); the device's name, an Ascend SoC's;
- ``_NPUStreamBase`` is a ``torch.Stream`` taking torch_npu's keywords (a new stream on the current device, or
  the one named by ``stream_id``/``device_index``/``device_type``); ``npu_stream`` is its id (no runtime handle).

Names are torch_npu's (camelCase included), so that its code finds them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shadow.npu.emulated import affinity
from shadow.npu.emulated import device as _device


def _backend() -> Any:
    if _device._backend is None:
        raise RuntimeError("the emulated npu is not installed (shadow.npu.emulated.install())")
    return _device._backend


def _npu_init() -> None:
    """Nothing to initialise: the emulated devices exist from install() on."""
    _backend()


def _npu_setDevice(device: int) -> None:
    _backend().set_device(int(device))


def _npu_getDevice() -> int:
    return _backend().current_device()


def _npu_getDeviceWithoutSet() -> int:
    return _backend().local_device()


def _npu_getLocalDevice() -> int:
    return _backend().local_device()


def _npu_maybeExchangeDevice(device: int) -> int:
    if device < 0:
        return -1
    return _backend().maybe_exchange_device(int(device))


def _npu_synchronize() -> None:
    torch.accelerator.synchronize(_npu_getDevice())


def _npu_getCurrentStream(device_index: int) -> tuple[int, int, int]:
    stream = torch.accelerator.current_stream(int(device_index))
    return stream.stream_id, stream.device_index, stream.device_type


def _npu_getDefaultStream(device_index: int) -> tuple[int, int, int]:
    stream = torch.accelerator.current_stream(int(device_index))
    return 0, stream.device_index, stream.device_type  # (the default stream's id is 0)


def _npu_setStream(stream_id: int = 0, device_index: int = 0, device_type: int = 0) -> None:
    if _npu_getDevice() != device_index:
        _npu_setDevice(device_index)
    torch.accelerator.set_stream(torch.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type))


class _NPUStreamBase(torch.Stream):
    """torch_npu's C stream base (``torch_npu._C._NPUStreamBase``, a ``torch.Stream``)."""

    def __new__(
        cls,
        priority: int = 0,
        is_sync_launch: int = 0,
        stream_id: int = 0,
        device_index: int = 0,
        device_type: int = 0,
        stream_ptr: int = 0,
    ) -> _NPUStreamBase:
        if stream_id or device_index or device_type:
            return super().__new__(cls, stream_id=stream_id, device_index=device_index, device_type=device_type)
        return super().__new__(cls, device=torch.device("npu", _npu_getDevice()), priority=priority)

    @property
    def npu_stream(self) -> int:
        return self.stream_id


class _NPUEventBase(torch.Event):
    """torch_npu's C event base (``torch_npu._C._NPUEventBase``), over ``torch.Event`` on the current npu."""

    def __new__(
        cls,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        graph_external: bool = False,
    ) -> _NPUEventBase:
        return super().__new__(
            cls,
            device=torch.device("npu", _npu_getDevice()),
            enable_timing=enable_timing,
            blocking=blocking,
            interprocess=interprocess,
        )


def _npu_getDeviceName() -> str:
    return _device.get_device_name()


def _npu_getDeviceCount() -> int:
    return _backend().device_count()


def _npu_is_jit_compile_false() -> bool:
    """torch_npu's default on the 910B and later: operators run from binaries, not compiled on the fly."""
    return True


_AFFINITY = affinity.Controller(_npu_getDevice, _npu_getDeviceCount)


def _npu_set_thread_affinity(core_start: int, core_end: int) -> None:
    """torch_npu's binding: ``(-1, -1)`` binds the calling thread to the current device's "other threads" range;
    a user range is bound as given (both only where ``CPU_AFFINITY_CONF`` turns binding on)."""
    if core_start == -1:
        _AFFINITY.bind("other")
    elif _AFFINITY._settings() is not None:
        os.sched_setaffinity(0, set(range(core_start, core_end + 1)))


def _npu_reset_thread_affinity() -> None:
    """Bind the calling thread back to the main thread's range."""
    _AFFINITY.bind("main")


def _tensor_construct_from_storage(storage: Any) -> torch.Tensor:
    """A tensor over the whole storage, of a typed storage's dtype (else bytes): torch_npu's is made from the
    storage's NPU descriptor, whose size is the storage's own where, as on the emulated npu, no internal format pads
    it."""
    dtype = storage.dtype if isinstance(storage, torch.TypedStorage) else torch.uint8
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage.untyped())
