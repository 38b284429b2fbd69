"""Which side of which experiment a thread is running: the marks the call path reads to tell a job's own call
from a nested one.

Per thread (``marks``): ``shadow_side``, the experiment whose shadow side this thread runs (upstream, the
comparison, the oracle, the exporters); ``run``, the upstream run under way on it (a key of
:data:`shadow_runs`); ``inherited``, the (run, experiment) of the thread that started this one; ``in_primary``,
the experiment whose primary it runs; ``publishing`` while it hands an observation to the exporters.

A run's threads are known by construction: a thread started by a thread of an upstream run (DataParallel's workers
in upstream's ``parallel_apply``) inherits that run, and is part of it while the run is under way (a pool's
thread started then and kept by the job is the job's again once the run ended). Every other thread is the job's,
whenever it was started. The one exception is the autograd engine's device threads, which Python does not start:
during a backward comparison's run (``backward``) they are its. (A dict's item assignment and ``del`` are atomic
and call nothing: no lock, and no point where an interrupt could leave a run behind.)
"""

from __future__ import annotations

import contextlib
import enum
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from shadow.core.support import forks


class _Marks(threading.local):
    """A thread's marks; one never set reads None from the class (a thread-local attribute that is missing costs
    an exception, a microsecond, on every read: the call path reads these on every call)."""

    shadow_side: Any = None
    run: object | None = None
    inherited: tuple[object, Any] | None = None
    in_primary: Any = None
    publishing: Any = None


marks = _Marks()

#: The shadow runs under way, by a key of their own: its experiment, and whether it is a backward comparison's.
shadow_runs: dict[object, tuple[Any, bool]] = {}


class Lean:
    """What a run that keeps no activations saw: whether anything asked for a tensor it did not keep (the call's
    own code reading its graph during the forward, ``torch.autograd.grad`` in a forward)."""

    read = False

    def pack(self, tensor: Any) -> None:
        return None

    def unpack(self, packed: Any) -> Any:
        self.read = True
        raise RuntimeError("npu-shadow: this shadow run keeps no activations; its graph cannot be read")


def _top_hooks() -> Any:
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def lean_of_this_thread() -> Lean | None:
    """The :class:`Lean` whose hooks are on top of this thread's saved tensors hooks, or None."""
    top = _top_hooks()
    owner = getattr(top[0], "__self__", None) if top else None
    return owner if isinstance(owner, Lean) else None


@contextlib.contextmanager
def keeping_no_activations(lean: Lean | None) -> Iterator[None]:
    """While the body runs on this thread, autograd keeps none of the tensors a backward would read (torch's saved
    tensors hooks): the forward computes what it computes, its outputs require grad as they would, and a shadow
    run that is compared only forward holds no second copy of the call's activations. A thread the body starts
    keeps none either (:func:`install_inheritance`). None: no change."""
    if lean is None:
        yield
        return
    import torch

    torch._C._autograd._push_saved_tensors_default_hooks(lean.pack, lean.unpack)
    try:
        yield
    finally:
        if lean_of_this_thread() is lean:  # (a settings put-back on this thread may have taken them off already)
            torch._C._autograd._pop_saved_tensors_default_hooks()


class SampledCallsUnderWay:
    """How many sampled calls are under way in this process. While none is, no shadow side runs and the monitor does
    no work of its own on any thread, so a call of a counted place is the job's without a look at which thread
    makes it (:mod:`shadow.core.calls.patch_calls`: its one check on the common path)."""

    def __init__(self) -> None:
        #: The sampled calls under way; changed under :attr:`lock` (by the sampled call itself, inline: its path
        #: stays in its own file).
        self.count = 0
        self.lock = threading.Lock()


SAMPLED_CALLS = SampledCallsUnderWay()


class Role(enum.Enum):
    """Whose run a thread runs, besides an experiment's own shadow run."""

    #: Legacy run again, isolated as the shadow run is (the A/A run, the backward comparison's, the truth run's):
    #: the calls it makes of wrapped functions are nested calls, never the shadow's.
    LEGACY_AGAIN = "legacy again"


#: Registered as the shadow side while legacy runs again: the calls it makes of wrapped functions are nested calls,
#: and they run legacy (only an experiment's own shadow run routes them to the shadow).
LEGACY_AGAIN = Role.LEGACY_AGAIN


@contextlib.contextmanager
def shadow_run(experiment: Any, backward: bool = False) -> Iterator[object]:
    """While the body runs, this thread's upstream run is one of ``experiment``'s (the threads it starts, and a
    worker it hands a run to, are part of it: the key it gives, :func:`current_run`'s); with ``backward`` (a
    backward comparison's run, :mod:`shadow.core.judging.gradients`), so are the autograd engine's own threads (the
    device threads a backward through device tensors runs on). (The job's thread waits in the sampled call meanwhile; a
    backward of another job thread's at that moment would run its wrapped calls as nested ones, the primary's
    implementation, uncounted: what the job gets, unseen.)"""
    key = object()
    outer = getattr(marks, "run", None)
    try:
        shadow_runs[key] = (experiment, backward)
        marks.run = key
        yield key
    finally:
        del shadow_runs[key]  # (first: a key left in marks.run by an interrupt is no run's)
        marks.run = outer


def current_run() -> object | None:
    """The key of the upstream run this thread is part of (to hand to a worker that runs it), or None."""
    run = getattr(marks, "run", None)
    if run is not None:
        return run
    inherited = getattr(marks, "inherited", None)
    return inherited[0] if inherited is not None and inherited[0] in shadow_runs else None


