"""One run of the shadow side with a deadline: on a thread of its own that starts in the caller's torch context.

A hanging upstream (a lock never released, a worker never joined) must not hold the job: the caller waits at most
the deadline, then goes on with the primary's result. The run cannot be stopped from outside (a thread blocked in C
code never sees an exception), so a run past its deadline is abandoned: its thread goes on alone, a daemon that
never keeps the process alive, and the target stops shadowing. An abandoned run that wakes later can still do what
upstream does (consume the global RNG, write its own copies); that is why the target stops at the first one.

The thread starts in the caller's thread-local torch context, so the run is the same call as on the caller's
thread: the caller's ``start`` writes the settings snapshot legacy started from (grad mode, autocast, function and
dispatch modes, the current device, intra-op threads, NumPy's error settings...: thread-local ones among them), and
this module adds what a snapshot cannot write (inference mode, the current stream, the saved-tensors hooks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class ThreadContext:
    """The thread-local torch state of the thread that took it that a snapshot of the settings
    (:class:`shadow.core.global_state.TorchGlobals`, written back on the new thread) does not carry: inference mode,
    the accelerator's current stream, the saved-tensors hooks on top of their stack."""

    inference: bool
    stream: Any
    saved_tensors_hooks: Any

    @classmethod
    def take(cls) -> ThreadContext:
        stream = None
        if torch.accelerator.current_accelerator() is not None:
            with contextlib.suppress(Exception):  # (a backend without streams)
                stream = torch.accelerator.current_stream()
        return cls(
            inference=torch.is_inference_mode_enabled(),
            stream=stream,
            saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
        )

    @contextlib.contextmanager
    def entered(self) -> Any:
        """This context on the current (fresh) thread, for the body of the ``with``."""
        if self.stream is not None:
            torch.accelerator.set_stream(self.stream)
        if self.saved_tensors_hooks is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*self.saved_tensors_hooks)
        try:
            with torch.inference_mode() if self.inference else contextlib.nullcontext():
                yield
        finally:
            if self.saved_tensors_hooks is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()


@dataclasses.dataclass(frozen=True)
class Finished:
    """What a run within its deadline returned or raised; ``finished`` False when it was abandoned."""

    finished: bool
    value: Any = None
    error: BaseException | None = None


def run_within(seconds: float | None, body: Callable[[], Any], start: Callable[[], None] | None = None) -> Finished:
    """``body()`` on a new daemon thread started in this thread's torch context, waited for at most ``seconds``
    (None: until it ends).
    ``start`` runs first on that thread (to mark it and write the caller's settings). An exception of the body's is
    its result, never raised here; an interrupt of the caller's (Ctrl-C while waiting) is raised here, the run
    abandoned."""
    context = ThreadContext.take()
    outcome: list[Finished] = []

    def run() -> None:
        try:
            if start is not None:
                start()
            with context.entered():
                value = body()
            outcome.append(Finished(True, value))
        except BaseException as exc:  # (the body's outcome, handed to the caller)
            outcome.append(Finished(True, error=exc))

    thread = threading.Thread(target=run, name="npu-shadow upstream side", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0] if outcome else Finished(False)
