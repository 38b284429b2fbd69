"""Which of a release's function patches a job calls: a call counter at the place of each one.

``npu-shadow census`` lists what a torch_npu release replaces in torch; a team choosing the next patch to retire
needs to know which of those its jobs call at all. :class:`PatchCalls` puts a counter at each place (on an NPU host
around torch_npu's installed function, in rehearsal around whatever is there), installed after the monitor's own
wrappers so that a call of a shadowed place counts once. The function itself is untouched; the counter is one
Python call and an atomic increment (``itertools.count``). Calls made by the shadow side (upstream's run, the A/A,
backward and truth runs), and those the monitor's own code makes on the job's thread, are not the job's and are not
counted.

A place is counted where its module is already imported (never imported here: only what this process reaches)
and it holds a function or method; classes (constructors), classmethods, properties and compile-time internals
(dynamo, inductor) are left alone.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import sys
from collections.abc import Iterable
from typing import Any

from shadow.core.runs.sides import SAMPLED_CALLS, shadow_side_of_this_thread

log = logging.getLogger("shadow")

#: Patches inside torch's compilers: they run while a graph is compiled, never as a call of the job.
COMPILE_INTERNALS = ("torch._dynamo.", "torch._inductor.", "torch._functorch.", "torch.fx.")
#: The monitor's own modules: a call they make (the sampled call's snapshot of the autocast state, say) is not
#: the job's.
OWN_MODULES = ("shadow.", "exporters.")


def _place(name: str) -> tuple[Any, str] | None:
    """(owner, attribute) of a dotted name whose module is imported (``torch.serialization.save``,
    ``torch.Tensor.__repr__``), or None where it is not reachable in this process."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        owner: Any = module
        for part in parts[cut:-1]:
            owner = getattr(owner, part, None)
            if owner is None:
                return None
        return owner, parts[-1]
    return None


def _countable(raw: Any) -> bool:
    """Whether a place's own object can carry a counter: a function, or a method of a class (Python's or C's)."""
    if isinstance(raw, (staticmethod, classmethod, property, type)):
        return isinstance(raw, staticmethod) and callable(raw.__func__)
    return inspect.isfunction(raw) or inspect.isbuiltin(raw) or inspect.ismethoddescriptor(raw)


def _counted(function: Any, counter: itertools.count) -> Any:
    """``function`` with a call counter: the job's calls counted, the shadow side's not."""

    getframe, sampled = sys._getframe, SAMPLED_CALLS

    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        # (no sampled call under way anywhere: the job's call; else not the shadow side's, nor the monitor's own)
        if not sampled.count or (
            shadow_side_of_this_thread() is None
            and not getframe(1).f_globals.get("__name__", "").startswith(OWN_MODULES)
        ):
            next(counter)
        return function(*args, **kwargs)

    counted.__npu_shadow_counter__ = counter  # type: ignore[attr-defined]
    return counted


def _value(counter: itertools.count) -> int:
    """How many times ``counter`` was advanced (never advancing it)."""
    return counter.__reduce__()[1][0]  # type: ignore[index]


class PatchCalls:
    """Call counters at the places of ``names`` (a release's function patches, by dotted name)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(dict.fromkeys(n for n in names if not n.startswith(COMPILE_INTERNALS)))
        #: name -> (owner, attribute, had its own attribute, the object there before, the counter, what we put)
        self._installed: dict[str, tuple[Any, str, bool, Any, itertools.count, Any]] = {}
        self._reported: dict[str, int] = {}

    def install(self) -> None:
        """Put a counter at every place that is reachable in this process and holds a function."""
        for name in self.names:
            place = _place(name)
            if place is None:
                continue
            owner, attribute = place
            # (a class's own attribute, or one it inherits: put back by deleting ours)
            had_own = not isinstance(owner, type) or attribute in vars(owner)
            raw = inspect.getattr_static(owner, attribute, None)
            if raw is None or not _countable(raw) or hasattr(raw, "__npu_shadow_counter__"):
                continue
            counter = itertools.count()
            wrapped = staticmethod(_counted(raw.__func__, counter)) if isinstance(raw, staticmethod) else None
            put = wrapped if wrapped is not None else _counted(raw, counter)
            try:
                setattr(owner, attribute, put)
            except (AttributeError, TypeError) as exc:  # (a C type that takes no new attribute)
                log.debug("npu-shadow: no call counter at %s: %r", name, exc)
                continue
            self._installed[name] = (owner, attribute, had_own, raw, counter, put)

    @property
    def counted(self) -> tuple[str, ...]:
        """The patches that carry a counter (reachable in this process)."""
        return tuple(self._installed)

    def counts(self) -> dict[str, int]:
        """{patch: the job's calls so far} of every patch that carries a counter."""
        return {name: _value(entry[4]) for name, entry in self._installed.items()}

    def since_reported(self) -> dict[str, int]:
        """The calls of each patch since the last time this was asked (those with any)."""
        now = self.counts()
        deltas = {name: calls - self._reported.get(name, 0) for name, calls in now.items()}
        self._reported = now
        return {name: calls for name, calls in deltas.items() if calls > 0}

    def uninstall(self) -> None:
        """Put back what each place held, where nothing replaced the counter since."""
        while self._installed:
            name, (owner, attribute, had_own, raw, _, put) = self._installed.popitem()
            if inspect.getattr_static(owner, attribute, None) is not put:
                log.warning("npu-shadow: %s was replaced while counted; leaving the new object", name)
            elif had_own:
                setattr(owner, attribute, raw)
            else:
                delattr(owner, attribute)
