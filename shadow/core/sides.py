"""Which side of which experiment a thread is running: the marks the call path reads to tell a job's own call
from a nested one.

Per thread (``marks``): ``upstream_side``, the experiment whose upstream side this thread runs (upstream, the
comparison, the oracle, the exporters); ``in_legacy``, the experiment whose legacy it runs; ``publishing`` while it
hands an observation to the exporters.

Each upstream run is on a daemon thread of the shadow side's (:mod:`shadow.core.deadline`), and the threads it starts
(DataParallel's workers in upstream's ``parallel_apply``) are daemons too (a thread is a daemon where the thread
that made it is). So the runs under way are kept with the threads alive when each began: a daemon thread not among
those was started by that run, and its calls belong to it. The job's threads started meanwhile (the replicas of
legacy's own ``parallel_apply`` on another thread) are not daemons: they stay the job's. (A dict's item assignment
and ``del`` are atomic and call nothing: no lock, and no point where an interrupt could leave a run behind.)
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator
from typing import Any

marks = threading.local()

#: The upstream runs under way, by a key of their own: the threads alive when each began, its experiment, and
#: whether it is a backward comparison's run.
upstream_runs: dict[object, tuple[frozenset[int], Any, bool]] = {}

#: Registered as the "upstream side" while legacy runs again for the noise floor: the calls it makes of wrapped
#: functions are nested calls, and they run legacy (only an experiment's own upstream run routes them upstream).
LEGACY_AGAIN = object()

_IDENT = operator.attrgetter("ident")


@contextlib.contextmanager
def upstream_run(experiment: Any, backward: bool = False) -> Iterator[None]:
    """While the body runs, the daemon threads started meanwhile are ``experiment``'s upstream side; with
    ``backward`` (a backward comparison's run, :mod:`shadow.core.gradients`), so are the autograd engine's own
    threads (threads Python did not start: the device threads a backward through device tensors runs on). (The
    job's thread waits in the sampled call meanwhile; a backward of another job thread's at that moment would run
    its wrapped calls as nested ones, the primary's implementation, uncounted: what the job gets, unseen.)"""
    # (no loop of this module's over the threads: what an interrupt can land in does not grow with their number)
    run, key = (frozenset(map(_IDENT, threading.enumerate())), experiment, backward), object()
    try:
        upstream_runs[key] = run
        yield
    finally:
        del upstream_runs[key]


def upstream_side_of_this_thread() -> Any | None:
    """The experiment whose upstream side this thread is part of: running it, started by its upstream run, or an
    autograd thread during its backward run."""
    side = getattr(marks, "upstream_side", None)
    if side is not None or not upstream_runs:
        return side
    thread = threading.current_thread()
    if not thread.daemon:
        return None
    runs = tuple(upstream_runs.values())
    if isinstance(thread, threading._DummyThread):
        backward = next((experiment for _, experiment, backward in runs if backward), None)
        if backward is not None:
            return backward
    ident = threading.get_ident()
    return next((experiment for alive, experiment, _ in runs if ident not in alive), None)
