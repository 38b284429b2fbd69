"""The single-process collectives that ``torch.nn.parallel.comm`` calls, for builds without them.

torch's CPU wheels lack ``torch._C._broadcast_coalesced``, ``_broadcast``, ``_scatter`` and ``_gather``
(and their ``_out`` forms): they are built for CUDA only. DataParallel's replicate, scatter and gather
need them on any accelerator. These follow the C++ versions' observable behaviour on the current
accelerator's device type: a tensor already on a target device is returned as is (broadcast) or as a
view (scatter), others are copied. :func:`provide_missing` installs only those that are absent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _device(index: int) -> torch.device:
    if index == -1:
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, index)


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int) -> list:
    with torch.no_grad():
        return [[_to(t, _device(d)) for t in tensors] for d in devices]


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_to(tensor, _device(d)) for d in devices]


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        for target in out:
            target.copy_(tensor, non_blocking=True)
    return list(out)


def scatter(
    tensor: torch.Tensor,
    devices: Sequence[int],
    chunk_sizes: Sequence[int] | None,
    dim: int,
    streams: object = None,
) -> list[torch.Tensor]:
    with torch.no_grad():
        chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
        return [chunk.to(_device(d), non_blocking=True) for chunk, d in zip(chunks, devices)]


def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int, streams: object = None) -> list:
    with torch.no_grad():
        chunks = tensor.split([o.size(dim) for o in out], dim)
        for chunk, target in zip(chunks, out):
            target.copy_(chunk, non_blocking=True)
    return list(out)


def gather(tensors: Sequence[torch.Tensor], dim: int, destination: int | None) -> torch.Tensor:
    index = torch.accelerator.current_device_index() if destination is None else destination
    with torch.no_grad():
        target = _device(index)
        return torch.cat([t.to(target) for t in tensors], dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
    with torch.no_grad():
        torch.cat([t.to(out.device) for t in tensors], dim, out=out)
    return out


_FUNCTIONS = {
    "_broadcast_coalesced": broadcast_coalesced,
    "_broadcast": broadcast,
    "_broadcast_out": broadcast_out,
    "_scatter": scatter,
    "_scatter_out": scatter_out,
    "_gather": gather,
    "_gather_out": gather_out,
}


def provide_missing() -> list[str]:
    """Install on ``torch._C`` each of these that the build lacks; the names installed."""
    added = [name for name in _FUNCTIONS if not hasattr(torch._C, name)]
    for name in added:
        setattr(torch._C, name, _FUNCTIONS[name])
    return added
