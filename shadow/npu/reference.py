"""Our own implementation of the legacy (torch_npu) semantics, device generic.

torch_npu cannot be imported without Ascend's CANN libraries. These functions follow torch_npu 2.12.0's
patches (``torch_npu/utils/_module.py`` and ``tensor_methods.py``; 2.8.0 to 2.11.0 differ only in spelling) on
whatever device is here: the accelerator's own API (``torch.accelerator``) where torch_npu calls ``torch.npu``.
``tests/test_torch_npu_source.py`` checks them bitwise against every release's own code
(:mod:`shadow.npu.torch_npu_source`) on the emulated npu. :func:`patch_torch` installs them the way torch_npu does,
so a host without torch_npu can rehearse shadowing, and tests can build a fake ``torch_npu`` on them.

- ``Tensor.type``: an NPU type name ('torch.npu.FloatTensor', 'torch_npu.npu.FloatTensor', ...) or NPU tensor
  class becomes ``self.to(dtype=..., device=<accelerator type>, non_blocking=...)``, i.e. onto the CURRENT
  device even for a tensor on another one; everything else, None included, goes to the original method (kept
  as ``Tensor.type_raw``).
- ``parallel_apply``: upstream's algorithm, but each worker thread calls ``set_device`` (a CANN-era workaround;
  with one replica that is the calling thread, whose current device then stays changed) and enters the
  device's float16 autocast with ``torch.is_autocast_enabled()`` read WITHOUT a device type, as torch_npu does.
  That flag is CUDA's: on an NPU the replicas run without autocast, exactly as upstream's do (a defect both
  share). Errors carry torch_npu's error-code suffix (:func:`pta_error`).
- ``data_parallel``: upstream's checks and algorithm over this ``parallel_apply``.

Where torch_npu's code cannot run (a CPU-only host, no accelerator) these fall back to running on the
tensors' own device, so that a rehearsal still exercises the wrappers.
"""

from __future__ import annotations

import builtins
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from torch._utils import ExceptionWrapper, _get_all_device_indices, _get_available_device_type, _get_device_index
from torch.nn.parallel.parallel_apply import get_a_var

from shadow.npu.patching import LEGACY_PATCHED, Patches, replace
from shadow.npu.tensor_types import NPU_TENSOR_TYPES

#: 'torch.npu.FloatTensor', 'torch_npu.npu.FloatTensor', ... -> dtype
NPU_TYPE_NAMES: dict[str, torch.dtype] = {
    f"{prefix}.{name}": dtype for prefix in ("torch.npu", "torch_npu.npu") for name, dtype in NPU_TENSOR_TYPES.items()
}


def npu_type_dtype(arg: Any) -> torch.dtype | None:
    """The dtype an NPU tensor type name or class stands for; None for anything else."""
    if isinstance(arg, str):
        return NPU_TYPE_NAMES.get(arg)
    if isinstance(arg, type):
        return NPU_TYPE_NAMES.get(f"{getattr(arg, '__module__', '')}.{arg.__name__}")
    return None


def current_device() -> torch.device | None:
    """The current device of this host's accelerator ('npu' means this on an NPU host), or None."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


# --------------------------------------------------------------------------- torch_npu's error codes

#: torch_npu's ``ErrCode`` members used by the patches: (code, message).
ERR_PARAM = (1, "invalid parameter")
ERR_VALUE = (3, "invalid value")


def _is_interactive() -> bool:
    return (
        hasattr(sys, "ps1")
        or hasattr(builtins, "__IPYTHON__")
        or bool(sys.flags.interactive)
        or "ipykernel" in sys.modules
    )


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank()
    except Exception:
        return -1


def pta_error(error: tuple[int, str]) -> str:
    """torch_npu's error-code suffix for its Python layer (``torch_npu.utils._error_code.pta_error``)."""
    if int(os.getenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "0")) or _is_interactive():
        return ""
    device = torch.accelerator.current_device_index() if torch.accelerator.current_accelerator() else -1
    code, message = error
    return (
        f"\n[ERROR] {time.strftime('%Y-%m-%d-%H:%M:%S', time.localtime())} (PID:{os.getpid()}, Device:{device}, "
        f"RankID:{_rank()}) ERR00{code:03d} PTA {message}"
    )


# --------------------------------------------------------------------------- Tensor.type

_type_raw: Callable = torch._C.TensorBase.type


def npu_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """Legacy ``Tensor.type``: NPU type names and classes cast onto the current accelerator device."""
    target = npu_type_dtype(dtype)
    if target is None:
        return _type_raw(self, dtype, non_blocking, **kwargs)
    accelerator = torch.accelerator.current_accelerator()
    device = accelerator.type if accelerator is not None else self.device  # (no accelerator: a CPU rehearsal)
    return self.to(dtype=target, device=device, non_blocking=non_blocking)


# --------------------------------------------------------------------------- parallel_apply