def shadow_side_of_this_thread() -> Any | None:
    """The experiment whose shadow side this thread is part of: running it, started by a thread of its
    upstream run while that run is under way, or an autograd thread during its backward run."""
    side = getattr(marks, "shadow_side", None)
    if side is not None or not shadow_runs:
        return side
    inherited = getattr(marks, "inherited", None)
    if inherited is not None and inherited[0] in shadow_runs:
        return inherited[1]
    if isinstance(threading.current_thread(), threading._DummyThread):
        return next((experiment for experiment, backward in tuple(shadow_runs.values()) if backward), None)
    return None


def _inheritance() -> tuple[object, Any] | None:
    """What a thread started by this one inherits: (its upstream run, the experiment), or None."""
    side = getattr(marks, "shadow_side", None)
    run = getattr(marks, "run", None)
    if side is not None and run is not None:
        return run, side
    inherited = getattr(marks, "inherited", None)
    return inherited if inherited is not None and inherited[0] in shadow_runs else None


def _inheriting(start: Callable[..., Any]) -> Callable[..., Any]:
    """``threading``'s function that starts a thread, with the new thread inheriting the upstream run of the
    thread that starts it (nothing else changes: a thread started by the job's own code runs as it did)."""

    def start_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        inherited = _inheritance()
        if inherited is None:
            return start(function, *args, **kwargs)
        lean = lean_of_this_thread()  # (a run that keeps no activations: neither do the threads it starts)

        def bootstrap(*a: Any, **k: Any) -> Any:
            marks.inherited = inherited
            with keeping_no_activations(lean):
                return function(*a, **k)

        return start(bootstrap, *args, **kwargs)

    start_thread.__wrapped__ = start  # type: ignore[attr-defined]
    return start_thread


_inheritance_lock = threading.Lock()
_inheritance_installs = 0
_replaced: list[tuple[str, Callable[..., Any]]] = []  # (threading's name, its own function) while installed


def install_inheritance() -> None:
    """Threads started from now on inherit the upstream run of the thread that starts them (threading's function
    that starts a thread, wrapped); counted: the last :func:`uninstall_inheritance` puts threading's own back."""
    global _inheritance_installs
    with _inheritance_lock:
        _inheritance_installs += 1
        if _inheritance_installs > 1:
            return
        for name in ("_start_joinable_thread", "_start_new_thread"):  # (Python 3.13+, before)
            start = getattr(threading, name, None)
            if start is not None and not hasattr(start, "__wrapped__"):
                _replaced.append((name, start))
                setattr(threading, name, _inheriting(start))
                return


def uninstall_inheritance() -> None:
    """Undo one :func:`install_inheritance`: the last one puts threading's own function back (where nothing
    replaced ours since)."""
    global _inheritance_installs
    with _inheritance_lock:
        _inheritance_installs = max(0, _inheritance_installs - 1)
        if _inheritance_installs:
            return
        while _replaced:
            name, start = _replaced.pop()
            if getattr(getattr(threading, name, None), "__wrapped__", None) is start:
                setattr(threading, name, start)


#: What the tool's own threads are named (the shadow side's workers, the reporter, the metrics endpoint, ...).
OWN_THREADS = "npu-shadow"


def job_threads_besides_this_one() -> bool:
    """Whether a Python thread of the job's other than the caller's is alive: one that would see a process-wide
    setting the shadow side wrote for a moment (the tool's own threads, and those C started, are not the job's)."""
    me = threading.current_thread()
    return any(
        thread is not me and not thread.name.startswith(OWN_THREADS)
        and not isinstance(thread, threading._DummyThread) and thread.is_alive()
        for thread in threading.enumerate()
    )  # fmt: skip


class _QuietShadowWarnings:
    """Warnings the shadow side raises (its runs, the comparison, the exporters) never reach the job: ``warnings``'
    one function that shows a warning (``_showwarnmsg``: below it, the job's ``catch_warnings(record=True)``, its
    ``showwarning`` or ``logging.captureWarnings``) passes on the warnings of the job's threads only, while a monitor
    is installed. (Python's C code marks a warning shown "once" in its registry before asking to show it: such a
    warning raised first by the shadow side would not be shown to the job later.)"""

    def __init__(self) -> None:
        self.installs = 0
        self.lock = threading.Lock()
        self.shown: Callable[[Any], Any] | None = None

    def install(self) -> None:
        with self.lock:
            self.installs += 1
            if self.installs == 1:
                self.shown = warnings._showwarnmsg  # type: ignore[attr-defined]
                warnings._showwarnmsg = self.show  # type: ignore[attr-defined]

    def uninstall(self) -> None:
        with self.lock:
            self.installs = max(0, self.installs - 1)
            if not self.installs and self.shown is not None:
                if warnings._showwarnmsg == self.show:  # type: ignore[attr-defined]  (nothing replaced ours since)
                    warnings._showwarnmsg = self.shown  # type: ignore[attr-defined]
                self.shown = None

    def show(self, message: Any) -> None:
        shown = self.shown or warnings._showwarnmsg_impl  # type: ignore[attr-defined]
        if shadow_side_of_this_thread() is None and current_run() is None:
            shown(message)


_QUIET = _QuietShadowWarnings()
install_quiet_warnings, uninstall_quiet_warnings = _QUIET.install, _QUIET.uninstall


class _Runs:
    """The runs under way are the parent's: none in a forked child."""

    def _after_fork_in_child(self) -> None:
        shadow_runs.clear()
        marks.__dict__.pop("inherited", None)


_RUNS = _Runs()
forks.register(_RUNS)
