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


#: Where the cgroup file systems are mounted and where this process says which cgroups it is in (tests move them).
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def _cgroup_room() -> list[int]:
    """The worker left under each memory limit of this process's cgroups: v2 (``memory.max`` less
    ``memory.current``) and v1 (``memory.limit_in_bytes`` less ``memory.usage_in_bytes``), in the process's own
    cgroup and at the mount's root (a container sees its own cgroup there)."""
    try:
        with open(PROC_SELF_CGROUP) as handle:
            lines = handle.read().splitlines()
    except OSError:
        lines = []
    places: list[tuple[str, str, str]] = []  # (directory, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":
            places.append((f"{CGROUP_ROOT}/{path}".rstrip("/"), "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            v1 = f"{CGROUP_ROOT}/memory/{path}".rstrip("/")
            places.append((v1, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    places += [(CGROUP_ROOT, "memory.max", "memory.current"),
               (f"{CGROUP_ROOT}/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]  # fmt: skip
    worker = []
    for directory, limit_file, usage_file in dict.fromkeys(places):
        limit, used = _read_number(f"{directory}/{limit_file}"), _read_number(f"{directory}/{usage_file}")
        if limit is not None and used is not None:
            worker.append(max(0, limit - used))
    return worker


def host_free_bytes() -> int | None:
    """What this process can still allocate on the host: the least of MemAvailable, the worker left under
    RLIMIT_AS and the worker left under its cgroups' limits (v2 and v1); None where none of them can be read."""
    figures = [_read_number("/proc/meminfo", "MemAvailable")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = _read_number("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and used is not None:
        figures.append(max(0, soft - used))
    figures += _cgroup_room()
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def check_host_fits(size: int, what: str) -> None:
    """Raise InsufficientMemory unless ``size`` bytes of host copies fit in SHARE of the host's free memory."""
    if size < SMALL:
        return
    free = host_free_bytes()
    if free is not None and size > SHARE * free:
        raise InsufficientMemory(
            f"out of memory for the shadow side: {what} need {size >> 20} MiB on the host, "
            f"{free >> 20} MiB free (at most {SHARE:.0%} of it is taken)"
        )


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
        check_device_fits(device, size, what)


def check_device_fits(device: torch.device, size: int, what: str) -> None:
    """Raise InsufficientMemory unless ``size`` bytes fit in SHARE of ``device``'s free memory."""
    if size < SMALL or device.type == "meta":
        return
    free = free_bytes(device)
    if free is not None and size > SHARE * free:
        raise InsufficientMemory(
            f"out of memory for the shadow side: {what} need {size >> 20} MiB on {device}, "
            f"{free >> 20} MiB free (at most {SHARE:.0%} of it is taken)"
        )
