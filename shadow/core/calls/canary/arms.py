"""A canary A/B for what cannot run twice: the DataLoader's multi-process iterator (``dataloader_init``).

torch_npu's ``_MultiProcessingDataLoaderIter.__init__`` synchronises the device and binds the calling thread's CPU
affinity around upstream's ``__init__`` (the workers it starts inherit the binding). An iterator starts its workers
once: its ``__init__`` cannot be run a second time to compare, so each new iterator is built by one arm, legacy's
or upstream's, never both: the arms alternate in blocks of two, in an order drawn from the seed (each block has one
of each, so neither arm gets the job's first or last iterators more often). This runs in a canary only (the primary
is upstream: the job accepted that upstream runs for real), until a rollback, after which every iterator is
legacy's.

Each iterator is measured where it cannot change what the job sees: the CPU cores its workers may run on (read
from the kernel for each worker's pid once they started), the cores of the caller's thread before and after, the
time from ``__init__`` to the first batch, the batches per second after it, and a digest of the first batch with
the iterator's base seed (batches of the same seed must be equal in both arms). Legacy's binding of the caller's
thread outlives its iterator: an upstream arm starts from the cores the process had when the trial began (what it
would have in a job without the patch) and leaves the caller's thread as it found it. One :class:`ArmRun` per
iterator goes to the exporters (with its samples) when the iterator is exhausted or collected, or at exit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_iter

from shadow.core.calls.record.record import Publisher
from shadow.core.model import contract
from shadow.core.model.observation import ARM_TARGETS, LEGACY, UPSTREAM
from shadow.core.support import memory

log = logging.getLogger("shadow")


@dataclasses.dataclass(frozen=True)
class ArmRun:
    """One iterator built by one arm, as measured."""

    target: str
    arm: str  # legacy or upstream
    timestamp: float
    #: The cores each worker may run on, by worker (as the kernel says, once they started).
    worker_cores: tuple[tuple[int, ...], ...]
    #: The caller's thread's cores before and after ``__init__``, and the process's when the trial began.
    caller_cores_before: tuple[int, ...]
    caller_cores_after: tuple[int, ...]
    process_cores: tuple[int, ...]
    init_seconds: float
    #: From the start of ``__init__`` to the first batch returned (None: no batch was taken).
    first_batch_seconds: float | None = None
    batches: int = 0
    #: Batches per second after the first (None: fewer than two batches).
    batches_per_second: float | None = None
    #: The iterator's base seed and a digest of its first batch's tensors ("" without a batch).
    base_seed: int | None = None
    first_batch_digest: str = ""
    #: What ``__init__`` raised ("" where it returned): the caller got it.
    raised: str = ""

    @property
    def workers_bound(self) -> bool:
        """Whether the workers run on fewer cores than the process had."""
        return any(set(cores) < set(self.process_cores) for cores in self.worker_cores)


def _cores(pid: int = 0) -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except OSError:  # (a worker already gone)
        return ()


#: Plain values a batch's digest reads by their value (their repr is the language's own): any other object is read
#: by its type's name only, never by its repr (the job's code).
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _digest(batch: Any) -> str:
    """A digest of a batch: its tensors' dtype, shape and bytes (read in place where they are contiguous on the host,
    else copied to the host within a memory check: an empty digest where the copy would not fit), its plain values,
    and the type of anything else (whose repr is the job's code, never called)."""
    digest = hashlib.sha256()
    with torch._C.DisableTorchFunction():
        for leaf in tree_iter(batch):
            if isinstance(leaf, torch.Tensor):
                data = leaf.detach()
                digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
                if data.numel() == 0:
                    continue
                if data.device.type != "cpu" or not data.is_contiguous():
                    try:
                        memory.check_host_fits(data.numel() * data.element_size(), "a copy of the first batch")
                    except memory.InsufficientMemory:
                        return ""
                    data = data.cpu().contiguous()
                digest.update(memoryview(data.reshape(-1).view(torch.uint8).numpy()))  # (0-d too: a label)
            elif type(leaf) in _PLAIN:
                digest.update(repr(leaf).encode("utf-8", "backslashreplace"))
            else:
                kind = type(leaf)
                digest.update(f"<{kind.__module__}.{kind.__qualname__}>".encode("utf-8", "backslashreplace"))
    return digest.hexdigest()[:16]


class _Measure:
    """What is measured of one iterator while it lives (the caller's thread only: ``__next__`` is the job's)."""

    __slots__ = ("batches", "digest", "first_at", "last_at", "reported", "run", "started")

    def __init__(self, run: ArmRun, started: float) -> None:
        self.run = run
        self.started = started
        self.batches = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.digest = ""
        self.reported = False

    def finished(self) -> ArmRun:
        per_second = None
        if self.batches > 1 and self.last_at is not None and self.first_at is not None and self.last_at > self.first_at:
            per_second = (self.batches - 1) / (self.last_at - self.first_at)
        return dataclasses.replace(
            self.run,
            first_batch_seconds=None if self.first_at is None else self.first_at - self.started,
            batches=self.batches,
            batches_per_second=per_second,
            first_batch_digest=self.digest,
        )


class IteratorArms:
    """The A/B of ``_MultiProcessingDataLoaderIter.__init__``: installed over it (and over ``__next__``, which
    measures), legacy's and upstream's ``__init__`` each building the iterators of its arm."""

    def __init__(
        self,
        legacy: Callable,
        upstream: Callable,
        publisher: Publisher,
        seed: int | None,
        target: str = ARM_TARGETS[0],
    ) -> None:
        from torch.utils.data import dataloader

        self.target = target
        self.legacy, self.upstream = legacy, upstream
        self.publisher = publisher
        self._owner = dataloader._MultiProcessingDataLoaderIter
        self._random = random.Random(f"{seed}/{target}/arms" if seed is not None else None)
        self._block: list[str] = []
        self._lock = threading.Lock()
        self._measures: weakref.WeakKeyDictionary[Any, _Measure] = weakref.WeakKeyDictionary()
        self.process_cores = _cores()
        self.rolled_back_by: str | None = None
        #: This tool's failures measuring iterators (counted, said once, never the job's).
        self.failures = 0
        self._saved: dict[str, Any] = {}

    # ------------------------------------------------------------------ installing

    def install(self) -> None:
        owner = self._owner
        self._saved = {name: vars(owner).get(name) for name in ("__init__", "__next__")}
        trial = self
        original_next = owner.__next__

        def __init__(iterator: Any, *args: Any, **kwargs: Any) -> None:
            trial._build(iterator, args, kwargs)

        def __next__(iterator: Any) -> Any:
            measure = trial._measures.get(iterator)
            if measure is None:
                return original_next(iterator)
            try:
                batch = original_next(iterator)
            except StopIteration:
                trial._finish(iterator)
                raise
            now = time.perf_counter()
            measure.batches += 1
            if measure.first_at is None:
                measure.first_at = now
                measure.digest = trial._guarded(_digest, batch) or ""
            measure.last_at = now
            return batch

        __init__.__wrapped__ = self.legacy  # type: ignore[attr-defined]
        owner.__init__ = __init__
        owner.__next__ = __next__

    def uninstall(self) -> None:
        """Put back ``__init__`` and ``__next__``; the iterators still alive are reported as they are, and every
        report handed to the exporters."""
        for name, value in self._saved.items():
            if value is not None:
                setattr(self._owner, name, value)
        self._saved = {}
        for iterator in list(self._measures):
            self._finish(iterator)
        self.publisher.deliver()

    def roll_back(self, by: str) -> bool:
        """Every iterator from now on is legacy's. True when this changed anything."""
        with self._lock:
            if self.rolled_back_by is not None:
                return False
            self.rolled_back_by = by
            return True

    # ------------------------------------------------------------------ the arms

    def _next_arm(self) -> str:
        with self._lock:
            if self.rolled_back_by is not None:
                return LEGACY
            if not self._block:
                self._block = [LEGACY, UPSTREAM]
                self._random.shuffle(self._block)
            return self._block.pop()

    def _build(self, iterator: Any, args: tuple, kwargs: dict) -> None:
        arm = self._next_arm()
        before = self._guarded(_cores) or ()
        started = time.perf_counter()
        raised = ""
        try:
            if arm == LEGACY:
                self.legacy(iterator, *args, **kwargs)
            else:
                self._build_upstream(iterator, args, kwargs, before)
        except BaseException as exc:
            raised = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._guarded(self._measure, iterator, arm, before, started, raised)

    def _measure(self, iterator: Any, arm: str, before: tuple[int, ...], started: float, raised: str) -> None:
        """What is known of an iterator once its arm built it (or raised): exported now where it raised, else once
        it is exhausted, collected, or at exit."""
        run = ArmRun(
            target=self.target,
            arm=arm,
            timestamp=time.time(),
            worker_cores=tuple(_cores(w.pid) for w in getattr(iterator, "_workers", ()) if w.pid),
            caller_cores_before=before,
            caller_cores_after=_cores(),
            process_cores=self.process_cores,
            init_seconds=time.perf_counter() - started,
            base_seed=getattr(iterator, "_base_seed", None),
            raised=raised[:300],
        )
        if raised:
            self._export(run)
        else:
            self._measures[iterator] = _Measure(run, started)
            weakref.finalize(iterator, self._report, self._measures[iterator])

    def _guarded(self, function: Callable, *args: Any) -> Any:
        """This tool's own work beside the job's iterator: a failure is counted and said once, never the job's."""
        try:
            return function(*args)
        except Exception as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("npu-shadow [%s]: measuring an iterator failed (%r); the job goes on", self.target, exc)
            return None

    def _build_upstream(self, iterator: Any, args: tuple, kwargs: dict, before: tuple[int, ...]) -> None:
        """Upstream's ``__init__`` from the cores the process had when the trial began (legacy's binding of this
        thread, from an earlier legacy arm, is not upstream's), this thread put back as it was after."""
        rebind = bool(self.process_cores) and before != self.process_cores
        if rebind:
            failures = self.failures
            self._guarded(os.sched_setaffinity, 0, self.process_cores)
            rebind = self.failures == failures  # (put back only what was changed)
        try:
            self.upstream(iterator, *args, **kwargs)
        finally:
            if rebind:
                self._guarded(os.sched_setaffinity, 0, before)

    def _finish(self, iterator: Any) -> None:
        measure = self._measures.pop(iterator, None)
        if measure is not None:
            self._report(measure)

    def _report(self, measure: _Measure) -> None:
        if measure.reported:
            return
        measure.reported = True
        self._export(measure.finished())

    def _export(self, run: ArmRun) -> None:
        samples = contract.arm_samples(run.target, run.arm, run.workers_bound, run.first_batch_seconds)
        self.publisher.export(run.target, run, samples)
