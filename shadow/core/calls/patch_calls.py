"""Which of a release's function patches a job calls: counted where each patch's function starts, the function
itself left where it is, as it is.

``npu-shadow census`` lists what a torch_npu release replaces in torch; a team choosing the next patch to retire
needs to know which of those its jobs call at all. :class:`PatchCalls` counts the calls of the function at each
place (on an NPU host torch_npu's installed function, in rehearsal whatever is there) without putting anything in
its place: the job's code, TorchScript, ``torch.compile``, ``pickle``, ``inspect`` and every dict keyed by the
function see the very object they would see unwatched. Python 3.12's ``sys.monitoring`` (PEP 669) tells when a
Python function's code starts, for that code object alone (no other code pays anything); the counter is one Python
call and an atomic increment (``itertools.count``). Calls made by the shadow side (upstream's run, the A/A,
backward and truth runs), and those the monitor's own code makes on the job's thread, are not the job's and are not
counted.

What cannot be counted so is not counted, and :attr:`PatchCalls.uncounted` says why (the exit summary names it):
a C function or method (torch's own, where torch_npu is not installed: only a replacement could count it), and every
place on a Python without ``sys.monitoring`` (3.10, 3.11). A function made by a factory shares its code with the
factory's other closures: it gets a copy of its code of its own (equal to the original, which is put back when
the counter goes), so that the calls of one closure are never counted as another's.

A place is counted where its module is already imported (never imported here: only what this process reaches)
and it holds a function or a static method; classes (constructors), classmethods, properties and compile-time
internals (dynamo, inductor) are left alone. A forked child counts its own calls from zero.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import threading
import types
from collections.abc import Iterable
from typing import Any

from shadow.core.runs.sides import SAMPLED_CALLS, shadow_side_of_this_thread
from shadow.core.support import forks

log = logging.getLogger("shadow")

#: Patches inside torch's compilers: they run while a graph is compiled, never as a call of the job.
COMPILE_INTERNALS = ("torch._dynamo.", "torch._inductor.", "torch._functorch.", "torch.fx.")
#: The monitor's own modules: a call they make (the sampled call's snapshot of the autocast state, say) is not
#: the job's.
OWN_MODULES = ("shadow.", "exporters.")

#: Why a place is not counted.
NO_MONITORING = (
    "this Python has no sys.monitoring (Python 3.12+): counting a call without replacing the function needs it"
)
C_FUNCTION = "a C function or method: counting its calls would mean replacing it (torch_npu's own patch is Python)"
NO_TOOL = "every sys.monitoring tool id is taken by other tools"

_MONITORING: Any = getattr(sys, "monitoring", None)
#: The sys.monitoring tool ids this module may take, in order (no standard tool claims 3 or 4).
_TOOL_IDS = (4, 3)


class _Starts:
    """The process's one sys.monitoring tool: the counters of the code objects it watches (several monitors may
    count one code), a PY_START event set on each of those code objects alone."""

    def __init__(self) -> None:
        self.tool: int | None = None
        #: id(code) -> (the code, its counters)
        self.watched: dict[int, tuple[types.CodeType, list[itertools.count]]] = {}
        self.lock = threading.Lock()
        forks.register(self)

    def watch(self, code: types.CodeType, counter: itertools.count) -> str | None:
        """Count the starts of ``code`` into ``counter``; why not, or None."""
        with self.lock:
            if self.tool is None:
                why = self._take_tool()
                if why:
                    return why
            entry = self.watched.get(id(code))
            if entry is None:
                self.watched[id(code)] = (code, [counter])
                _MONITORING.set_local_events(self.tool, code, _MONITORING.events.PY_START)
            else:
                entry[1].append(counter)
        return None

    def unwatch(self, code: types.CodeType, counter: itertools.count) -> None:
        with self.lock:
            entry = self.watched.get(id(code))
            if entry is None:
                return
            counters = entry[1]
            if counter in counters:
                counters.remove(counter)
            if not counters:
                del self.watched[id(code)]
                _MONITORING.set_local_events(self.tool, code, 0)
            if not self.watched and self.tool is not None:
                _MONITORING.register_callback(self.tool, _MONITORING.events.PY_START, None)
                _MONITORING.free_tool_id(self.tool)
                self.tool = None

    def _take_tool(self) -> str | None:
        for tool in _TOOL_IDS:
            if _MONITORING.get_tool(tool) is None:
                _MONITORING.use_tool_id(tool, "npu-shadow patch calls")
                _MONITORING.register_callback(tool, _MONITORING.events.PY_START, _started(self.watched))
                self.tool = tool
                return None
        return NO_TOOL

    def _after_fork_in_child(self) -> None:
        # (a counter is a parent's object: the child's calls are its own, counted from zero; the PatchCalls that
        # own the counters are told by their own fork hook)
        self.lock = threading.Lock()


def _started(watched: dict[int, tuple[types.CodeType, list[itertools.count]]]) -> Any:
    """The PY_START callback: a start of a watched code is counted where it is the job's call."""
    getframe, sampled, get = sys._getframe, SAMPLED_CALLS, watched.get

    def started(code: types.CodeType, offset: int) -> None:
        entry = get(id(code))
        if entry is None:
            return
        # (no sampled call under way anywhere: the job's call; else not the shadow side's, nor the monitor's own:
        # frame 1 is the function's own, frame 2 its caller's)
        if not sampled.count or (
            shadow_side_of_this_thread() is None
            and not getframe(2).f_globals.get("__name__", "").startswith(OWN_MODULES)
        ):
            for counter in entry[1]:
                next(counter)

    return started


