"""The wrapper engine: one :class:`Experiment` per installed target.

Data flows one way: call -> the wrapper's gate (:mod:`~shadow.core.calls.gate`) -> admission -> on a sampled call,
one :class:`~shadow.core.calls.sampled.call.SampledCall` (the primary, returned to the caller; the isolated shadow
run, the extra runs, the comparison) -> :class:`Observation` -> the target's
:class:`~shadow.core.calls.record.record.Record` -> exporters. The experiment keeps the gate, the admission and the
primary switch; a sampled call reads only its frozen :class:`~shadow.core.calls.sampled.plan.CallContext`, made
again when the primary switches. What it counted is its record's, its draws are
:class:`~shadow.core.calls.sampled.plan.Coins`, its signatures its
:class:`~shadow.core.calls.gate.coverage.Classifier`'s, its settings the monitor's
:class:`~shadow.core.calls.settings.Settings`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from shadow.core.calls.gate.budget import Budgets, ShadowCost
from shadow.core.calls.gate.coverage import Classifier
from shadow.core.calls.gate.graph_memory import GraphMemory
from shadow.core.calls.gate.sampling import Sampling
from shadow.core.calls.gate.wrapper import make_wrapper
from shadow.core.calls.record.record import Publisher, Record
from shadow.core.calls.sampled.call import SampledCall, run_primary
from shadow.core.calls.sampled.plan import CallContext, Coins
from shadow.core.calls.settings import Settings
from shadow.core.judging import gradients
from shadow.core.judging.noise import NoiseFloor
from shadow.core.model import contract
from shadow.core.model.observation import LEGACY, UNCLASSIFIED_SIGNATURE, Observation, Switched, TargetStats
from shadow.core.model.targets import Target, patch_origin
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs.sides import marks, shadow_side_of_this_thread
from shadow.core.support import compiling, forks

log = logging.getLogger("shadow")


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


class Experiment:
    """One installed target: its wrapper, its sampling, its record; on sampled calls, the primary's run against
    the shadow run (legacy against upstream while shadowing; the other way round in a canary).

    Args:
        target: what is shadowed.
        sample_rate: the fraction of its calls compared.
        tolerance: its tolerance (None: the target's own).
        publisher: the monitor's exporters.
        settings: the monitor's settings (checked).
        budget: the monitor's allowances, shared by its targets (None: no limit): the shadow side's time and a
            guided target's classifying use at most its fraction of wall time over every 10 s window; sampled calls
            beyond it are skipped (reason "budget") and reported in bulk.
    """

    def __init__(
        self,
        target: Target,
        sample_rate: float,
        tolerance: ToleranceSpec,
        publisher: Publisher,
        settings: Settings,
        budget: Budgets | None = None,
    ) -> None:
        self.target, self.settings, self.monitor = target, settings, None  # (the monitor sets itself)
        self.drill, self.pure_hooks, self.deadline = settings.drill, settings.pure_hooks, settings.deadline
        self.cost = ShadowCost(budget)
        self.coins = Coins.of(
            target, settings.seed, settings.oracle, settings.aa_rate, settings.backward_rate, settings.truth_rate
        )
        self.graph_memory: GraphMemory | None = None
        if self.coins.backward is not None and target.isolate:
            gradients.prepare()
            if settings.backward_memory is not None:
                self.graph_memory = GraphMemory(settings.backward_memory)
        self.noise = NoiseFloor()  # (of the current phase: started again at a rollback or a reset)
        self.legacy = target.resolve_legacy()
        self.legacy_origin = patch_origin(self.legacy) or ""
        self.primary = self.configured_primary = settings.primary
        self.primary_fn, self.shadow_fn = self._sides(self.primary)
        self.rolled_back_by: str | None = None
        # (a function whose run was left at its deadline in this process is not run beside it again)
        self.deadline_passed = id(self.shadow_fn) in _ABANDONED
        self.tolerance = tolerance if tolerance is not None else target.tolerance
        self._lock = threading.Lock()
        self.sampling = Sampling(target, sample_rate, settings.first_per_signature, settings.seed, self._lock)
        self.record = Record(target.name, publisher, self._lock, self.sampling.counted, self.primary)
        self.classifier = Classifier(
            target, budget, self.cost.clock, self.record.log_limited, lambda: self.record.add("signatures_over_cap")
        )
        self.wrapper, (set_gate, self._set_primary) = make_wrapper(
            self.primary_fn, self._arrive, self._arrive_novel, self.sampling.key, self.sampling.known
        )
        self.wrapper.__npu_shadow__ = self  # type: ignore[attr-defined]
        self.sampling.attach(set_gate)
        self.context = self._context()
        publisher.record(
            contract.registered_samples(target.name, sample_rate) + contract.primary_samples(target.name, self.primary)
        )
        # Compiled code traces the primary of the moment it compiles (a rollback re-routes graphs compiled later).
        self._traced = traced = [self.primary_fn]
        compiling.trace_as_legacy(self.wrapper, lambda *args, **kwargs: traced[0](*args, **kwargs))
        forks.register(self)

    def _context(self) -> CallContext:
        """What a sampled call reads of this experiment, as it is now (made again at a primary switch)."""
        return CallContext(
            self.target, self.primary, self.primary_fn, self.shadow_fn, self.legacy, self.legacy_origin,
            self.tolerance, self.pure_hooks, self.deadline, self.drill, self.coins, self.noise, self.classifier,
            self.record, self.cost, plain=self.target.plain, experiment=self, deadline_missed=self.deadline_missed,
            graph_memory=self.graph_memory,
        )  # fmt: skip

    def _sides(self, primary: str) -> tuple[Callable, Callable]:
        """(the primary's function, the shadow's) when ``primary`` is the side whose result the caller gets."""
        return (self.legacy, self.target.upstream) if primary == LEGACY else (self.target.upstream, self.legacy)

    # ------------------------------------------------------------------ the call

    def _arrive_novel(self, args: tuple, kwargs: dict) -> Any:
        """A call whose signature key is not known yet: classified, never through the gate."""
        return self._arrive(args, kwargs, novel=True)

    def _arrive(self, args: tuple, kwargs: dict, novel: bool = False) -> Any:
        """A call found the gate closed (or, ``novel``, its signature key is not known yet): admitted
        (:meth:`_admit`), then run as admitted."""
        admission = self._admit(args, kwargs, novel)
        if callable(admission):  # (a nested call, or one not sampled: nothing is made for it)
            return admission(*args, **kwargs)
        if admission.skip:  # (nothing but counting: until the job's time catches up, or for good)
            self.record.skip_in_bulk(admission.skip)
            return run_primary(self.context, args, kwargs)
        try:
            return SampledCall(self.context, args, kwargs, admission.signature).run()
        finally:
            if admission.held:  # (what was taken at the start, given back: the call's real cost is charged by now)
                self.cost.charge(-admission.held)

    def _admit(self, args: tuple, kwargs: dict, novel: bool) -> Callable | _Admission:
        """What becomes of a call that found the gate closed: run as it is (the function returned: a nested call,
        a call not sampled), skipped in bulk (past the deadline, beyond the budget), or compared (the sampled one,
        or a guided target's call among the first of its signature, compared whatever the rate)."""
        side = shadow_side_of_this_thread()
        publishing = getattr(marks, "publishing", False)
        if side is not None or publishing or getattr(marks, "in_primary", None) is self:
            # A nested call, part of a call already counted: made by the primary itself (through a mode, a subclass
            # or recursion), by a shadow side (its runs, the comparison) on its own thread or on a thread its run
            # started (DataParallel's workers), or by an exporter. Not a call of the job's: not counted, not
            # compared. One rule on every thread: a shadow side's calls of its own target run the shadow (upstream
            # calling itself); every other nested call runs the primary, the world the job has. So a comparison
            # sees only its own target's difference, and another target's is compared, counted and reported by that
            # target, on the calls the job's primary run makes.
            self.sampling.uncount_nested(novel)
            return self.shadow_fn if side is self and not publishing else self.primary_fn
        if self.sampling.passes_held_gate(novel):
            return self.primary_fn  # (the gate is closed for a shadow side: this call passes it)
        signature, first = None, False
        if self.sampling.coverage is not None:
            signature = self.classifier.classify(args, kwargs)
            first, sampled, finished = self.sampling.classified(signature, alone=novel)
            if finished and novel and signature != UNCLASSIFIED_SIGNATURE:
                self.sampling.know_key(args, kwargs)
        else:
            sampled = self.sampling.arrive()
        if not (first or sampled):
            return self.primary_fn
        if self.deadline_passed:
            return _Admission(skip="deadline")
        held = self.cost.take(self)  # (taken now: threads starting together see it)
        if held is None:
            return _Admission(skip="budget")
        return _Admission(signature=signature, held=held)

    # ------------------------------------------------------------------ the primary

    def roll_back(self, by: str) -> bool:
        """Make legacy the primary from the next call on (upstream runs as the shadow): the rollback switch. Only
        toward legacy; True when this changed anything. Exporters hear of it (a ``rollback``); the noise floor
        starts again (the other phase's errors are not this one's)."""
        return self._switch_primary(LEGACY, by, "rollback")

    def reset_primary(self, by: str) -> bool:
        """A person's reset after a rollback: the primary configured at install again. True when it changed."""
        if not self._switch_primary(self.configured_primary, by, "reset"):
            return False
        log.warning("npu-shadow [%s]: primary reset to %s by %s", self.target.name, self.primary, by)
        return True

    def _switch_primary(self, primary: str, by: str, event: str) -> bool:
        """Make ``primary`` the side whose result the caller gets; exporters hear of it (a :class:`Switched`
        ``event``, and its samples). The calls so far are the ending phase's, its held value differences released
        as skips, and the noise floor starts again. True when this changed anything."""
        self.report_calls(flush=True)
        if self.primary != primary:
            self.release_pending()
        with self._lock:
            if self.primary == primary:
                return False
            self.noise, self.primary = NoiseFloor(), primary
            self.primary_fn, self.shadow_fn = self._sides(primary)
            self.rolled_back_by = by if event == "rollback" else None
            self.record.primary = primary
            self._set_primary(self.primary_fn)
            self._traced[0] = self.primary_fn
            self.context = self._context()
        name = self.target.name
        counted = contract.rollback_samples(name, by) if event == "rollback" else contract.reset_samples(name)
        samples = contract.primary_samples(name, primary) + counted
        self.record.publisher.export(name, Switched(name, event, by, primary), samples)
        self.record.publisher.deliver()  # (the switch on the exporters now, after everything before it)
        return True

    # ------------------------------------------------------------------ what the shadow side reports

    @property
    def first_comparisons_done(self) -> bool:
        """Whether every signature seen has had its first calls (:attr:`Sampling.first_comparisons_done`)."""
        return self.sampling.first_comparisons_done

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

    def publish(self, observation: Observation) -> None:
        """Count an observation and export it (:meth:`Record.publish`)."""
        self.record.publish(observation, self.noise)

    def release_pending(self) -> None:
        """Publish the value differences still held as skips (reason noise_pending): the floor never had the
        A/A runs to judge them (at a flush, a rollback, a reset); the deferred comparisons are read first."""
        self.record.finish_deferred(wait=True)
        self.record.release_held(self.noise)

    def report_calls(self, flush: bool = False) -> None:
        """Tell exporters how many calls passed (by signature for a guided target), and how many sampled calls
        were skipped in bulk, since the last report (done at each publish, at a rollback or reset, each second by
        :mod:`shadow.core.calls.record.reporter` and at flush: ``flush`` counts a guided target's open gate too)."""
        self.record.report_calls(flush, self.primary)

    def noise_floor(self) -> dict[str, tuple[float, float, int, int]]:
        """{signature: (greatest abs difference, greatest rel difference, A/A runs, runs that differed)} of the
        current phase's A/A runs."""
        with self._lock:
            return {s: (f[0], f[1], int(f[2]), int(f[3])) for s, f in self.noise.summary.items()}

    def stats(self) -> TargetStats:
        """A consistent snapshot of this target's counts (the deferred comparisons read first: waiting for the
        device, where it has not finished them)."""
        self.record.finish_deferred(wait=True)
        return self.record.stats(self.sampling, self.primary, self.rolled_back_by)

    def _after_fork_in_child(self) -> None:
        # The parent's lock may have been held by another thread at fork time, and the parent's counts belong to
        # the parent: the child starts clean.
        self._lock = threading.Lock()
        self.record.after_fork(self._lock)
        self.sampling.after_fork(self._lock)
        self.noise = NoiseFloor()
        self.context = self._context()


def experiment_of(obj: Any) -> Experiment | None:
    """The Experiment behind an installed wrapper, if ``obj`` is one."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return getattr(obj, "__npu_shadow__", None)
