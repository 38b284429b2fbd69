"""One run of the shadow side with a deadline: on a thread of the shadow side's that starts in the caller's torch
context.

A hanging upstream (a lock never released, a worker never joined) must not hold the job: the caller waits at most
the deadline, then goes on with the primary's result. The run cannot be stopped from outside (a thread blocked in C
code never sees an exception), so a run past its deadline is abandoned: its thread goes on alone, a daemon that
never keeps the process alive, and the target stops shadowing. An abandoned run that wakes later can still do what
upstream does (consume the global RNG, write its own copies); that is why the target stops at the first one.

The threads are kept between runs (:class:`_Workers`): starting one and waiting for the scheduler twice cost about
300 us a run, more than a cheap call's whole shadow side. Each run starts in the caller's thread-local torch
context, so it is the same call as on the caller's thread: the caller's ``start`` writes the settings snapshot legacy
started from (grad mode, autocast, function and dispatch modes, the current device, intra-op threads, NumPy's error
settings...: thread-local ones among them), and this module adds what a snapshot cannot write (inference mode, the
current stream, the saved-tensors hooks).
"""

from __future__ import annotations

import _thread
import atexit
import collections
import contextlib
import contextvars
import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.runs.sides import marks
from shadow.core.support import forks


def _serialization_locals() -> Any:
    """torch.serialization's thread-local state (``skip_data``, ``materialize_fake_tensors``, the ``map_location`` of
    a load under way), or None in a torch without it."""
    serialization = sys.modules.get("torch.serialization")
    return getattr(serialization, "_serialization_tls", None)


@dataclasses.dataclass(frozen=True)
class ThreadContext:
    """The thread-local state of the thread that took it that a snapshot of the settings
    (:class:`shadow.core.runs.global_state.TorchGlobals`, written back on the new thread) does not carry: inference
    mode, the accelerator's current stream, the saved-tensors hooks on top of their stack, torch.serialization's
    thread-locals, and every context variable (torch's config modules keep a thread's overrides in them:
    ``torch.serialization.set_default_load_endianness``, the mmap options, dynamo's and inductor's settings; NumPy
    2's error state). The body runs in a copy of the caller's context: what it sets there never reaches the caller
    nor stays on the worker."""

    inference: bool
    stream: Any
    saved_tensors_hooks: Any
    variables: contextvars.Context
    serialization: dict[str, Any]

    @classmethod
    def take(cls) -> ThreadContext:
        stream = None
        if torch.accelerator.current_accelerator() is not None:
            with contextlib.suppress(Exception):  # (a backend without streams)
                stream = torch.accelerator.current_stream()
        serialization = _serialization_locals()
        return cls(
            inference=torch.is_inference_mode_enabled(),
            stream=stream,
            saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
            variables=contextvars.copy_context(),
            serialization=dict(vars(serialization)) if serialization is not None else {},
        )

    @contextlib.contextmanager
    def entered(self) -> Any:
        """This context on the current (fresh) thread, for the body of the ``with`` (its context variables: run the
        body with :meth:`run`)."""
        if self.stream is not None:
            torch.accelerator.set_stream(self.stream)
        if self.saved_tensors_hooks is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*self.saved_tensors_hooks)
        serialization = _serialization_locals()
        kept = dict(vars(serialization)) if serialization is not None else {}
        if serialization is not None:
            vars(serialization).update(self.serialization)
        try:
            with torch.inference_mode() if self.inference else contextlib.nullcontext():
                yield
        finally:
            if serialization is not None:
                vars(serialization).clear()
                vars(serialization).update(kept)
            if self.saved_tensors_hooks is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()

    def run(self, body: Callable[[], Any]) -> Any:
        """``body()`` in a copy of the caller's context variables."""
        return self.variables.copy().run(body)


@dataclasses.dataclass(frozen=True)
class Finished:
    """What a run within its deadline returned or raised; ``finished`` False when it was abandoned."""

    finished: bool
    value: Any = None
    error: BaseException | None = None