#: The process's tool (None on a Python without sys.monitoring).
STARTS = _Starts() if _MONITORING is not None else None


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


def _function_at(raw: Any) -> tuple[types.FunctionType | None, str | None]:
    """(the Python function a place holds, None) or (None, why it cannot be counted); (None, None) where the place
    holds no function patch at all (a class, a property, a classmethod: left alone)."""
    if isinstance(raw, staticmethod):
        raw = raw.__func__
    if isinstance(raw, (classmethod, property, type)):
        return None, None
    if inspect.isfunction(raw):
        return raw, None
    if inspect.isbuiltin(raw) or inspect.ismethoddescriptor(raw):
        return None, C_FUNCTION
    return None, None


def _value(counter: itertools.count) -> int:
    """How many times ``counter`` was advanced (never advancing it)."""
    return counter.__reduce__()[1][0]  # type: ignore[index]


class PatchCalls:
    """Call counters at the places of ``names`` (a release's function patches, by dotted name)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(dict.fromkeys(n for n in names if not n.startswith(COMPILE_INTERNALS)))
        #: name -> the counter of the function at its place (names holding one function share its counter)
        self._counters: dict[str, itertools.count] = {}
        #: the functions counted: (the function, the code it had, the code it was given or None, its counter)
        self._functions: list[tuple[types.FunctionType, types.CodeType, types.CodeType | None, itertools.count]] = []
        #: name -> why its place is not counted (reachable, holding a function, but not countable here)
        self.uncounted: dict[str, str] = {}
        self._reported: dict[str, int] = {}
        forks.register(self)

    def install(self) -> None:
        """Count the calls of the function at every place that is reachable in this process and holds one."""
        by_function: dict[int, itertools.count] = {}
        for name in self.names:
            place = _place(name)
            if place is None:
                continue
            function, why = _function_at(inspect.getattr_static(*place, None))
            if function is None:
                if why is not None:
                    self.uncounted[name] = why
                continue
            if STARTS is None:
                self.uncounted[name] = NO_MONITORING
                continue
            counter = by_function.get(id(function))
            if counter is None:
                counter = itertools.count()
                why = self._watch(function, counter)
                if why is not None:
                    self.uncounted[name] = why
                    continue
                by_function[id(function)] = counter
            self._counters[name] = counter

    def _watch(self, function: types.FunctionType, counter: itertools.count) -> str | None:
        original = function.__code__
        # (a closure shares its code with its factory's other closures: a copy of its own, equal to it)
        own = original.replace() if function.__closure__ else None
        if own is not None:
            function.__code__ = own
        why = STARTS.watch(own or original, counter)  # type: ignore[union-attr]
        if why is not None:
            if own is not None:
                function.__code__ = original
            return why
        self._functions.append((function, original, own, counter))
        return None

    @property
    def counted(self) -> tuple[str, ...]:
        """The patches whose calls are counted (reachable in this process, and countable)."""
        return tuple(self._counters)

    def counts(self) -> dict[str, int]:
        """{patch: the job's calls so far} of every counted patch."""
        return {name: _value(counter) for name, counter in self._counters.items()}

    def since_reported(self) -> dict[str, int]:
        """The calls of each patch since the last time this was asked (those with any)."""
        now = self.counts()
        deltas = {name: calls - self._reported.get(name, 0) for name, calls in now.items()}
        self._reported = now
        return {name: calls for name, calls in deltas.items() if calls > 0}

    def uninstall(self) -> None:
        """Stop counting (the counts stay as they are); give each function its own code back where nothing
        replaced it since."""
        while self._functions:
            function, original, own, counter = self._functions.pop()
            STARTS.unwatch(own or original, counter)  # type: ignore[union-attr]
            if own is not None and function.__code__ is own:
                function.__code__ = original

    def _after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) counts and reports its own calls: its parent's, reported or not, are
        # the parent's to report.
        fresh: dict[int, itertools.count] = {}
        for index, (function, original, own, counter) in enumerate(self._functions):
            new = fresh.setdefault(id(counter), itertools.count())
            entry = STARTS.watched.get(id(own or original)) if STARTS is not None else None
            if entry is not None:
                entry[1][:] = [new if c is counter else c for c in entry[1]]
            self._functions[index] = (function, original, own, new)
        self._counters = {name: fresh.get(id(c), c) for name, c in self._counters.items()}
        self._reported = {}
