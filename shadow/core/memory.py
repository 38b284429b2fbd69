"""How much memory the shadow side may take: its copies only when they fit in what the device has free.

A sampled call's copies (module buffers before legacy, arguments after it) must never take legacy's headroom or
push the job into the out-of-memory killer: before making them, the engine asks :func:`check_fits`, which raises
:class:`InsufficientMemory` (the call is then skipped with reason ``oom``) when they would not fit in a safe share
of what the device reports free: ``mem_get_info`` of the device's module where it has one (CUDA, torch_npu, the
emulated npu), and on the host the least of the memory available, the process's address-space limit
(``RLIMIT_AS``) and its cgroup's limit.
"""

from __future__ import annotations

import collections
import resource
from collections.abc import Iterable

import torch

#: The share of the free memory the copies may take: the rest stays for legacy, upstream and the job.
SHARE = 0.5
#: Copies smaller than this are made without asking (reading the figures costs more than they could matter).
SMALL = 4 << 20


class InsufficientMemory(MemoryError):
    """The shadow side's copies would not fit: the call is skipped (reason ``oom``), never the job's problem."""


def _read_number(path: str, field: str | None = None) -> int | None:
    """A number from a /proc or /sys file: the whole file, or the line ``field: N kB``."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    if field is None:
        text = text.strip()
        return int(text) if text.isdigit() else None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) > 1 and parts[1].isdigit() else None
    return None


def host_free_bytes() -> int | None:
    """What this process can still allocate on the host: the least of MemAvailable, the room left under
    RLIMIT_AS and the room left in its cgroup (v2); None where none of them can be read."""
    figures = [_read_number("/proc/meminfo", "MemAvailable")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = _read_number("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and used is not None:
        figures.append(max(0, soft - used))
    limit, current = _read_number("/sys/fs/cgroup/memory.max"), _read_number("/sys/fs/cgroup/memory.current")
    if limit is not None and current is not None:
        figures.append(max(0, limit - current))
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def free_bytes(device: torch.device) -> int | None:
    """The memory free on ``device`` for this process, or None where the device does not say."""
    if device.type == "cpu":
        return host_free_bytes()
    module = getattr(torch, device.type, None)
    mem_get_info = getattr(module, "mem_get_info", None)
    if mem_get_info is None:
        return None
    try:
        free, _ = mem_get_info(device if device.index is not None else None)
    except Exception:
        return None
    return int(free)


def check_fits(tensors: Iterable[torch.Tensor], copies: int, what: str) -> None:
    """Raise InsufficientMemory unless ``copies`` clones of ``tensors`` fit in SHARE of each device's free
    memory."""
    needed: collections.Counter[torch.device] = collections.Counter()
    for tensor in tensors:
        needed[tensor.device] += tensor.numel() * tensor.element_size() * copies
    for device, size in needed.items():
        if size < SMALL or device.type == "meta":
            continue
        free = free_bytes(device)
        if free is not None and size > SHARE * free:
            raise InsufficientMemory(
                f"out of memory for the shadow side: {what} need {size >> 20} MiB on {device}, "
                f"{free >> 20} MiB free (at most {SHARE:.0%} of it is taken)"
            )
