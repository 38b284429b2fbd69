"""Our own implementation of the legacy (torch_npu) semantics, device generic.

torch_npu cannot be imported without Ascend's CANN libraries. These functions do what its patches do,
written from their description, on whatever device is here: the accelerator's own API
(``torch.accelerator``) where one exists, the tensor's device otherwise. :func:`patch_torch` installs
them the way torch_npu does, so a host without torch_npu can rehearse shadowing, and tests can build
a fake ``torch_npu`` on them.

- ``Tensor.type``: an NPU type name ('torch.npu.FloatTensor', 'torch_npu.npu.FloatTensor', ...) or
  NPU tensor class becomes ``self.to(dtype=..., device=<current accelerator device>, non_blocking=...)``;
  everything else, None included, goes to the original method (kept as ``Tensor.type_raw``).
- ``parallel_apply``: upstream's algorithm, but each worker thread sets its device (``set_device``, a
  CANN-era workaround) and enters the device's autocast (float16) with ``torch.is_autocast_enabled()``
  read WITHOUT a device type, as torch_npu 2.8 to 2.12 do (``torch_npu/utils/_module.py``). That flag is
  CUDA's: on an NPU the replicas run without autocast, exactly as upstream's do (a defect both share).
- ``data_parallel``: upstream's, calling this ``parallel_apply``.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.nn.parallel.parallel_apply import get_a_var

_NPU_TYPES = {
    "BoolTensor": torch.bool,
    "ByteTensor": torch.uint8,
    "CharTensor": torch.int8,
    "ShortTensor": torch.int16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
    "HalfTensor": torch.float16,
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "BFloat16Tensor": torch.bfloat16,
}

#: 'torch.npu.FloatTensor', 'torch_npu.npu.FloatTensor', ... -> dtype
NPU_TYPE_NAMES: dict[str, torch.dtype] = {
    f"{prefix}.{name}": dtype for prefix in ("torch.npu", "torch_npu.npu") for name, dtype in _NPU_TYPES.items()
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


_type_raw: Callable = torch._C.TensorBase.type


def npu_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """Legacy ``Tensor.type``: NPU type names and classes cast onto the current accelerator device."""
    target = npu_type_dtype(dtype)
    if target is None:
        return _type_raw(self, dtype, non_blocking, **kwargs)
    device = current_device() or self.device
    return self.to(dtype=target, device=device, non_blocking=non_blocking)


def parallel_apply(
    modules: Sequence[torch.nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[int | torch.device | None] | None = None,
) -> list[Any]:
    """Legacy ``parallel_apply``: upstream's algorithm; workers set their device and enter the device's
    float16 autocast enabled by CUDA's autocast flag (torch_npu's reading, not the device's own)."""
    if len(modules) != len(inputs):
        raise AssertionError(f"The number of modules {len(modules)} is not equal to the number of inputs {len(inputs)}")
    kwargs_tup = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in modules]
    devices = list(devices) if devices else [None] * len(modules)
    if not len(modules) == len(kwargs_tup) == len(devices):
        raise AssertionError("modules, inputs, kwargs_tup and devices must have the same length")
    accelerator = current_device()
    if accelerator is not None:
        device_type = accelerator.type
    else:
        first = get_a_var(list(inputs))
        device_type = first.device.type if first is not None else "cpu"
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled = torch.is_autocast_enabled()  # no device type: CUDA's flag, as torch_npu reads it
    lock = threading.Lock()
    results: dict[int, Any] = {}

    def worker(i: int, module: torch.nn.Module, input: Any, kwargs: dict, device: Any) -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
            with (
                _device_context(accelerator, device, input),
                torch.autocast(device_type, dtype=torch.float16, enabled=autocast_enabled),
            ):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                output = module(*input, **kwargs)
            with lock:
                results[i] = output
        except Exception:
            with lock:
                results[i] = ExceptionWrapper(where=f"in replica {i} on device {device}")

    work = list(zip(modules, inputs, kwargs_tup, devices))
    if len(work) > 1:
        threads = [threading.Thread(target=worker, args=(i, *item)) for i, item in enumerate(work)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    elif work:
        worker(0, *work[0])

    outputs = []
    for i in range(len(work)):
        output = results[i]
        if isinstance(output, ExceptionWrapper):
            output.reraise()
        outputs.append(output)
    return outputs


class _device_context:
    """Set the worker thread's device and stream, as torch_npu's worker does (accelerators only)."""

    def __init__(self, accelerator: torch.device | None, device: Any, input: Any) -> None:
        self._contexts: list[Any] = []
        if accelerator is None:
            return
        if device is None:
            tensor = get_a_var(input)
            device = tensor.get_device() if tensor is not None else accelerator.index
        index = device.index if isinstance(device, torch.device) else device
        torch.accelerator.set_device_index(index)  # torch_npu's torch.npu.set_device in each worker
        self._contexts = [torch.accelerator.device_index(index), torch.accelerator.current_stream(index)]

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
    """Legacy ``torch.nn.parallel.data_parallel``: upstream's algorithm over legacy parallel_apply.

    Without an accelerator it runs the module where it is, as DataParallel itself does then.
    """
    from torch.nn.parallel import gather, replicate
    from torch.nn.parallel.scatter_gather import scatter_kwargs

    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    accelerator = current_device()
    if accelerator is None:
        return module(*inputs, **(module_kwargs or {}))
    if device_ids is None:
        device_ids = list(range(torch.accelerator.device_count()))
    if output_device is None:
        output_device = device_ids[0]
    inputs, module_kwargs = scatter_kwargs(inputs, module_kwargs, device_ids, dim)
    if not inputs and not module_kwargs:
        inputs, module_kwargs = ((),), ({},)
    if len(device_ids) == 1:
        return module(*inputs[0], **module_kwargs[0])
    used = device_ids[: len(inputs)]
    replicas = replicate(module, used)
    outputs = parallel_apply(replicas, inputs, module_kwargs, used)
    return gather(outputs, output_device, dim)


@dataclasses.dataclass
class Patches:
    """What :func:`patch_torch` replaced, so that :meth:`undo` can put it back."""

    saved: list[tuple[Any, str, Any]]

    def undo(self) -> None:
        for owner, name, original in reversed(self.saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved.clear()


_MISSING = object()


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
    saved = []
    for owner, name, value in replacements:
        saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)
    from shadow import launch

    launch.refresh()  # a monitor installed by `npu-shadow run` moves over the new legacy
    return Patches(saved)
