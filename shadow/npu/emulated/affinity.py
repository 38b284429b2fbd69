"""CPU affinity as torch_npu sets it (``NPUAffinityController.cpp``), for the emulator's ``torch_npu._C``.

torch_npu binds threads to CPU cores only when ``CPU_AFFINITY_CONF`` asks for it (mode 1: each device's share of
the cores; mode 2: one core each for its hot threads and the rest of the share for the others). Its DataLoader
patch calls ``_npu_set_thread_affinity(-1, -1)`` (the "other threads" range of the current device) before the
workers start, and ``_npu_reset_thread_affinity()`` (the main thread's range) after: the workers inherit the
first, the caller keeps the second. With the variable unset (mode 0) both do nothing. The ranges: the cores split
evenly among the devices (device ``i`` has ``[i * n, (i + 1) * n - 1]``, ``n = cores // devices``), or
``npu<i>:<start>-<end>`` options; in mode 2 a device's range gives its main, acl, release and watchdog threads one
core each, in that order, and the other threads the rest (all of it where it has fewer than five cores).
"""

from __future__ import annotations

import os
from collections.abc import Callable

#: torch_npu's thread types, in the order mode 2 gives them cores.
THREAD_TYPES = ("main", "acl", "release", "watchdog", "other")


def parse(conf: str | None, devices: int, cores: int) -> tuple[int, list[tuple[int, int]]]:
    """(mode, each device's core range) from a ``CPU_AFFINITY_CONF`` value, as torch_npu parses it."""
    block = cores // devices if cores > 0 and devices > 0 else 0
    ranges = [(i * block, (i + 1) * block - 1) for i in range(devices)]
    if not conf:
        return 0, ranges
    if conf.isdigit():
        return int(conf), ranges
    mode = 0
    for option in conf.split(","):
        key, colon, value = option.partition(":")
        if not colon:
            if option.isdigit():
                mode = int(option)
            continue
        if key == "mode":
            mode = int(value) if value.isdigit() else mode
        elif key.startswith("npu") and key[3:].isdigit() and int(key[3:]) < devices:
            start, dash, end = value.partition("-")
            if dash and start.isdigit() and end.isdigit():
                ranges[int(key[3:])] = (int(start), int(end))
            elif not dash and value.isdigit():
                ranges[int(key[3:])] = (int(value), int(value))
    return mode, ranges


def core_range(mode: int, device_range: tuple[int, int], thread_type: str) -> tuple[int, int]:
    """The cores a thread of ``thread_type`` is bound to on a device with ``device_range``."""
    start, end = device_range
    if mode != 2 or end - start + 1 < len(THREAD_TYPES):
        return device_range
    offset = THREAD_TYPES.index(thread_type)
    return (start + offset, end) if thread_type == "other" else (start + offset, start + offset)


class Controller:
    """One process's affinity controller: torch_npu decides once, at the first call, whether it binds at all
    (a mode other than 0, and the calling thread not bound already)."""

    def __init__(self, current_device: Callable[[], int], device_count: Callable[[], int]) -> None:
        self._current_device = current_device
        self._device_count = device_count
        self._decided: tuple[int, list[tuple[int, int]]] | None = None

    def _settings(self) -> tuple[int, list[tuple[int, int]]] | None:
        if self._decided is None:
            mode, ranges = parse(os.environ.get("CPU_AFFINITY_CONF"), self._device_count(), os.cpu_count() or 0)
            mine = os.sched_getaffinity(0)
            bound_already = any(core not in mine for start, end in ranges for core in range(start, end))
            self._decided = (0 if bound_already else mode, ranges)
        mode, ranges = self._decided
        return (mode, ranges) if mode else None

    def bind(self, thread_type: str) -> None:
        """Bind the calling thread to its type's cores on the current device (nothing in mode 0)."""
        settings = self._settings()
        if settings is None:
            return
        mode, ranges = settings
        start, end = core_range(mode, ranges[self._current_device()], thread_type)
        cores = set(range(start, min(end, (os.cpu_count() or 1) - 1) + 1))
        if cores:
            os.sched_setaffinity(0, cores)  # (pid 0: the calling thread, as pthread_setaffinity_np(pthread_self()))
