"""The single-device oracle for the DataParallel targets: what no legacy-vs-upstream comparison can see.

Legacy and upstream can share a defect: both torch_npu's ``parallel_apply`` and torch's read CUDA's autocast flag,
so on an npu both run the replicas without autocast. A third run shows it: replica 0's module, on its own
device, in the calling thread, under the caller's autocast, on replica 0's inputs. What DataParallel returned for
replica 0 should be what that single-device call returns; where legacy and upstream agree with each other but
not with it, both depart from single-device semantics (a *shared divergence*: an upstream issue to file, not a
reason to keep the patch).

Each DataParallel target describes its call's replica 0 with a function ``(args, kwargs) -> SingleDeviceCall``;
the engine runs it isolated like the upstream run and compares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _get_all_device_indices, _get_device_index

from shadow.core.support import trees


@dataclasses.dataclass(frozen=True)
class SingleDeviceCall:
    """Replica 0 of a DataParallel call: its module, inputs and device, and how to find its output in legacy's
    result (``legacy_part(legacy_result, single_device_result)``)."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    device: int | None
    legacy_part: Callable[[Any, Any], Any]

    def run(self) -> Any:
        """Call the module on its device in this thread (the caller's grad and autocast state apply)."""
        if self.device is None or torch.accelerator.current_accelerator() is None:
            return self.module(*self.args, **self.kwargs)
        with torch.accelerator.device_index(self.device):
            return self.module(*self.args, **self.kwargs)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _as_args(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def parallel_apply_call(args: tuple, kwargs: dict) -> SingleDeviceCall | None:
    """``DataParallel.parallel_apply(self, replicas, inputs, kwargs)``: replica 0 is ``replicas[0]``."""
    data_parallel, replicas, inputs = args[0], _arg(args, kwargs, 1, "replicas"), _arg(args, kwargs, 2, "inputs")
    kwargs_tup = _arg(args, kwargs, 3, "kwargs")
    if not replicas or not inputs or len(replicas) != len(inputs):
        return None
    device_ids = getattr(data_parallel, "device_ids", None) or [None]
    return SingleDeviceCall(
        module=replicas[0],
        args=_as_args(inputs[0]),
        kwargs=dict(kwargs_tup[0]) if kwargs_tup else {},
        device=device_ids[0],
        legacy_part=lambda legacy, single: legacy[0],
    )


def data_parallel_call(args: tuple, kwargs: dict) -> SingleDeviceCall | None:
    """``data_parallel(module, inputs, device_ids, output_device, dim, module_kwargs)``: replica 0 is the module
    itself on ``device_ids[0]``, on the first chunk of the scattered inputs; its output is the first chunk of
    the gathered result (along ``dim``), moved from the output device."""
    from torch.nn.parallel.scatter_gather import scatter_kwargs

    module, inputs = args[0] if args else kwargs["module"], _arg(args, kwargs, 1, "inputs")
    device_ids = _arg(args, kwargs, 2, "device_ids")
    dim, module_kwargs = _arg(args, kwargs, 4, "dim", 0), _arg(args, kwargs, 5, "module_kwargs")
    if device_ids is None:
        device_ids = _get_all_device_indices() or []
    if len(device_ids) < 2:
        return None  # data_parallel then calls the module directly: nothing differs from a single device
    device_ids = [_get_device_index(d, True) for d in device_ids]
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    scattered, scattered_kwargs = scatter_kwargs(inputs, module_kwargs, device_ids, dim)
    if not scattered:
        return None
    return SingleDeviceCall(
        module=module,
        args=tuple(scattered[0]),
        kwargs=dict(scattered_kwargs[0]) if scattered_kwargs else {},
        device=device_ids[0],
        legacy_part=lambda legacy, single: _first_chunk(legacy, single, dim),
    )


def _first_chunk(gathered: Any, single: Any, dim: int) -> Any:
    """The part of a gathered output that replica 0 contributed, on the single-device run's device."""
    leaves, spec = trees.flatten(gathered)
    single_leaves, single_spec = trees.flatten(single)
    if spec != single_spec:
        return gathered  # the comparison reports the structure

    def piece(leaf: Any, reference: Any) -> Any:
        if not (isinstance(leaf, torch.Tensor) and isinstance(reference, torch.Tensor)) or leaf.dim() == 0:
            return leaf
        if reference.dim() == 0:  # gather turns replicas' scalars into a vector
            chunk = leaf[0]
        elif reference.dim() == leaf.dim() and -leaf.dim() <= dim < leaf.dim():
            chunk = leaf.narrow(dim, 0, min(reference.size(dim), leaf.size(dim)))  # (narrow takes dim < 0 too)
        else:
            return leaf
        return chunk.to(reference.device)

    return spec.unflatten([piece(a, b) for a, b in zip(leaves, single_leaves)])