class _Workers:
    """The threads shadow-side runs take place on, kept between runs (starting a thread and waiting for it to be
    scheduled costs more than a cheap call's whole shadow side).

    Each worker waits on a queue of its own (its inbox); the idle workers' inboxes are a stack, the worker idle last on
    top: a run is handed to the worker that ran the last one (its thread's caches still warm), or to a worker started
    for it, so it never waits behind a busy worker (a run abandoned at its deadline keeps its worker). Each step of a
    hand-off is one C call: an interrupt between the two leaves one worker idle for good (a later run takes another),
    never a run without a worker. A worker whose run raised or changed a thread-local setting (:func:`leave_worker`)
    leaves the pool (its thread may hold state of that run's), and so does an abandoned one.
    """

    def __init__(self) -> None:
        self._after_fork_in_child()
        forks.register(self)

    def _after_fork_in_child(self) -> None:  # (the workers' threads are not in the child)
        self._idle: collections.deque[tuple[queue.SimpleQueue[_Run | None], threading.Thread]] = collections.deque()
        self._closed = False

    def close(self, wait: float = 2.0) -> None:
        """End the idle workers and wait (at most ``wait`` seconds in all) for their threads to end: at interpreter
        exit, while the interpreter is whole. A daemon thread still there when it finalizes is ended wherever it
        next takes the GIL, and one whose stack holds C++ frames (a worker started under torch.compile's frame hook)
        aborts the process there ("terminate called without an active exception"). An abandoned worker's run cannot
        be stopped; it is left as it is."""
        self._closed = True
        closed = []
        while True:
            try:
                inbox, thread = self._idle.pop()
            except IndexError:
                break
            inbox.put(None)
            closed.append(thread)
        deadline = time.monotonic() + wait
        for thread in closed:
            thread.join(max(0.0, deadline - time.monotonic()))

    def hand_over(self, run: _Run) -> None:
        """``run`` to the worker idle last, or to a worker started for it."""
        try:
            inbox, _ = self._idle.pop()
        except IndexError:
            # (the run goes through the inbox, never the thread's arguments: a thread keeps those while it lives, and
            # with them the first run's result, copies and graph)
            inbox = queue.SimpleQueue()
            inbox.put(run)
            threading.Thread(target=self._work, args=(inbox,), name="npu-shadow shadow side", daemon=True).start()
        else:
            inbox.put(run)

    def _work(self, inbox: queue.SimpleQueue[_Run | None]) -> None:
        idle, me = self._idle, (inbox, threading.current_thread())
        run = inbox.get()
        while run is not None:
            kept = run.run() and not run.abandoned and not getattr(worker, "leaving", False)
            run = None  # (a worker waiting for its next run holds nothing of its last: its result, graph, copies)
            if not kept:
                return
            marks.__dict__.clear()  # (the marks of the run it had: the next run's start writes its own)
            if self._closed:  # (the interpreter is exiting: a run after this starts a worker of its own)
                return
            idle.append(me)
            run = inbox.get()  # (None: closed)


#: The worker this thread is, its own state: ``leaving`` (set by :func:`leave_worker`: the worker ends after its
#: run), and what the runs keep on it between runs (the settings it holds: shadow.core.calls.sampled.shadow_side).
worker = threading.local()


def leave_worker() -> None:
    """The worker this thread is ends after its run: the run left thread-local state on it that the next run's start
    might not write back (a setting it changed, one that could not be written)."""
    worker.leaving = True


class _Run:
    """One run handed to a worker: its start and body, and its outcome, released when it is there."""

    __slots__ = ("abandoned", "body", "context", "done", "outcome", "start")

    def __init__(self, body: Callable[[], Any], start: Callable[[], None] | None, context: ThreadContext) -> None:
        self.body, self.start, self.context = body, start, context
        self.outcome: Finished | None = None
        self.abandoned = False
        self.done = _thread.allocate_lock()
        self.done.acquire()

    def run(self) -> bool:
        """Run it on this thread; whether the body returned (not raised)."""
        try:
            if self.start is not None:
                self.start()
            with self.context.entered():
                self.outcome = Finished(True, self.context.run(self.body))  # (no local of this frame's holds it)
            return True
        except BaseException as exc:  # (the body's outcome, handed to the caller)
            self.outcome = Finished(True, error=exc)
            return False
        finally:
            self.done.release()


_WORKERS = _Workers()
atexit.register(_WORKERS.close)


def run_within(seconds: float | None, body: Callable[[], Any], start: Callable[[], None] | None = None) -> Finished:
    """``body()`` on a daemon thread of the shadow side's (:class:`_Workers`), in this thread's torch context, waited
    for at most ``seconds`` (None: until it ends).
    ``start`` runs first on that thread (to mark it and write the caller's settings). An exception of the body's is
    its result, never raised here; an interrupt of the caller's (Ctrl-C while waiting) is raised here, the run
    abandoned."""
    run = _Run(body, start, ThreadContext.take())
    handed = time.monotonic()
    try:
        _WORKERS.hand_over(run)
        finished = run.done.acquire(True, -1 if seconds is None else seconds)
    except BaseException:
        run.abandoned = True
        raise
    # A run can end past its deadline and still be found finished: one that held the GIL (C code that never
    # released it) kept the caller from its wait until it ended. It is past its deadline all the same: the target
    # stops, so the job is held so once, not at every later run.
    if not finished or (seconds is not None and time.monotonic() - handed > seconds):
        run.abandoned = True
        return Finished(False)
    outcome, run.outcome, run.body = run.outcome, None, None  # (the worker may hold the run a moment longer)
    return outcome


def run_here(body: Callable[[], Any]) -> Finished:
    """``body()`` on this thread, its outcome as :func:`run_within` gives it: for a run that cannot block (a
    target's ``never_blocks`` calls), which needs no deadline. An interrupt is raised, never returned."""
    try:
        return Finished(True, body())
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # (the body's outcome, as on a worker)
        return Finished(True, error=exc)
