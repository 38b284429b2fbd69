"""The wrapper engine: one :class:`Experiment` per installed target.

Data flows one way: call -> sampler -> legacy (returned to the caller), then on sampled calls the
isolated upstream run -> comparator -> :class:`Observation` -> exporters. Everything after legacy (the
upstream side) runs inside :meth:`Experiment._upstream_side` and :meth:`Experiment._publish`, the two places
where failures are caught, counted and logged (at most once a minute per target and kind).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._pytree import tree_iter

from shadow.core import compiling, forks, trees
from shadow.core.budget import DEFAULT_DEADLINE, Budget
from shadow.core.compare import Comparison, compare, compare_exceptions, with_state
from shadow.core.deadline import Finished, run_within
from shadow.core.drill import Drill
from shadow.core.exporting import call_hook
from shadow.core.global_state import IMPORT_TIME_SETTINGS, TorchGlobals
from shadow.core.isolation import (
    ArgumentsChanged,
    Isolation,
    detach_tensors,
    find_modules,
    has_user_hooks,
    module_tensors,
    modules_in_call,
)
from shadow.core.noise import NoiseFloor
from shadow.core.observation import (
    DIVERGENT_OUTCOMES,
    LEGACY,
    OUTCOMES,
    SHARED_DIVERGENCE_REASONS,
    UPSTREAM,
    Evidence,
    Observation,
    Outcome,
    TargetStats,
    bounded,
    label_text,
)
from shadow.core.sampler import Gate, Sampler
from shadow.core.targets import Target, patch_origin
from shadow.core.tolerance import ToleranceSpec

log = logging.getLogger("shadow")

_LOG_INTERVAL_SECONDS = 60.0

#: Distinct signatures a target may have (each is a metric series); later ones count as "other".
MAX_SIGNATURES = 100
OTHER_SIGNATURE = "other"

#: Registered as the "upstream side" while legacy runs again for the noise floor: the calls it makes of wrapped
#: functions are nested calls, and they run legacy (only an experiment's own upstream run routes them upstream).
_LEGACY_AGAIN = object()

#: The signature of a call whose target's signature function raised, or that the budget did not classify.
UNCLASSIFIED_SIGNATURE = "unclassified"


class _NotClassified(Exception):
    """The budget is too deep in debt for a call to be classified."""


# Per thread: ``upstream_side``, the experiment whose upstream side this thread runs (upstream, comparison, oracle,
# exporters); ``in_legacy``, the experiment whose legacy it runs; ``publishing`` while it hands an observation to
# the exporters.
_local = threading.local()

# The upstream runs under way, by a key of their own: the threads alive when each began, and its experiment. Each
# run is on a daemon thread of its own (shadow.core.deadline), so a thread not among them that is a daemon (a thread
# is a daemon where the thread that made it is) was started by that run (the worker threads of DataParallel's
# parallel_apply): its calls belong to that run. The job's threads started meanwhile (the replicas of legacy's own
# parallel_apply on another thread) are not daemons: they stay the job's. (A dict's item assignment and ``del`` are
# atomic and call nothing: no lock, and no point where an interrupt could leave a run behind.)
_upstream_runs: dict[object, tuple[frozenset[int], Experiment]] = {}


@contextlib.contextmanager
def _upstream_run(experiment: Experiment) -> Iterator[None]:
    run, key = (frozenset(t.ident for t in threading.enumerate()), experiment), object()
    try:
        _upstream_runs[key] = run
        yield
    finally:
        del _upstream_runs[key]


def _upstream_side_of_this_thread() -> Experiment | None:
    """The experiment whose upstream side this thread is part of: running it, or started by its upstream run."""
    side = getattr(_local, "upstream_side", None)
    if side is not None or not _upstream_runs:
        return side
    if not threading.current_thread().daemon:
        return None
    ident = threading.get_ident()
    return next((experiment for alive, experiment in tuple(_upstream_runs.values()) if ident not in alive), None)


@dataclasses.dataclass(frozen=True)
class Run:
    """One side's run of a call: what it returned or raised, how long it took, the autocast state it ran under."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    autocast: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the upstream side of one sampled call needs, taken before legacy runs: the isolation (None for
    targets that are not isolated; it copies the arguments after legacy), the arguments of a target that is not
    isolated (the caller's own, with new leaves for those that require grad), the call's signature, the autocast
    state and torch settings legacy starts from, and whether the single-device oracle runs too."""

    isolation: Isolation | None
    args: tuple | None
    kwargs: dict | None
    signature: str
    autocast: str
    oracle: bool
    before: TorchGlobals
    aa: bool = False  # legacy runs a second time (the noise floor's A/A run)
    modules_loaded: int = dataclasses.field(default_factory=lambda: len(sys.modules))

    @property
    def isolation_runs(self) -> int:
        """Isolated runs after legacy: upstream's, then the oracle's and the A/A run's where they run."""
        return 1 + self.oracle + self.aa

    def upstream_arguments(self) -> tuple[tuple, dict]:
        """What upstream receives: the isolation's copies (once taken), or the arguments above."""
        return self.isolation.arguments(0) if self.isolation is not None else (self.args, self.kwargs)


Setters = tuple[Callable[[Gate], None], Callable[[Callable], None]]


def _make_wrapper(
    primary: Callable,
    arrive: Callable[..., Any],
    classify: Callable[[tuple, dict], tuple[str, bool]] | None = None,
) -> tuple[Callable, Setters]:
    """The function installed in legacy's place, and the setters that hand it a new gate and a new primary (the
    function whose result the caller gets: legacy, or upstream in a canary until a rollback).

    The unsampled path is ``next(gate, False)`` and the primary's call: nothing else runs there. With ``classify``
    (a coverage-guided target) every call is classified first (its signature counted), and the first calls of each
    signature go to ``arrive`` whatever the gate says.
    """
    gate = itertools.repeat(True, 0)

    if classify is None:

        def shadow_wrapper(*args: Any, **kwargs: Any) -> Any:
            if next(gate, False):
                return primary(*args, **kwargs)
            return arrive(args, kwargs)

    else:

        def shadow_wrapper(*args: Any, **kwargs: Any) -> Any:
            signature, first = classify(args, kwargs)
            if not first and next(gate, False):
                return primary(*args, **kwargs)
            return arrive(args, kwargs, signature, first)

    def set_gate(new_gate: Gate) -> None:
        nonlocal gate
        gate = new_gate

    def set_primary(new_primary: Callable) -> None:
        nonlocal primary
        primary = new_primary

    _look_like(shadow_wrapper, primary)
    return shadow_wrapper, (set_gate, set_primary)


def _look_like(wrapper: Callable, legacy: Callable) -> None:
    for name in ("__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, name, getattr(legacy, name))
    wrapper.__wrapped__ = legacy  # type: ignore[attr-defined]


_PLAIN_TORCH_FUNCTION = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)

#: torch's own TorchFunctionModes: they are part of the call's context, active for legacy and upstream alike.
_TORCHS_OWN_MODES = (DeviceContext,)  # torch.set_default_device, ``with torch.device(...)``


def _is_hooked_subclass(leaf: Any) -> bool:
    """A tensor subclass with its own __torch_function__ or __torch_dispatch__ (nn.Parameter has neither)."""
    cls = type(leaf)
    if cls is torch.Tensor or not isinstance(leaf, torch.Tensor):
        return False
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    return function not in _PLAIN_TORCH_FUNCTION or cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _user_code_would_see_the_shadow(args: tuple, kwargs: dict, modules: list[torch.nn.Module]) -> bool:
    """Whether a user's TorchFunctionMode or any TorchDispatchMode is active, or the call reaches a tensor
    subclass with its own hooks (an argument, or a parameter, buffer or tensor attribute of a module in the call).
    Their code would then see every operation of the shadow side, and upstream's calls would come back through
    them to the wrapper, so the comparison would not be faithful: such calls are skipped with reason "mode"
    (counted, never compared). torch's own modes (a default device) are part of the call: upstream runs under
    them too."""
    if torch._C._len_torch_dispatch_stack():
        return True
    if torch._C._len_torch_function_stack() and not all(
        isinstance(mode, _TORCHS_OWN_MODES) for mode in _get_current_function_mode_stack()
    ):
        return True
    return any(map(_is_hooked_subclass, tree_iter((args, kwargs)))) or any(
        map(_is_hooked_subclass, module_tensors(modules))
    )


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()


def _free_after_oom() -> None:
    with contextlib.suppress(Exception):
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.empty_cache()


def _current_device() -> str | None:
    """The accelerator's current device ("npu:1"), or None without an accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else f"{accelerator.type}:{torch.accelerator.current_device_index()}"


def _autocast_state() -> str:
    accelerator = torch.accelerator.current_accelerator()
    device_types = ["cpu"] + ([accelerator.type] if accelerator is not None else [])

    def state(device_type: str) -> str:
        if not torch.is_autocast_enabled(device_type):
            return "off"
        return "on/" + str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")

    return ", ".join(f"{t}={state(t)}" for t in device_types)


class Experiment:
    """One installed target: its wrapper, sampler, counts and exporters; on sampled calls, legacy against
    upstream."""

    def __init__(
        self,
        target: Target,
        sample_rate: float,
        tolerance: ToleranceSpec,
        exporters: Sequence[Any],
        seed: int | None,
        drill: Drill | None = None,
        oracle_rate: float | None = None,
        budget: float | None = None,
        pure_hooks: bool = False,
        first_per_signature: int = 0,
        aa_rate: float = 0.0,
        primary: str = LEGACY,
        deadline: float | None = DEFAULT_DEADLINE,
    ) -> None:
        self.target = target
        self.drill = drill
        # The user declares the forward/backward hooks of their modules free of side effects: calls that reach
        # such hooks are compared (the hooks run again on the upstream side) instead of skipped.
        self.pure_hooks = pure_hooks
        self.monitor: Any = None  # the Monitor that installed this experiment (set by it)
        # The overhead budget: the upstream side's time (upstream, comparison, oracle, exporters) and a guided
        # target's classifying may use at most this fraction of wall time over every 10 s window
        # (shadow.core.budget); sampled calls beyond it are skipped (reason "budget") without calling exporters,
        # and reported to them in bulk at the next publish or flush.
        self.budget = budget
        self._budget = Budget(budget) if budget is not None else None
        self._classify_budget = Budget(budget) if budget is not None else None  # (classifying's own share)
        self._classified = 0
        self._classify_seconds = 0.0  # (what the last timed call of the signature function took)
        # The deadline of one call's shadow side (seconds, None: none): past it the call is skipped (reason
        # "deadline"), its run abandoned on its own thread, and every later sampled call is skipped too.
        self.deadline = deadline
        self.deadline_passed = False
        self._skips_unreported: collections.Counter[str] = collections.Counter()
        # The single-device oracle: None is off; else every sampled call under autocast and this fraction of
        # the others (targets that describe a single-device call only).
        self.oracle_rate = oracle_rate if target.oracle is not None and target.isolate else None
        self._oracle_random = random.Random(f"{seed}/{target.name}/oracle" if seed is not None else None)
        # The noise floor: on this fraction of sampled calls legacy runs a second time, isolated as upstream is,
        # and the difference between its two results is the target's own nondeterminism, by signature and output
        # leaf, as a distribution (shadow.core.noise).
        self.aa_rate = aa_rate
        self._aa_random = random.Random(f"{seed}/{target.name}/aa" if seed is not None else None)
        # (of the current phase: started again at a rollback or a reset)
        self._noise = NoiseFloor()
        self.legacy = target.resolve_legacy()
        self.legacy_origin = patch_origin(self.legacy) or ""
        # The primary side's result is the caller's (legacy while shadowing; upstream in a canary), the other side
        # runs as the shadow, isolated. A rollback makes legacy the primary (never the other way round).
        if primary not in (LEGACY, UPSTREAM):
            raise ValueError(f"primary: expected {LEGACY!r} or {UPSTREAM!r}, got {primary!r}")
        self.primary = self.configured_primary = primary
        self.primary_fn, self.shadow_fn = (
            (self.legacy, target.upstream) if primary == LEGACY else (target.upstream, self.legacy)
        )
        self.rolled_back_by: str | None = None
        self.tolerance = tolerance if tolerance is not None else target.tolerance
        self.exporters = tuple(exporters)
        self._lock = threading.Lock()
        self._outcomes: collections.Counter[str] = collections.Counter()
        self._reasons: collections.Counter[str] = collections.Counter()
        self._shared: collections.Counter[str] = collections.Counter()
        self._oracle_runs = 0
        self._signatures: set[str] = set()
        self._signatures_over_cap = 0
        self._export_errors = 0
        self._settings_failures = 0
        self._last_logged: dict[str, float] = {}
        # Coverage guidance: the first calls of every signature are compared, later ones sampled at the rate.
        # It classifies every call (the signature function runs on each), so it needs a signature function.
        self.first_per_signature = first_per_signature if target.signature is not None else 0
        self._signature_calls: dict[str, int] = {}  # signature -> calls (guided targets: every call is counted)
        self._signature_calls_reported: dict[str, int] = {}
        self._labels: dict[Any, str] = {}  # what the signature function returned -> the admitted label
        classify = self._classify if self.first_per_signature else None
        self.wrapper, (set_gate, self._set_primary) = _make_wrapper(self.primary_fn, self._arrive, classify)
        self.wrapper.__npu_shadow__ = self  # type: ignore[attr-defined]
        self.sampler = Sampler(sample_rate, seed, target.name, set_gate)
        self._calls_reported = 0
        for exporter in self.exporters:
            self._call_exporter(exporter, "register", target.name, sample_rate)
            self._call_exporter(exporter, "set_primary", target.name, self.primary)
        # Compiled code traces the primary of the moment it compiles (a rollback re-routes graphs compiled later).
        self._traced = [self.primary_fn]
        traced = self._traced

        def primary_of_the_moment(*args: Any, **kwargs: Any) -> Any:
            return traced[0](*args, **kwargs)

        compiling.trace_as_legacy(self.wrapper, primary_of_the_moment)
        forks.register(self)

    # ------------------------------------------------------------------ the call

    def _classify(self, args: tuple, kwargs: dict) -> tuple[str, bool]:
        """A guided target's call: its signature, counted, and whether it is one of the first of its signature
        (to be compared whatever the gate says). A signature function that fails classifies as "unclassified"."""
        budget = self._classify_budget
        try:
            if budget is not None and not budget.allows():
                raise _NotClassified  # (classifying alone has used the budget)
            # (one call in 16 is timed, the first among them; every call is charged what the last timed one took:
            # the budget sees the signature function without a clock read on every call)
            self._classified += 1
            timed = budget is not None and self._classified & 15 == 1
            start = time.perf_counter() if timed else 0.0
            with torch._C.DisableTorchFunction():  # (a user's mode or tensor subclass never sees the classifying)
                raw = self.target.signature(args, kwargs)
            label = self._labels.get(raw)
            if label is None:
                label = self._admit(label_text(str(raw), 64))
                if len(self._labels) < 4 * MAX_SIGNATURES:
                    self._labels[raw] = label
            if timed:
                self._classify_seconds = time.perf_counter() - start
            if budget is not None:
                budget.charge(self._classify_seconds)
                self._charge(self._classify_seconds)
        except KeyboardInterrupt:
            raise
        except BaseException:  # the user's signature function: its failure is counted, never the job's
            label = UNCLASSIFIED_SIGNATURE
        with self._lock:
            count = self._signature_calls[label] = self._signature_calls.get(label, 0) + 1
        return label, count <= self.first_per_signature

    def _arrive(self, args: tuple, kwargs: dict, signature: str | None = None, first: bool = False) -> Any:
        """A call found the gate closed (maybe the sampled one), or is one of the first of its signature
        (``first``: compared). ``signature``: a guided target's call, already counted under it."""
        side = _upstream_side_of_this_thread()
        publishing = getattr(_local, "publishing", False)
        if side is not None or publishing or getattr(_local, "in_legacy", None) is self:
            # A nested call, part of a call already counted: made by legacy itself (through a mode, a subclass
            # or recursion), by an upstream side (upstream, the oracle, the comparison) on its own thread or on a
            # thread its upstream run started (DataParallel's workers), or by an exporter. Not a call of the
            # job's: not counted, not compared. One rule on every thread: an upstream side's calls of its own
            # target run upstream (upstream calling itself); every other nested call runs
            # legacy, the world the job has today. So a comparison sees only its own target's difference, and
            # another target's difference is compared, counted and reported by that target, on the calls the job's
            # legacy run makes.
            with self._lock:
                if signature is not None:
                    self._signature_calls[signature] -= 1
                if not first:
                    self.sampler.arrive()
                    self.sampler.uncount()
            return (self.shadow_fn if side is self and not publishing else self.primary_fn)(*args, **kwargs)
        if not first:
            with self._lock:
                sampled = self.sampler.arrive()
            if not sampled:
                return self.primary_fn(*args, **kwargs)
        passed = "deadline" if self.deadline_passed else None
        if passed is None and self._budget is not None and not self._budget.allows():
            passed = "budget"
        if passed is not None:
            with self._lock:  # nothing but counting: until the job's time catches up, or for good
                self._outcomes[Outcome.SKIPPED.value] += 1
                self._reasons[passed] += 1
                self._skips_unreported[passed] += 1
            return self._run_legacy(args, kwargs)
        modules = modules_in_call(args, kwargs)
        skip = self._skip_reason(args, kwargs, modules)
        if skip is not None:
            start = time.perf_counter()
            skipped = Observation(
                self.target.name, Outcome.SKIPPED, (skip,), signature=signature or "", timestamp=time.time(),
                primary=self.primary,
            )  # fmt: skip
            self._publish(skipped)
            self._charge(time.perf_counter() - start)
            return self._run_legacy(args, kwargs)
        return self._sampled_call(args, kwargs, modules, signature)

    def _run_legacy(self, args: tuple, kwargs: dict) -> Any:
        """Legacy, marked as running on this thread: its own nested calls of the wrapper are not new calls."""
        outer = getattr(_local, "in_legacy", None)
        try:
            _local.in_legacy = self
            return self.primary_fn(*args, **kwargs)
        finally:
            _local.in_legacy = outer

    def _skip_reason(self, args: tuple, kwargs: dict, modules: list[torch.nn.Module]) -> str | None:
        """Why this sampled call cannot be compared faithfully, or None: the upstream side would be visible to
        code the job runs (a user's mode, a tensor subclass, a user's module hooks) or is being compiled."""
        if torch.compiler.is_compiling():
            return "compiling"
        if _user_code_would_see_the_shadow(args, kwargs, modules):
            return "mode"
        if not self.pure_hooks and has_user_hooks(modules):
            return "hooks"
        return None

    def _sampled_call(
        self, args: tuple, kwargs: dict, modules: list[torch.nn.Module], signature: str | None = None
    ) -> Any:
        """Plan the upstream run, run legacy (its result or exception is the caller's), then the upstream side."""
        plan = self._plan(args, kwargs, modules, signature)
        start = time.perf_counter()
        try:
            result = self._run_legacy(args, kwargs)
        except Exception as exc:
            self._upstream_side(plan, args, kwargs, Run(error=exc, seconds=time.perf_counter() - start))
            raise
        self._upstream_side(plan, args, kwargs, Run(value=result, seconds=time.perf_counter() - start))
        return result

    # ------------------------------------------------------------------ the upstream side

    def _plan(
        self, args: tuple, kwargs: dict, modules: list[torch.nn.Module], signature: str | None = None
    ) -> Plan | BaseException:
        """What the upstream run (and the oracle's) needs, taken before legacy runs; an exception if that failed."""
        try:
            before = TorchGlobals()
            autocast = _autocast_state()
            oracle = self.oracle_rate is not None and (
                "=on/" in autocast or self._oracle_random.random() < self.oracle_rate
            )
            aa = self.aa_rate > 0 and self._aa_random.random() < self.aa_rate
            if self.target.isolate:
                isolation = Isolation(args, kwargs, modules, runs=1 + oracle + aa)
                up_args, up_kwargs = None, None
            else:
                isolation, (up_args, up_kwargs) = None, detach_tensors((args, kwargs))
            if signature is None:  # (a guided target's call comes classified)
                raw = self.target.signature(args, kwargs) if self.target.signature else "call"
                signature = self._admit(label_text(str(raw), 64))
            return Plan(isolation, up_args, up_kwargs, signature, autocast, oracle, before, aa)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            return exc

    def _admit(self, signature: str) -> str:
        """The signature itself while the target has fewer than MAX_SIGNATURES, else "other" (counted, logged)."""
        if signature in self._signatures:
            return signature
        with self._lock:
            if len(self._signatures) < MAX_SIGNATURES:
                self._signatures.add(signature)
                return signature
            self._signatures_over_cap += 1
        self._log_limited(
            "signatures", "more than %d signatures; the rest count as %r", MAX_SIGNATURES, OTHER_SIGNATURE
        )
        return OTHER_SIGNATURE

    def _upstream_side(self, plan: Plan | BaseException, args: tuple, kwargs: dict, legacy: Run) -> None:
        """Everything after legacy: observe, publish. Whatever it does to torch's global state is undone, and
        whatever it raises is this tool's fault: counted as a "comparator" skip, never the caller's problem."""
        # Calls of wrapped functions from here on (upstream's, the oracle's, exporters') are not compared again.
        # (set inside the try, put back first thing in its finally: no interrupt, wherever it lands, leaves this
        # thread marked, and the caller's later calls on upstream)
        outer = getattr(_local, "upstream_side", None)
        started = time.perf_counter()
        try:
            _local.upstream_side = self
            left_by_legacy = TorchGlobals()  # the upstream side's changes never reach the job
            try:
                try:
                    observation = self._observe(plan, args, kwargs, legacy, left_by_legacy)
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # SystemExit too
                    self._log_limited("comparator", "upstream side failed: %r", exc)
                    observation = Observation(
                        self.target.name, Outcome.SKIPPED, ("comparator",), detail=bounded(repr(exc)), signature="",
                        primary=self.primary,
                    )  # fmt: skip
                self._publish(observation)
            finally:
                self._put_back(left_by_legacy)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # taking torch's settings failed: ours to count, not the job's
            self._settings_failed(exc)
        finally:
            _local.upstream_side = outer
            self._charge(time.perf_counter() - started)

    def _charge(self, seconds: float) -> None:
        if self._budget is not None:
            self._budget.charge(seconds)

    def _within_deadline(self, side: object, before: TorchGlobals, body: Callable[[], Any]) -> Finished:
        """``body()`` (a run of the shadow side, as ``side``'s upstream side, from the settings ``before``, which
        this thread has written already): on a daemon thread of its own, waited for at most the deadline
        (:mod:`shadow.core.deadline`; without one, until it ends). Past the deadline the run is abandoned and the
        target stops shadowing (counted, logged). An interrupt the body raised is raised here, as it would be on the
        caller's thread."""

        def start() -> None:
            _local.upstream_side = side
            self._put_back(before)  # (on the new thread: its thread-local settings the caller's)

        found = run_within(self.deadline, body, start=start)
        if isinstance(found.error, KeyboardInterrupt):
            raise found.error
        if not found.finished and not self.deadline_passed:
            self.deadline_passed = True
            log.warning(
                "npu-shadow [%s]: the shadow side of a call took longer than its deadline (%g s): the job went on "
                "with the primary's result, and this target shadows no more (its run is left to end alone)",
                self.target.name, self.deadline,
            )  # fmt: skip
        return found

    def _observe(
        self, plan: Plan | BaseException, args: tuple, kwargs: dict, legacy: Run, left_by_legacy: TorchGlobals
    ) -> Observation:
        """Run upstream the way legacy ran and compare the two runs: their results (or exceptions) and the torch
        settings each left behind."""
        now = time.time()
        if isinstance(plan, BaseException):
            return self._skipped(plan, timestamp=now)
        cannot = self._cannot_run_upstream(plan, legacy, now)
        if cannot is not None:
            return cannot
        upstream, drilled, left_by_upstream = self._run_upstream(plan, left_by_legacy)
        if upstream is None:
            return Observation(
                self.target.name, Outcome.SKIPPED, ("deadline",), signature=plan.signature, timestamp=now,
                primary=self.primary, detail=f"the shadow side took longer than its deadline ({self.deadline:g} s)",
            )  # fmt: skip
        common = {
            "target": self.target.name,
            "primary": self.primary,
            "legacy": self.legacy_origin,
            "signature": plan.signature,
            "legacy_seconds": legacy.seconds,
            "upstream_seconds": upstream.seconds,
            "drill": drilled,
            "timestamp": now,
        }
        if upstream.error is not None and legacy.error is None and _is_oom(upstream.error):
            del upstream  # its error's traceback holds upstream's tensors
            _free_after_oom()
            return Observation(outcome=Outcome.SKIPPED, reasons=("oom",), **common)
        returned = legacy.error is None and upstream.error is None
        # (``legacy`` and ``left_by_legacy`` are the primary's run; in a canary that is upstream's)
        runs, left = (legacy, upstream), (left_by_legacy, left_by_upstream)
        if self.primary == UPSTREAM:
            runs, left = runs[::-1], left[::-1]
        aa = self._aa_run(plan, runs[0], left_by_legacy) if plan.aa and returned else {}
        start = time.perf_counter()
        found = self._compare_runs(plan, args, kwargs, *runs)
        found = with_state(found, self._state_differences(plan, *left))
        found, noise_test = self._within_noise(plan.signature, found)
        compare_seconds = time.perf_counter() - start
        shared = {}
        if plan.oracle and returned and found.outcome in (Outcome.MATCH, Outcome.CLOSE):
            shared = self._single_device(plan, legacy.value, left_by_legacy)
        evidence = None
        if found.outcome in DIVERGENT_OUTCOMES:
            evidence = self._evidence(plan, *runs)
        return Observation(
            outcome=found.outcome,
            reasons=found.reasons,
            max_abs_error=found.max_abs_error,
            max_rel_error=found.max_rel_error,
            mismatched=found.mismatched,
            numel=found.numel,
            compare_seconds=compare_seconds,
            detail=found.detail,
            noise_test=noise_test,
            evidence=evidence,
            **shared,
            **aa,
            **common,
        )

    def _aa_run(self, plan: Plan, legacy: Run, left_by_legacy: TorchGlobals) -> dict[str, Any]:
        """Legacy once more (legacy, whatever the primary: the noise floor is the reference's own variation), from
        the same start and as isolated as the shadow run, compared with legacy's result (``legacy``): the
        Observation fields of the A/A run, its errors added to the noise floor."""
        start = time.perf_counter()
        try:
            if plan.isolation is not None:
                args, kwargs = plan.isolation.arguments(plan.isolation_runs - 1)
                context = plan.isolation.upstream_run(plan.isolation_runs - 1)
            else:
                args, kwargs = plan.upstream_arguments()
                context = contextlib.nullcontext()
            self._put_back(plan.before)
            try:
                # (a run of its own: the calls legacy makes of wrapped functions are nested calls, never upstream's)
                with context, _upstream_run(_LEGACY_AGAIN):
                    ran = self._within_deadline(_LEGACY_AGAIN, plan.before, lambda: self.legacy(*args, **kwargs))
                if not ran.finished:
                    return {"aa_seconds": time.perf_counter() - start}
                if ran.error is not None:
                    raise ran.error
                again = ran.value
            finally:
                self._put_back(left_by_legacy)
            found = compare(legacy.value, again, tolerance=self.tolerance, exact=True)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # legacy raising the second time is noise of a kind we do not measure
            self._log_limited("aa", "A/A run failed: %r", exc)
            return {"aa_seconds": time.perf_counter() - start}
        differs = found.outcome != Outcome.MATCH
        abs_error = found.max_abs_error if differs else 0.0
        rel_error = found.max_rel_error if differs else 0.0
        self._noise.add_aa(plan.signature, found.leaf_errors, rel_error, differs)
        seconds = time.perf_counter() - start
        return {"aa": True, "aa_abs_error": abs_error, "aa_rel_error": rel_error, "aa_seconds": seconds}

    def _within_noise(self, signature: str, found: Comparison) -> tuple[Comparison, str]:
        """(the comparison, the noise test as text): a value mismatch (nothing else) is reported as noise while
        the noise floor says legacy differs from itself as much (:mod:`shadow.core.noise`). Anything beyond it, or
        of another kind, stays a mismatch. Every value comparison's errors join the A/B sample."""
        if not self.aa_rate:  # (no A/A runs: no floor, nothing is noise, and no sample is kept)
            return found, ""
        if found.outcome in (Outcome.MATCH, Outcome.CLOSE) or set(found.reasons) == {"value"}:
            self._noise.add_ab(signature, found.leaf_errors)
        if found.outcome != Outcome.MISMATCH or set(found.reasons) != {"value"}:
            return found, ""
        noise, test = self._noise.judge(signature, found.leaf_errors)
        if not noise:
            return found, test
        detail = bounded(f"within the noise floor ({test}): {found.detail}")
        return dataclasses.replace(found, outcome=Outcome.NOISE, reasons=(), detail=detail), test

    def roll_back(self, by: str) -> bool:
        """Make legacy the primary from the next call on (upstream runs as the shadow): the rollback switch. Only
        toward legacy; True when this changed anything. Exporters hear of it (``record_rollback``); the noise
        floor starts again (the other phase's errors are not this one's)."""
        self.report_calls()  # (the calls so far are the phase's that ends)
        with self._lock:
            if self.primary == LEGACY:
                return False
            self._noise = NoiseFloor()
            self.primary, self.primary_fn, self.shadow_fn = LEGACY, self.legacy, self.target.upstream
            self.rolled_back_by = by
            self._set_primary(self.legacy)
            self._traced[0] = self.legacy
        for exporter in self.exporters:
            self._call_exporter(exporter, "set_primary", self.target.name, LEGACY)
            self._call_exporter(exporter, "record_rollback", self.target.name, by)
        log.warning("npu-shadow [%s]: rolled back to legacy by %s", self.target.name, by)
        return True

    def reset_primary(self, by: str) -> bool:
        """A person's reset after a rollback: the primary configured at install again. True when it changed."""
        self.report_calls()
        with self._lock:
            if self.primary == self.configured_primary:
                return False
            self._noise = NoiseFloor()
            self.primary = self.configured_primary
            self.primary_fn, self.shadow_fn = self.target.upstream, self.legacy
            self.rolled_back_by = None
            self._set_primary(self.primary_fn)
            self._traced[0] = self.primary_fn
        for exporter in self.exporters:
            self._call_exporter(exporter, "set_primary", self.target.name, self.primary)
            self._call_exporter(exporter, "record_reset", self.target.name, by)
        log.warning("npu-shadow [%s]: primary reset to %s by %s", self.target.name, self.primary, by)
        return True

    def noise_floor(self) -> dict[str, tuple[float, float, int, int]]:
        """{signature: (greatest abs difference, greatest rel difference, A/A runs, runs that differed)} of the
        current phase's A/A runs."""
        with self._lock:
            return {s: (f[0], f[1], int(f[2]), int(f[3])) for s, f in self._noise.summary.items()}

    def _cannot_run_upstream(self, plan: Plan, legacy: Run, now: float) -> Observation | None:
        """The skip observation of a call whose upstream run would not be faithful, seen once legacy ran: legacy
        returned a tensor subclass with hooks (comparing it would run its code), wrote an argument in place, or the
        argument copies would not fit. None when upstream can run (the isolation's copies are then taken)."""
        if legacy.error is None and any(map(_is_hooked_subclass, tree_iter(legacy.value))):
            return Observation(
                self.target.name, Outcome.SKIPPED, ("mode",), signature=plan.signature, timestamp=now,
                primary=self.primary,
            )  # fmt: skip
        if plan.isolation is None:
            return None
        try:
            plan.isolation.take_arguments()
        except ArgumentsChanged as exc:
            return Observation(
                self.target.name, Outcome.SKIPPED, ("inplace",), signature=plan.signature, detail=str(exc),
                timestamp=now, primary=self.primary,
            )  # fmt: skip
        except MemoryError as exc:
            return self._skipped(exc, timestamp=now)
        return None

    def _compare_runs(self, plan: Plan, args: tuple, kwargs: dict, legacy: Run, upstream: Run) -> Comparison:
        """Legacy's result against upstream's (with both runs' autocast state where they mismatch), or the one rule
        for exceptions where either raised."""
        if legacy.error is not None or upstream.error is not None:
            return compare_exceptions(legacy.error, upstream.error)
        found = compare(
            legacy.value,
            upstream.value,
            tolerance=self.tolerance,
            exact=self.target.exact,
            legacy_inputs=(args, kwargs),
            upstream_inputs=plan.upstream_arguments(),
        )
        if found.outcome == Outcome.MISMATCH:
            autocast = f"autocast legacy: {plan.autocast}; upstream: {upstream.autocast}"
            found = dataclasses.replace(found, detail=bounded(f"{found.detail} | {autocast}"))
        return found

    def _put_back(self, settings: TorchGlobals) -> None:
        """Write back a snapshot of the global settings; whatever cannot be is counted and logged, never raised
        (each setting is written on its own, so the others still are)."""
        try:
            settings.restore()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self._settings_failed(exc)

    def _settings_failed(self, failure: BaseException) -> None:
        with self._lock:
            self._settings_failures += 1
        self._log_limited("settings", "global settings could not be taken or put back: %r", failure)

    def _skipped(self, failure: BaseException, timestamp: float) -> Observation:
        """The observation of a call whose plan failed: out of memory, or a fault of this tool."""
        reason = "oom" if _is_oom(failure) else "comparator"
        if reason == "oom":
            _free_after_oom()
        return Observation(
            self.target.name, Outcome.SKIPPED, (reason,), detail=bounded(repr(failure)), timestamp=timestamp,
            signature="", primary=self.primary,
        )  # fmt: skip

    @staticmethod
    def _state_differences(plan: Plan, first: TorchGlobals, second: TorchGlobals) -> dict[str, tuple[Any, Any]]:
        """The settings the two runs left differently, less those a module's first import writes (warning
        filters) where the first run imported modules: the second, started from the state before it, finds them
        imported and cannot write them again."""
        found = first.differences(second)
        if len(sys.modules) != plan.modules_loaded:
            for name in IMPORT_TIME_SETTINGS:
                found.pop(name, None)
        return found

    def _run_upstream(self, plan: Plan, left_by_legacy: TorchGlobals) -> tuple[Run | None, bool, TorchGlobals]:
        """Upstream on the plan's arguments, from the torch settings the caller had before the call (legacy's
        start), in the caller's grad mode, isolated where the target asks for it; whether a fire drill corrupted
        it; and the torch settings it left behind (legacy's are put back before this returns). The run is None
        where it passed its deadline."""
        context = plan.isolation.upstream_run() if plan.isolation is not None else contextlib.nullcontext()
        drill = self.drill if self.drill is not None and self.drill.fires() else None
        drilled = False
        autocast = ""
        self._put_back(plan.before)
        shadow_fn = self.shadow_fn

        left: TorchGlobals | None = None

        def body() -> Any:
            nonlocal autocast, drilled, left
            try:
                autocast = _autocast_state()
                if drill is not None and drill.kind == "exception":
                    drilled = True
                    drill.before_upstream()
                args, kwargs = plan.upstream_arguments()
                value = shadow_fn(*args, **kwargs)
                if drill is not None and drill.kind != "exception":
                    value, drilled = drill.corrupt(value, (args, kwargs))
                return value
            finally:
                left = TorchGlobals()  # (on the thread that ran it: its thread-local settings too)

        start = time.perf_counter()
        finished = Finished(False)
        try:
            with context, _upstream_run(self):
                finished = self._within_deadline(self, plan.before, body)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the isolation's own failure: the run's outcome, never the caller's
            finished = Finished(True, error=exc)
        seconds = time.perf_counter() - start
        left_by_upstream = left if left is not None and finished.finished else TorchGlobals()
        self._put_back(left_by_legacy)
        if not finished.finished:
            return None, drilled, left_by_upstream
        # (SystemExit, GeneratorExit: upstream's outcome, never the caller's)
        return Run(finished.value, finished.error, seconds, autocast), drilled, left_by_upstream

    def _evidence(self, plan: Plan, legacy: Run, upstream: Run) -> Evidence:
        """What a repro capture needs: the inputs as upstream received them, both outputs, the module state."""
        args, kwargs = plan.upstream_arguments()
        modules = find_modules((args, kwargs))
        with torch._C.DisableTorchFunction():  # (no subclass sees the detach)
            upstream_value = trees.map_only(torch.Tensor, torch.Tensor.detach, upstream.value)
        try:
            module_state = modules[0].state_dict() if modules else None
        except Exception as exc:  # the user's state_dict: its failure loses the state, never the observation
            self._log_limited("state_dict", "module state for the capture failed: %r", exc)
            module_state = None
        return Evidence(
            args,
            kwargs,
            legacy=legacy.error or legacy.value,
            # (detached: the evidence never keeps upstream's autograd graph alive)
            upstream=upstream.error or upstream_value,
            module_state=module_state,
            legacy_fn=self.legacy,
            upstream_fn=self.target.upstream,
            exact=self.target.exact,
            device=_current_device(),
        )

    def _single_device(self, plan: Plan, legacy_result: Any, left_by_legacy: TorchGlobals) -> dict[str, Any]:
        """Run the call's replica 0 on its own device, isolated and from the same settings as the upstream run,
        and compare legacy's replica-0 output with it: the Observation fields of a shared divergence (none if
        they agree)."""
        start = time.perf_counter()
        try:
            args, kwargs = plan.isolation.arguments(1)
            self._put_back(plan.before)
            try:
                with plan.isolation.upstream_run(1):
                    call = self.target.oracle(args, kwargs)
                    if call is None:
                        return {}
                    ran = self._within_deadline(self, plan.before, call.run)
                    if not ran.finished:
                        return {"oracle_seconds": time.perf_counter() - start}
                    if ran.error is not None:
                        raise ran.error
                    single = ran.value
            finally:
                self._put_back(left_by_legacy)
            with self._lock:
                self._oracle_runs += 1
            found = compare(call.legacy_part(legacy_result, single), single, tolerance=self.tolerance)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the oracle is ours: its failure loses only the oracle's finding
            self._log_limited("oracle", "single-device oracle failed: %r", exc)
            return {"oracle_seconds": time.perf_counter() - start}
        seconds = time.perf_counter() - start
        if found.outcome != Outcome.MISMATCH:
            return {"oracle_seconds": seconds}
        reason = next((r for r in found.reasons if r in SHARED_DIVERGENCE_REASONS), "value")
        return {
            "shared_divergence": reason,
            "shared_detail": bounded(f"legacy and upstream agree; replica 0 alone on its device: {found.detail}"),
            "oracle_seconds": seconds,
        }

    def _publish(self, observation: Observation) -> None:
        with self._lock:
            self._outcomes[observation.outcome] += 1
            self._reasons.update(observation.reasons)
            if observation.shared_divergence:
                self._shared[observation.shared_divergence] += 1
        publishing = getattr(_local, "publishing", False)
        try:
            _local.publishing = True
            self.report_calls()
            failed = [e for e in self.exporters if not self._call_exporter(e, "export", observation)]
            if failed:
                with self._lock:
                    self._export_errors += len(failed)
                for exporter in self.exporters:
                    for _ in failed:
                        self._call_exporter(exporter, "record_export_error", self.target.name)
        finally:
            _local.publishing = publishing

    def report_calls(self) -> None:
        """Tell exporters how many calls passed (by signature for a guided target), and how many sampled calls
        the budget skipped, since the last report (done at each publish and at flush)."""
        with self._lock:
            if self.first_per_signature:
                deltas = {
                    signature: calls - self._signature_calls_reported.get(signature, 0)
                    for signature, calls in self._signature_calls.items()
                }
                self._signature_calls_reported = dict(self._signature_calls)
            else:
                calls = self.sampler.calls()
                deltas = {"": calls - self._calls_reported}
                self._calls_reported = calls
            skipped, self._skips_unreported = self._skips_unreported, collections.Counter()
        for signature, delta in deltas.items():
            if delta:
                for exporter in self.exporters:
                    self._call_exporter(exporter, "record_calls", self.target.name, delta, signature)
        for reason, count in skipped.items():
            for exporter in self.exporters:
                self._call_exporter(exporter, "record_skips", self.target.name, reason, count)

    def _call_exporter(self, exporter: Any, hook: str, *args: Any) -> bool:
        """Call an exporter hook if it has it; False if it raised (logged at most once a minute)."""
        failure = call_hook(exporter, hook, *args)
        if failure is not None:
            self._log_limited(f"{hook}:{id(exporter)}", "exporter %r failed in %s: %r", exporter, hook, failure)
        return failure is None

    def _log_limited(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last_logged.get(kind)
        if last is None or now - last >= _LOG_INTERVAL_SECONDS:
            self._last_logged[kind] = now
            log.warning("npu-shadow [%s]: " + message, self.target.name, *args)

    # ------------------------------------------------------------------ bookkeeping

    def stats(self) -> TargetStats:
        """A consistent snapshot of this target's counts."""
        with self._lock:
            outcomes = dict(self._outcomes)
            return TargetStats(
                calls=sum(self._signature_calls.values()) if self.first_per_signature else self.sampler.calls(),
                signature_calls=dict(self._signature_calls),
                primary=self.primary,
                rolled_back_by=self.rolled_back_by or "",
                sampled=sum(outcomes.values()),
                **{outcome: outcomes.get(outcome, 0) for outcome in OUTCOMES},
                by_reason=dict(self._reasons),
                shared_divergences=dict(self._shared),
                oracle_runs=self._oracle_runs,
                signatures_over_cap=self._signatures_over_cap,
                export_errors=self._export_errors,
                settings_failures=self._settings_failures,
            )

    def _after_fork_in_child(self) -> None:
        # The parent's lock may have been held by another thread at fork time, and the parent's counts
        # belong to the parent: the child starts clean.
        self._lock = threading.Lock()
        self._outcomes.clear()
        self._reasons.clear()
        self._shared.clear()
        self._oracle_runs = 0
        self._export_errors = 0
        self._settings_failures = 0
        self._skips_unreported.clear()
        self._noise = NoiseFloor()
        self._budget = Budget(self.budget) if self.budget is not None else None
        self._classify_budget = Budget(self.budget) if self.budget is not None else None
        self._calls_reported = 0
        self._signature_calls.clear()
        self._signature_calls_reported.clear()


def experiment_of(obj: Any) -> Experiment | None:
    """The Experiment behind an installed wrapper, if ``obj`` is one."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return getattr(obj, "__npu_shadow__", None)
