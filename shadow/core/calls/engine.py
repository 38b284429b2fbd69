"""The wrapper engine: one :class:`Experiment` per installed target.

Data flows one way: call -> sampler -> legacy (returned to the caller), then on sampled calls the upstream side
(:class:`shadow.core.calls.upstream_side.UpstreamSide`, a room of its own per sampled call: the isolated upstream run,
the comparator) -> :class:`Observation` -> exporters. The experiment keeps the call path, the sampler and its
gate, and the primary; what it counted is its :class:`~shadow.core.calls.tally.Tally`, its random draws are
:class:`~shadow.core.calls.coin.Coin` s, its exporters the monitor's :class:`~shadow.core.calls.publisher.Publisher`,
its
settings the monitor's :class:`~shadow.core.calls.settings.Settings`. Whatever runs after legacy is caught in
:meth:`Experiment._upstream_side`, and every exporter hook is called through the publisher: failures there are
counted and logged (at most once a minute per target, or exporter, and kind), never the job's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from shadow.core.calls import clusters
from shadow.core.calls.budget import Budgets
from shadow.core.calls.classifier import Classifier
from shadow.core.calls.coin import Coin
from shadow.core.calls.coverage import CLASSIFY_ONE_IN, Coverage
from shadow.core.calls.held import HeldDifferences
from shadow.core.calls.plan import Run, is_hooked_subclass
from shadow.core.calls.publisher import Publisher
from shadow.core.calls.sampler import Gate, Sampler
from shadow.core.calls.settings import Settings
from shadow.core.calls.tally import Tally
from shadow.core.calls.upstream_side import UpstreamSide
from shadow.core.judging.noise import NoiseFloor
from shadow.core.model.observation import (
    LEGACY,
    OUTCOMES,
    UNCLASSIFIED_SIGNATURE,
    Observation,
    Outcome,
    TargetStats,
    bounded,
    within_noise_floor,
)
from shadow.core.model.targets import Target, patch_origin
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.isolation import (
    has_user_hooks,
    module_tensors,
    modules_in_call,
)
from shadow.core.runs.sides import marks, upstream_side_of_this_thread
from shadow.core.support import compiling, forks, trees
from shadow.core.support.memory import InsufficientMemory

log = logging.getLogger("shadow")

_LOG_INTERVAL_SECONDS = 60.0


Setters = tuple[Callable[[Gate], None], Callable[[Callable], None]]

#: The gate of a wrapper whose every call arrives (a guided target classifying every call).
_CLOSED: Gate = itertools.repeat(True, 0)


class _Held:
    """The upstream sides under way in this process, and the experiments whose gates they close.

    A call that passes an open gate is counted as the job's without a look at which thread makes it: that is what
    makes the unsampled path one C call. While an upstream side is under way, its runs make calls of wrapped
    functions that are not the job's (upstream's own casts, a backward comparison's on the autograd threads), so
    every experiment's gate is closed meanwhile and each call arrives, where a nested one is told apart and not
    counted; a call of the job's on another thread then takes its place in the sampler's gate, as it would have."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._experiments: weakref.WeakSet[Experiment] = weakref.WeakSet()
        forks.register(self)

    def add(self, experiment: Experiment) -> None:
        with self._lock:
            self._experiments.add(experiment)

    def hold(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == 1:
                for experiment in self._experiments:
                    experiment._refresh_gate()

    def release(self) -> None:
        with self._lock:
            self.count -= 1
            if self.count == 0:
                for experiment in self._experiments:
                    experiment._refresh_gate()

    def _after_fork_in_child(self) -> None:  # (the parent's upstream sides are not under way in the child)
        self._lock = threading.Lock()
        self.count = 0


_HELD = _Held()


@dataclasses.dataclass(frozen=True)
class _Admission:
    """What becomes of a sampled call (:meth:`Experiment._admit`): skipped in bulk for ``skip`` (a reason), or
    compared (``signature``: a guided target's; ``held``: what the budget lent it, given back once its real cost
    is charged)."""

    skip: str = ""
    signature: str | None = None
    held: float | None = None


#: The functions whose shadow-side run passed its deadline in this process, by id (kept alive here): a run left to
#: itself may hang for good, and a later install over the same function does not start another one beside it.
_ABANDONED: dict[int, Callable] = {}


def _make_wrapper(
    primary: Callable,
    arrive: Callable[[tuple, dict], Any],
    novel: Callable[[tuple, dict], Any] | None = None,
    key: Callable[[tuple, dict], Any] | None = None,
    known: set | None = None,
) -> tuple[Callable, Setters]:
    """The function installed in legacy's place, and the setters that hand it a new gate and a new primary (the
    function whose result the caller gets: legacy, or upstream in a canary until a rollback).

    The unsampled path is ``next(gate, False)`` and the primary's call: nothing else runs there. A call that finds
    the gate closed goes to ``arrive``: the sampled call, or (a guided target) a call to classify. With a signature
    ``key`` (:attr:`Target.signature_key`), only a call whose key is ``known`` (its signature had its first calls)
    takes the gate; every other call is ``novel``: classified and counted on its own, so a signature is compared on
    its first calls whenever it first appears.
    """
    gate = _CLOSED

    def shadow_wrapper(*args: Any, **kwargs: Any) -> Any:
        if next(gate, False):
            return primary(*args, **kwargs)
        return arrive(args, kwargs)

    def keyed_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            seen = key(args, kwargs) in known  # type: ignore[misc, operator]
        except Exception:  # (a key function's failure, or an unhashable key: the call is classified)
            seen = False
        if seen:
            if next(gate, False):
                return primary(*args, **kwargs)
            return arrive(args, kwargs)
        return novel(args, kwargs)  # type: ignore[misc]

    def set_gate(new_gate: Gate) -> None:
        nonlocal gate
        gate = new_gate

    def set_primary(new_primary: Callable) -> None:
        nonlocal primary
        primary = new_primary

    wrapper = shadow_wrapper if key is None else keyed_wrapper
    _look_like(wrapper, primary)
    return wrapper, (set_gate, set_primary)


def _look_like(wrapper: Callable, legacy: Callable) -> None:
    for name in ("__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, name, getattr(legacy, name))
    wrapper.__wrapped__ = legacy  # type: ignore[attr-defined]


#: torch's own TorchFunctionModes: they are part of the call's context, active for legacy and upstream alike.
_TORCHS_OWN_MODES = (DeviceContext,)  # torch.set_default_device, ``with torch.device(...)``


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
    return any(map(is_hooked_subclass, trees.leaves((args, kwargs)))) or any(
        map(is_hooked_subclass, module_tensors(modules))
    )


class Experiment:
    """One installed target: its wrapper, sampler, counts and exporters; on sampled calls, legacy against
    upstream."""

    def __init__(
        self,
        target: Target,
        sample_rate: float,
        tolerance: ToleranceSpec,
        publisher: Publisher,
        settings: Settings,
        budget: Budgets | None = None,
    ) -> None:
        """Args:
        target: what is shadowed.
        sample_rate: the fraction of its calls compared.
        tolerance: its tolerance (None: the target's own).
        publisher: the monitor's exporters.
        settings: the monitor's settings (checked).
        budget: the monitor's allowances, shared by its targets (None: no limit); made from ``settings``.
        """
        self.target = target
        self.settings = settings
        seed = settings.seed
        self.drill = settings.drill
        # The user declares the forward/backward hooks of their modules free of side effects: calls that reach
        # such hooks are compared (the hooks run again on the upstream side) instead of skipped.
        self.pure_hooks = settings.pure_hooks
        self.monitor: Any = None  # the Monitor that installed this experiment (set by it)
        # The overhead budget, the monitor's (shared by its targets): the upstream side's time (upstream,
        # comparison, oracle, exporters) and a guided target's classifying may use at most its fraction of wall time
        # over every 10 s window (shadow.core.calls.budget); sampled calls beyond it are skipped (reason "budget")
        # without calling exporters, and reported to them in bulk at the next publish or flush.
        self._budget = budget.shadow if budget is not None else None
        self._clock = budget.clock if budget is not None else time.perf_counter  # (what is charged is timed on it)
        self._sampled_seconds = 0.0  # (what the sampled call under way has taken so far: its plan, its upstream side)
        self._last_cost = 0.0  # (what the last sampled call that ended took: what the next one is expected to cost)
        # The deadline of one call's shadow side (seconds, None: none): past it the call is skipped (reason
        # "deadline"), its run abandoned on its own thread, and every later sampled call is skipped too.
        self.deadline = settings.deadline
        self.deadline_passed = False
        # The extra runs' draws. The single-device oracle (None: off): every sampled call under autocast and this
        # fraction of the others (targets that describe a single-device call only). The A/A run: legacy again,
        # isolated as upstream is, its difference the target's own nondeterminism (shadow.core.judging.noise). The
        # backward comparison (shadow.core.judging.gradients), while legacy is the primary; its cotangents' seeds drawn
        # from its coin. The float64 truth run (shadow.core.judging.truth), among the calls with a value difference.
        oracle = settings.oracle if target.oracle is not None and target.isolate else None
        self.oracle_coin = Coin(oracle, seed, f"{target.name}/oracle") if oracle is not None else None
        self.aa_coin = Coin(settings.aa_rate, seed, f"{target.name}/aa")
        self.backward_coin = Coin(settings.backward_rate, seed, f"{target.name}/backward")
        self.truth_coin = Coin(settings.truth_rate, seed, f"{target.name}/truth")
        # (of the current phase: started again at a rollback or a reset)
        self.noise = NoiseFloor()
        # Value differences the floor cannot judge yet (shadow.core.judging.noise): published once it can, as noise
        # or as mismatches; neither divergence nor agreement meanwhile (a skip, reason noise_pending, if it never can)
        self.held = HeldDifferences()
        self.legacy = target.resolve_legacy()
        self.legacy_origin = patch_origin(self.legacy) or ""
        # The primary side's result is the caller's (legacy while shadowing; upstream in a canary), the other side
        # runs as the shadow, isolated. A rollback makes legacy the primary (never the other way round).
        primary = settings.primary
        self.primary = self.configured_primary = primary
        self.primary_fn, self.shadow_fn = (
            (self.legacy, target.upstream) if primary == LEGACY else (target.upstream, self.legacy)
        )
        self.rolled_back_by: str | None = None
        # (a function whose run was left at its deadline in this process is not run beside it again)
        self.deadline_passed = id(self.shadow_fn) in _ABANDONED
        self.tolerance = tolerance if tolerance is not None else target.tolerance
        self.publisher = publisher
        self._lock = threading.Lock()
        self.tally = Tally(clusters.cluster_share())
        self._last_logged: dict[str, float] = {}
        self.classifier = Classifier(target, budget, self._clock, self.log_limited, self._count_over_cap)
        # Coverage guidance: the first calls of every signature are compared, later ones sampled at the rate
        # (shadow.core.calls.coverage: every call classified until each signature seen has had its first calls, then
        # one in CLASSIFY_ONE_IN). It needs a signature function. Its sampler's gates end at the calls to classify;
        # the sampled calls are drawn among those (a thinning: each call is still sampled at the rate).
        self.sample_rate = sample_rate
        self.first_per_signature = settings.first_per_signature if target.signature is not None else 0
        self.coverage = Coverage(self.first_per_signature) if self.first_per_signature else None
        self._guided_coin = Coin(sample_rate, seed, f"{target.name}/guided")
        # (keys whose signature had its first calls: those calls take the gate; the rest are classified)
        self._signature_key = target.signature_key if self.coverage is not None else None
        self._known_keys: set = set()
        self.wrapper, (self._set_gate, self._set_primary) = _make_wrapper(
            self.primary_fn, self._arrive, self._arrive_novel, self._signature_key, self._known_keys
        )
        self.wrapper.__npu_shadow__ = self  # type: ignore[attr-defined]
        self._sampler_gate: Gate = _CLOSED
        gate_rate = max(sample_rate, 1 / CLASSIFY_ONE_IN) if self.coverage is not None else sample_rate
        self._thinning = sample_rate / gate_rate if gate_rate else 0.0
        self.sampler = Sampler(gate_rate, seed, target.name, self._gate_opened)
        publisher.each("register", target.name, sample_rate)
        publisher.each("set_primary", target.name, self.primary)
        # Compiled code traces the primary of the moment it compiles (a rollback re-routes graphs compiled later).
        self._traced = [self.primary_fn]
        traced = self._traced

        def primary_of_the_moment(*args: Any, **kwargs: Any) -> Any:
            return traced[0](*args, **kwargs)

        compiling.trace_as_legacy(self.wrapper, primary_of_the_moment)
        forks.register(self)
        _HELD.add(self)

    # ------------------------------------------------------------------ the call

    def _gate_opened(self, gate: Gate) -> None:
        """The sampler's new gate: the wrapper's too, unless a guided target classifies every call now or an
        upstream side is under way."""
        self._sampler_gate = gate
        self._refresh_gate()

    def _classifies_all(self) -> bool:
        return self.coverage is not None and self.coverage.classify_all

    def _refresh_gate(self) -> None:
        """The wrapper's gate: closed while every call is classified or an upstream side is under way (:class:`_Held`),
        else the sampler's."""
        self._set_gate(_CLOSED if _HELD.count or self._classifies_all() else self._sampler_gate)

    def signature_of(self, args: tuple, kwargs: dict) -> Any:
        """The target's signature function on a call, checked (:meth:`Classifier.signature_of`)."""
        return self.classifier.signature_of(args, kwargs)

    @property
    def signature_has_side_effects(self) -> bool:
        """Whether the signature function changed a generator or the grad mode (it is not run any more)."""
        return self.classifier.has_side_effects

    def _count_classified(self, coverage: Coverage, signature: str, alone: bool = False) -> tuple[bool, bool]:
        """(among the first of its signature, sampled) for a classified call, counted (under the lock). While
        every call is classified, each is sampled at the rate, and so is a call that came ``alone`` (not through
        the gate: its key not known); after, a call that ends a gate is sampled with the thinning's probability.
        The wrapper's gate follows the coverage's mode."""
        classified_all = coverage.classify_all
        if classified_all or alone:
            sampled = self._guided_coin.chance(self.sample_rate)
            first = coverage.count(signature, beside=alone)
        else:
            sampled = self.sampler.arrive() and (self._thinning >= 1.0 or self._guided_coin.chance(self._thinning))
            first = coverage.count(signature, self.sampler.calls())
        if coverage.classify_all != classified_all:  # (a signature's first calls began or ended)
            self._refresh_gate()
        return first, sampled

    @property
    def first_comparisons_done(self) -> bool:
        """Whether every signature seen has had its first calls (always so without coverage guidance, and while
        no call was seen)."""
        return self.coverage is None or self.coverage.done or not self.coverage.calls

    def _arrive_novel(self, args: tuple, kwargs: dict) -> Any:
        """A call whose signature key is not known yet (:func:`_make_wrapper`): classified, never through the
        gate."""
        return self._arrive(args, kwargs, novel=True)

    def _know_key(self, args: tuple, kwargs: dict) -> None:
        """The call's signature key is known from now on (its signature had its first calls)."""
        try:
            key = self._signature_key(args, kwargs)  # type: ignore[misc]
            if key is not None:
                self._known_keys.add(key)
        except Exception:  # (the key function's failure: the calls with that key stay classified)
            pass

    def _arrive(self, args: tuple, kwargs: dict, novel: bool = False) -> Any:
        """A call found the gate closed (or, ``novel``, its signature key is not known yet): admitted
        (:meth:`_admit`), then run as admitted."""
        admission = self._admit(args, kwargs, novel)
        if callable(admission):  # (a nested call, or one not sampled: nothing is made for it)
            return admission(*args, **kwargs)
        if admission.skip:
            with self._lock:  # nothing but counting: until the job's time catches up, or for good
                self.tally.skip_in_bulk(admission.skip)
            return self._run_legacy(args, kwargs)
        try:
            return self._compare(args, kwargs, admission.signature)
        finally:
            if admission.held:  # (what was taken at the start, given back: the call's real cost is charged by now)
                self._charge(-admission.held)

    def _admit(self, args: tuple, kwargs: dict, novel: bool) -> Callable | _Admission:
        """What becomes of a call that found the gate closed: run as it is (the function returned: a nested call,
        a call not sampled), skipped in bulk (past the deadline, beyond the budget), or compared (the sampled one,
        or a guided target's call among the first of its signature, compared whatever the rate)."""
        side = upstream_side_of_this_thread()
        publishing = getattr(marks, "publishing", False)
        if side is not None or publishing or getattr(marks, "in_legacy", None) is self:
            # A nested call, part of a call already counted: made by legacy itself (through a mode, a subclass
            # or recursion), by an upstream side (upstream, the oracle, the comparison) on its own thread or on a
            # thread its upstream run started (DataParallel's workers), or by an exporter. Not a call of the
            # job's: not counted, not compared. One rule on every thread: an upstream side's calls of its own
            # target run upstream (upstream calling itself); every other nested call runs legacy, the world the
            # job has today. So a comparison sees only its own target's difference, and another target's
            # difference is compared, counted and reported by that target, on the calls the job's legacy run makes.
            with self._lock:
                if not novel and (self.coverage is None or not self.coverage.classify_all):  # (it ended the gate)
                    self.sampler.arrive()
                    self.sampler.uncount()
            return self.shadow_fn if side is self and not publishing else self.primary_fn
        if not novel and _HELD.count and not self._classifies_all() and next(self._sampler_gate, False):
            return self.primary_fn  # (the gate is closed for an upstream side: this call passes it)
        signature, first = None, False
        if self.coverage is not None:
            signature = self.classifier.classify(args, kwargs)
            with self._lock:
                first, sampled = self._count_classified(self.coverage, signature, alone=novel)
                finished = self._signature_key is not None and self.coverage.finished(signature)
            if finished and novel and signature != UNCLASSIFIED_SIGNATURE:
                self._know_key(args, kwargs)
        else:
            with self._lock:
                sampled = self.sampler.arrive()
        if not (first or sampled):
            return self.primary_fn
        if self.deadline_passed:
            return _Admission(skip="deadline")
        held = None
        if self._budget is not None:
            held = self._budget.take(self._last_cost, self)  # (taken now: threads starting together see it)
            if held is None:
                return _Admission(skip="budget")
        return _Admission(signature=signature, held=held)

    def _compare(self, args: tuple, kwargs: dict, signature: str | None) -> Any:
        """An admitted call: skipped with an observation where the shadow side cannot be the same call (a reason
        of :meth:`_skip_reason`), else legacy against the shadow run (:meth:`_sampled_call`)."""
        modules = modules_in_call(args, kwargs)
        skip = self._skip_reason(args, kwargs, modules)
        if skip is None:
            return self._sampled_call(args, kwargs, modules, signature)
        start = self._clock()
        skipped = Observation(
            self.target.name, Outcome.SKIPPED, (skip[0],), signature=signature or "", timestamp=time.time(),
            primary=self.primary, detail=skip[1],
        )  # fmt: skip
        self._publish(skipped)
        self._charge(self._clock() - start)
        return self._run_legacy(args, kwargs)

    def _run_legacy(self, args: tuple, kwargs: dict) -> Any:
        """Legacy, marked as running on this thread: its own nested calls of the wrapper are not new calls."""
        outer = getattr(marks, "in_legacy", None)
        try:
            marks.in_legacy = self
            return self.primary_fn(*args, **kwargs)
        finally:
            marks.in_legacy = outer

    def _skip_reason(self, args: tuple, kwargs: dict, modules: list[torch.nn.Module]) -> tuple[str, str] | None:
        """(reason, detail) where this sampled call cannot be compared faithfully, else None: the upstream side
        would be visible to code the job runs (a user's mode, a tensor subclass, a user's module hooks), is being
        compiled, or the target says the call cannot run twice (:attr:`Target.run_if`)."""
        if torch.compiler.is_compiling():
            return "compiling", ""
        if _user_code_would_see_the_shadow(args, kwargs, modules):
            return "mode", ""
        if not self.pure_hooks and has_user_hooks(modules):
            return "hooks", ""
        if self.target.run_if is not None:
            try:
                why = self.target.run_if(args, kwargs)
            except InsufficientMemory as exc:
                return "oom", bounded(str(exc))
            except Exception as exc:  # (the target's own check: its failure is ours to count, never the job's)
                return "comparator", bounded(f"run_if raised {exc!r}")
            if why is not None:
                return "ineligible", bounded(str(why))
        return None

    def _sampled_call(
        self, args: tuple, kwargs: dict, modules: list[torch.nn.Module], signature: str | None = None
    ) -> Any:
        """Plan the upstream side, run legacy (its result or exception is the caller's), then the upstream side."""
        planning = self._clock()
        side = UpstreamSide.plan_call(self, args, kwargs, modules, signature)
        self._sampled_seconds = self._clock() - planning
        self._charge(self._sampled_seconds)
        start = time.perf_counter()
        try:
            result = self._run_legacy(args, kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # (SystemExit too: the state it leaves is compared like any other ending)
            self._upstream_side(side, args, kwargs, Run(error=exc, seconds=time.perf_counter() - start))
            raise
        self._upstream_side(side, args, kwargs, Run(value=result, seconds=time.perf_counter() - start))
        return result

    # ------------------------------------------------------------------ after legacy

    def admit(self, signature: str) -> str:
        """The signature itself while the target has fewer than MAX_SIGNATURES, else "other" (counted, logged)."""
        return self.classifier.admit(signature)

    def _count_over_cap(self) -> None:
        with self._lock:
            self.tally.signatures_over_cap += 1

    def _upstream_side(self, side: UpstreamSide, args: tuple, kwargs: dict, legacy: Run) -> None:
        """Everything after legacy: observe, publish. Whatever it does to torch's global state is undone, and
        whatever it raises is this tool's fault: counted as a "comparator" skip, never the caller's problem."""
        # Calls of wrapped functions from here on (upstream's, the oracle's, exporters') are not compared again.
        # (set inside the try, put back first thing in its finally: no interrupt, wherever it lands, leaves this
        # thread marked, and the caller's later calls on upstream)
        outer = getattr(marks, "upstream_side", None)
        started = self._clock()
        held = False
        try:
            _HELD.hold()
            held = True
            marks.upstream_side = self
            left_by_legacy = TorchGlobals()  # the upstream side's changes never reach the job
            try:
                try:
                    observation = side.observe(args, kwargs, legacy, left_by_legacy)
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # SystemExit too
                    self.log_limited("comparator", "upstream side failed: %r", exc)
                    observation = Observation(
                        self.target.name, Outcome.SKIPPED, ("comparator",), detail=bounded(repr(exc)), signature="",
                        primary=self.primary,
                    )  # fmt: skip
                self._publish(observation)
            finally:
                self.put_back(left_by_legacy)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # taking torch's settings failed: ours to count, not the job's
            self._settings_failed(exc)
        finally:
            marks.upstream_side = outer
            if held:
                _HELD.release()
            seconds = self._clock() - started
            self._charge(seconds)
            self._sampled_seconds += seconds
            self._last_cost = self._sampled_seconds  # (plan and upstream side, once both are done)

    def _charge(self, seconds: float) -> None:
        if self._budget is not None:
            self._budget.charge(seconds)

    def roll_back(self, by: str) -> bool:
        """Make legacy the primary from the next call on (upstream runs as the shadow): the rollback switch. Only
        toward legacy; True when this changed anything. Exporters hear of it (``record_rollback``); the noise
        floor starts again (the other phase's errors are not this one's)."""
        if not self._switch_primary(LEGACY, by, "record_rollback"):
            return False
        log.warning("npu-shadow [%s]: rolled back to legacy by %s", self.target.name, by)
        return True

    def reset_primary(self, by: str) -> bool:
        """A person's reset after a rollback: the primary configured at install again. True when it changed."""
        if not self._switch_primary(self.configured_primary, by, "record_reset"):
            return False
        log.warning("npu-shadow [%s]: primary reset to %s by %s", self.target.name, self.primary, by)
        return True

    def _switch_primary(self, primary: str, by: str, hook: str) -> bool:
        """Make ``primary`` the side whose result the caller gets; exporters hear of it (``set_primary`` and
        ``hook``). The calls so far are the ending phase's, its held value differences released as skips, and the
        noise floor starts again. True when this changed anything."""
        self.report_calls(flush=True)
        if self.primary != primary:
            self.release_pending()
        with self._lock:
            if self.primary == primary:
                return False
            self.noise = NoiseFloor()
            self.primary = primary
            self.primary_fn, self.shadow_fn = (
                (self.legacy, self.target.upstream) if primary == LEGACY else (self.target.upstream, self.legacy)
            )
            self.rolled_back_by = by if hook == "record_rollback" else None
            self._set_primary(self.primary_fn)
            self._traced[0] = self.primary_fn
        self.publisher.each("set_primary", self.target.name, primary)
        self.publisher.each(hook, self.target.name, by)
        return True

    def noise_floor(self) -> dict[str, tuple[float, float, int, int]]:
        """{signature: (greatest abs difference, greatest rel difference, A/A runs, runs that differed)} of the
        current phase's A/A runs."""
        with self._lock:
            return {s: (f[0], f[1], int(f[2]), int(f[3])) for s, f in self.noise.summary.items()}

    def put_back(self, settings: TorchGlobals) -> bool:
        """Write back a snapshot of the global settings; whatever cannot be is counted and logged, never raised
        (each setting is written on its own, so the others still are). Whether all of them were."""
        try:
            settings.restore()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self._settings_failed(exc)
            return False
        return True

    def count_oracle_run(self) -> None:
        """One run of the single-device oracle (the upstream side's)."""
        with self._lock:
            self.tally.oracle_runs += 1

    def deadline_missed(self) -> None:
        """A run of the shadow side passed its deadline: this target shadows no more (said once)."""
        _ABANDONED.setdefault(id(self.shadow_fn), self.shadow_fn)
        if self.deadline_passed:
            return
        self.deadline_passed = True
        log.warning(
            "npu-shadow [%s]: the shadow side of a call took longer than its deadline (%g s): the job went on "
            "with the primary's result, and this target shadows no more (its run is left to end alone)",
            self.target.name, self.deadline,
        )  # fmt: skip

    def _settings_failed(self, failure: BaseException) -> None:
        with self._lock:
            self.tally.settings_failures += 1
        self.log_limited("settings", "global settings could not be taken or put back: %r", failure)

    def _publish(self, observation: Observation, judged: bool = False) -> None:
        """Count an observation and export it. A value difference the noise floor cannot judge yet is held
        instead (:class:`~shadow.core.calls.held.HeldDifferences`); after an A/A run, the held ones of its
        signature are judged again (``judged``: this is one of them)."""
        if observation.noise_pending:
            if self.held.hold(observation):
                return
            observation = _unjudged(observation)
        with self._lock:
            observation = self.tally.count(observation)
        self.report_calls()
        failed = self.publisher.export(self.target.name, observation)
        if failed:
            with self._lock:
                self.tally.export_errors += failed
        if observation.aa and not judged and len(self.held):
            for held, noise, test in self.held.judged(observation.signature, self.noise):
                found = within_noise_floor(held, test) if noise else held
                self._publish(dataclasses.replace(found, noise_pending=False, noise_test=test, leaf_errors=()), True)

    def release_pending(self) -> None:
        """Publish the value differences still held as skips (reason noise_pending): the floor never had the
        A/A runs to judge them (at a flush, a rollback, a reset)."""
        for observation in self.held.release():
            self._publish(_unjudged(observation), True)

    def report_calls(self, flush: bool = False) -> None:
        """Tell exporters how many calls passed (by signature for a guided target), and how many sampled calls
        the budget skipped, since the last report (done at each publish, at a rollback or reset, each second by
        :mod:`shadow.core.calls.reporter` and at flush: ``flush`` counts a guided target's open gate too)."""
        with self._lock:
            tally = self.tally
            if self.coverage is not None:
                # (the open gate's calls only when flushing: until then its last call may count them elsewhere)
                counted = self.coverage.counts(self.sampler.calls(), flush=True) if flush else self.coverage.calls
                deltas = {
                    signature: calls - tally.signature_calls_reported.get(signature, 0)
                    for signature, calls in counted.items()
                }
                tally.signature_calls_reported = dict(counted)
            else:
                calls = self.sampler.calls()
                deltas = {"": calls - tally.calls_reported}
                tally.calls_reported = calls
            skipped = tally.take_unreported_skips()
        for signature, delta in deltas.items():
            if delta:
                self.publisher.each("record_calls", self.target.name, delta, signature)
        for reason, count in skipped.items():
            self.publisher.each("record_skips", self.target.name, reason, count)

    def log_limited(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last_logged.get(kind)
        if last is None or now - last >= _LOG_INTERVAL_SECONDS:
            self._last_logged[kind] = now
            log.warning("npu-shadow [%s]: " + message, self.target.name, *args)

    # ------------------------------------------------------------------ bookkeeping

    def stats(self) -> TargetStats:
        """A consistent snapshot of this target's counts."""
        with self._lock:
            tally = self.tally
            outcomes = dict(tally.outcomes)
            coverage = self.coverage
            return TargetStats(
                calls=self.sampler.calls() + (coverage.counted_alone if coverage is not None else 0),
                signature_calls=coverage.counts(self.sampler.calls()) if coverage is not None else {},
                primary=self.primary,
                rolled_back_by=self.rolled_back_by or "",
                sampled=sum(outcomes.values()),
                **{outcome: outcomes.get(outcome, 0) for outcome in OUTCOMES},
                by_reason=dict(tally.reasons),
                shared_divergences=dict(tally.shared),
                oracle_runs=tally.oracle_runs,
                backward_runs=tally.backward_runs,
                noise_pending=len(self.held),
                backward_skips=dict(tally.backward_skips),
                truth_runs=dict(tally.truth_runs),
                clusters=tally.clusters.count,
                drilled=tally.drilled,
                signatures_over_cap=tally.signatures_over_cap,
                export_errors=tally.export_errors,
                settings_failures=tally.settings_failures,
            )

    def _after_fork_in_child(self) -> None:
        # The parent's lock may have been held by another thread at fork time, and the parent's counts
        # belong to the parent: the child starts clean.
        self._lock = threading.Lock()
        self.tally = self.tally.fresh()
        self.noise = NoiseFloor()
        self.held = HeldDifferences()
        if self.coverage is not None:  # (its first calls compared again: the child's own evidence)
            self.coverage = Coverage(self.first_per_signature)
            self._known_keys.clear()
            self._set_gate(_CLOSED)


def _unjudged(observation: Observation) -> Observation:
    """A held value difference the noise floor never judged, as the skip it then is."""
    return Observation(
        observation.target, Outcome.SKIPPED, ("noise_pending",), signature=observation.signature,
        detail=observation.noise_test, timestamp=observation.timestamp, primary=observation.primary,
    )  # fmt: skip


def experiment_of(obj: Any) -> Experiment | None:
    """The Experiment behind an installed wrapper, if ``obj`` is one."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return getattr(obj, "__npu_shadow__", None)