def parallel_apply(
    modules: Sequence[torch.nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[int | torch.device | None] | None = None,
) -> list[Any]:
    """Legacy ``parallel_apply`` (torch_npu's ``_parallel_apply``): upstream's algorithm; each worker sets its
    device and enters the device's float16 autocast enabled by CUDA's autocast flag."""
    _check_length(modules, inputs, "inputs")
    if kwargs_tup is not None:
        _check_length(modules, kwargs_tup, "kwargs_tup")
    else:
        kwargs_tup = ({},) * len(modules)
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None and not devices:  # a CPU rehearsal: DataParallel has no device ids there
        devices = None
    if devices is not None:
        _check_length(modules, devices, "devices")
    else:
        devices = [None] * len(modules)
    if accelerator is not None:
        devices = [_get_device_index(x, True) for x in devices]
        streams = [torch.accelerator.current_stream(x) for x in devices]
    else:  # a CPU rehearsal: no device to set, no stream
        streams = [None] * len(modules)
    device_type = accelerator.type if accelerator is not None else "cpu"
    lock = threading.Lock()
    results: dict[int, Any] = {}
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled = torch.is_autocast_enabled()  # no device type: CUDA's flag, as torch_npu reads it

    def worker(i: int, module: torch.nn.Module, input: Any, kwargs: dict, device: Any, stream: Any) -> None:
        torch.set_grad_enabled(grad_enabled)
        contexts: list[Any] = []
        if accelerator is not None:
            if device is None:
                t = get_a_var(input)
                if t is None:
                    with lock:
                        results[i] = ExceptionWrapper(
                            where=f"in replica {i}, no device was provided and no tensor input was found; "
                            "device cannot be resolved"
                        )
                    return
                device = t.get_device()
            torch.accelerator.set_device_index(device)  # torch_npu's torch.npu.set_device, outside the try
            if stream is None:
                stream = torch.accelerator.current_stream(device)
            contexts = [torch.accelerator.device_index(device), stream]
        try:
            with _entered(contexts), torch.autocast(device_type, dtype=torch.float16, enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                output = module(*input, **kwargs)
            with lock:
                results[i] = output
        except Exception:
            with lock:
                results[i] = ExceptionWrapper(where=f"in replica {i} on device {device}")

    if len(modules) > 1:
        threads = [
            threading.Thread(target=worker, args=(i, *item))
            for i, item in enumerate(zip(modules, inputs, kwargs_tup, devices, streams))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        worker(0, modules[0], inputs[0], kwargs_tup[0], devices[0], streams[0])

    outputs = []
    for i in range(len(inputs)):
        output = results.get(i)
        if isinstance(output, ExceptionWrapper):
            output.reraise()
        outputs.append(output)
    return outputs


def _check_length(modules: Sequence, other: Sequence, name: str) -> None:
    """torch_npu's check that ``other`` has one entry per module, with its message and error code."""
    if len(modules) != len(other):
        raise AssertionError(
            f"The number of modules {len(modules)} is not equal to the number of {name} {len(other)}"
            + pta_error(ERR_PARAM)
        )


class _entered:
    """Enter context managers in order, exit them in reverse (an empty list: nothing)."""

    def __init__(self, contexts: list[Any]) -> None:
        self._contexts = contexts

    def __enter__(self) -> None:
        for context in self._contexts:
            context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)


def npu_parallel_apply(self: torch.nn.DataParallel, replicas: Sequence, inputs: Sequence, kwargs: Any) -> list:
    """Legacy ``DataParallel.parallel_apply``."""
    return parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])


def npu_data_parallel(
    module: torch.nn.Module,
    inputs: Any,
    device_ids: Sequence[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    module_kwargs: Any | None = None,
) -> Any:
    """Legacy ``torch.nn.parallel.data_parallel``: upstream's checks and algorithm over legacy parallel_apply.

    Without an accelerator (a CPU rehearsal) it runs the module where it is.
    """
    from torch.nn.parallel import gather, replicate
    from torch.nn.parallel.scatter_gather import scatter_kwargs

    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if torch.accelerator.current_accelerator() is None:
        return module(*inputs, **(module_kwargs or {}))
    device_type = _get_available_device_type()
    if device_type is None:
        raise RuntimeError("device type could not be determined" + pta_error(ERR_PARAM))
    if device_ids is None:
        device_ids = _get_all_device_indices()
    if device_ids is None:
        raise RuntimeError("no available devices were found" + pta_error(ERR_PARAM))
    if output_device is None:
        output_device = device_ids[0]
    device_ids = [_get_device_index(x, True) for x in device_ids]
    output_device = _get_device_index(output_device, True)
    src_device_obj = torch.device(device_type, device_ids[0])
    for t in chain(module.parameters(), module.buffers()):
        if t.device != src_device_obj:
            raise RuntimeError(
                "module must have its parameters and buffers "
                f"on device {src_device_obj} (device_ids[0]) but found one of "
                f"them on device: {t.device}" + pta_error(ERR_VALUE)
            )
    inputs, module_kwargs = scatter_kwargs(inputs, module_kwargs, device_ids, dim)
    if not inputs and not module_kwargs:
        inputs, module_kwargs = ((),), ({},)
    if module_kwargs is None:
        raise AssertionError("The module_kwargs is None" + pta_error(ERR_VALUE))
    if len(device_ids) == 1:
        return module(*inputs[0], **module_kwargs[0])
    used = device_ids[: len(inputs)]
    replicas = replicate(module, used)
    outputs = parallel_apply(replicas, inputs, module_kwargs, used)
    return gather(outputs, output_device, dim)


def patch_torch(
    tensor_type: Callable = npu_type,
    dp_parallel_apply: Callable = npu_parallel_apply,
    data_parallel: Callable = npu_data_parallel,
) -> Patches:
    """Install the legacy implementations the way torch_npu does (the arguments let a fake torch_npu
    install its own copies of them). Returns the handle that undoes it."""
    parallel = importlib.import_module("torch.nn.parallel")
    replacements = [
        (torch.Tensor, "type_raw", torch._C.TensorBase.type),
        (torch.Tensor, "type", tensor_type),
        (torch.nn.DataParallel, "parallel_apply", dp_parallel_apply),
        (parallel, "data_parallel", data_parallel),
    ]
    patches = replace(replacements)
    LEGACY_PATCHED.announce()  # a monitor installed by `npu-shadow run` moves over the new legacy
    return patches
