"""The shadow side of one sampled call: everything that runs after the primary (legacy while shadowing, upstream
in a canary), on a worker of its own.

A :class:`ShadowSide` is made for each sampled call before the primary runs (its :class:`Plan`: the isolation, the
signature, the settings the primary starts from, which extra runs join in). Once the primary has run,
:meth:`ShadowSide.observe` runs the shadow the way the primary ran (on a worker thread, within the deadline,
isolated), the extra runs the plan drew (:mod:`~shadow.core.calls.extra_runs`), compares, and returns the
:class:`Observation`. It never publishes and never counts calls: the experiment that made it does
(:mod:`shadow.core.calls.engine`), and it catches whatever this worker raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.calls import findings
from shadow.core.calls.extra_runs import ExtraRuns
from shadow.core.calls.plan import (
    AA,
    BACKWARD,
    ORACLE,
    Experiment,
    IsolationFailed,
    Plan,
    Run,
    autocast_state,
    is_hooked_subclass,
    within_deadline,
)
from shadow.core.judging.compare import with_state
from shadow.core.model.observation import (
    DIVERGENT_OUTCOMES,
    UNCLASSIFIED_SIGNATURE,
    UPSTREAM,
    Observation,
    Outcome,
    bounded,
    label_text,
)
from shadow.core.model.target import CannotReplay
from shadow.core.runs.deadline import Finished, leave_worker, run_here
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.isolation import ArgumentsChanged, Isolation, SideEffects, detach_tensors
from shadow.core.runs.sides import shadow_run
from shadow.core.support import trees

#: What an allocator's failure says: a device's "out of memory", the host allocator's "can't allocate memory".
_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or any(words in text for words in _OOM_TEXTS)


def _free_after_oom() -> None:
    with contextlib.suppress(Exception):
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.empty_cache()


class ShadowSide:
    """The upstream side of one sampled call of ``experiment``'s target: planned before legacy runs
    (:meth:`plan`), observed after it (:meth:`observe`)."""

    def __init__(self, experiment: Experiment, plan: Plan | BaseException) -> None:
        self.experiment = experiment
        #: The plan, or the exception taking it raised (the call is then skipped as this tool's fault).
        self.plan = plan
        #: The shadow run's arguments where the target replays the call's input (Target.replay), once the primary ran.
        self.replayed: tuple[tuple, dict] | None = None

    @classmethod
    def plan_call(
        cls, experiment: Experiment, args: tuple, kwargs: dict, modules: list[torch.nn.Module], signature: str | None
    ) -> ShadowSide:
        """What the upstream run (and the oracle's, the A/A run's) needs, taken before legacy runs."""
        try:
            target = experiment.target
            before = TorchGlobals()
            autocast = autocast_state()
            plain = target.plain  # (the extra runs are for plain functions of tensors only)
            oracle = (
                plain and experiment.oracle_coin is not None and ("=on/" in autocast or experiment.oracle_coin.flip())
            )
            aa = plain and experiment.aa_coin.flip()
            drawn = plain and target.isolate and experiment.primary != UPSTREAM and experiment.backward_coin.flip()
            backward = drawn and torch.is_grad_enabled()
            extra = tuple(name for name, joins in ((ORACLE, oracle), (BACKWARD, backward), (AA, aa)) if joins)
            if target.isolate:
                isolation = Isolation(args, kwargs, modules, runs=1 + len(extra))
                up_args, up_kwargs = None, None
            else:
                isolation, (up_args, up_kwargs) = None, detach_tensors((args, kwargs))
            if signature is None:  # (a guided target's call comes classified)
                signature = experiment.classifier.admit(label_text(str(_raw_signature(experiment, args, kwargs)), 64))
            rewind = target.rewind(args, kwargs) if target.rewind is not None else None
            replay = target.replay(args, kwargs) if target.replay is not None else None
            # (a run that reads the caller's stream is never left running past a deadline: it would move the
            # stream under the job later; it runs on the caller's thread)
            here = rewind is not None or (target.never_blocks is not None and bool(target.never_blocks(args, kwargs)))
            plan = Plan(
                isolation, up_args, up_kwargs, signature, autocast, before, extra, here,
                backward_skip="no_grad" if drawn and not backward else "", rewind=rewind, replay=replay,
            )  # fmt: skip
            return cls(experiment, plan)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            return cls(experiment, exc)

    # ------------------------------------------------------------------ observing

    def observe(self, args: tuple, kwargs: dict, primary: Run, left_by_primary: TorchGlobals) -> Observation:
        """Run the shadow the way the primary ran and compare the two runs: their results (or exceptions) and the
        torch settings each left behind (``primary`` and ``left_by_primary``: the primary's run, upstream's in a
        canary)."""
        experiment, plan = self.experiment, self.plan
        now = time.time()
        if isinstance(plan, BaseException):
            return self._skipped(plan, timestamp=now)
        snapshot = experiment.target.snapshot
        if snapshot is not None and primary.error is None:  # (what the primary's run left on the caller's object)
            primary = dataclasses.replace(primary, value=snapshot(primary.value, args, kwargs))
        cannot = self._cannot_run_shadow(plan, primary, now)
        if cannot is not None:
            return cannot
        shadow, drilled, left_by_shadow = self._shadow_run(plan, left_by_primary)
        if shadow is None:
            return Observation(
                experiment.target.name, Outcome.SKIPPED, ("deadline",), signature=plan.signature, timestamp=now,
                primary=experiment.primary,
                detail=f"the shadow side took longer than its deadline ({experiment.deadline:g} s)",
            )  # fmt: skip
        common = {
            "target": experiment.target.name,
            "primary": experiment.primary,
            "legacy": experiment.legacy_origin,
            "signature": plan.signature,
            "legacy_seconds": primary.seconds,
            "upstream_seconds": shadow.seconds,
            "drill": drilled,
            "timestamp": now,
        }
        if shadow.error is not None and primary.error is None and _is_oom(shadow.error):
            del shadow  # its error's traceback holds shadow's tensors
            _free_after_oom()
            return Observation(outcome=Outcome.SKIPPED, reasons=("oom",), **common)
        return self._compared(args, kwargs, (primary, shadow), (left_by_primary, left_by_shadow), common)

    def _compared(
        self,
        args: tuple,
        kwargs: dict,
        ran: tuple[Run, Run],
        left: tuple[TorchGlobals, TorchGlobals],
        common: dict[str, Any],
    ) -> Observation:
        """The observation of two runs that both ended (``ran``: the primary's, the shadow's; ``left``: the settings
        each left): compared, held against the noise floor, and the extra runs the plan drew made."""
        experiment, plan = self.experiment, self.plan
        assert isinstance(plan, Plan)
        (primary, shadow), left_by_primary = ran, left[0]
        returned = primary.error is None and shadow.error is None
        runs = ran[::-1] if experiment.primary == UPSTREAM else ran
        left = left[::-1] if experiment.primary == UPSTREAM else left
        extra = ExtraRuns(experiment, plan, left_by_primary)
        aa = extra.aa(runs[0]) if plan.aa and returned else {}
        start = time.perf_counter()
        found = findings.compare_runs(experiment, plan, args, kwargs, *runs)
        found = with_state(
            found, {**findings.state_differences(plan, *left), **findings.module_differences(experiment, plan)}
        )
        found, noise_test, pending = findings.within_noise(experiment, plan.signature, found)
        compare_seconds = time.perf_counter() - start
        found, drawn = extra.after_comparing(args, kwargs, runs, primary, found, returned)
        evidence = None
        # (a replay is of the forward; a pending difference is held, and holds no tensors while it waits)
        if found.outcome in DIVERGENT_OUTCOMES and "grad" not in found.reasons and not pending:
            evidence = findings.evidence(experiment, plan, *runs)
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
            noise_pending=pending,
            leaf_errors=tuple(found.leaf_errors) if pending else (),
            **aa,
            **drawn,
            **common,
        )

    def _cannot_run_shadow(self, plan: Plan, primary: Run, now: float) -> Observation | None:
        """The skip observation of a call whose shadow run would not be faithful, seen once the primary ran: the primary
        returned a tensor subclass with hooks (comparing it would run its code), wrote an argument in place, or the
        argument copies would not fit. None when the shadow can run (the isolation's copies are then taken)."""
        experiment = self.experiment
        if primary.error is None and any(map(is_hooked_subclass, trees.leaves(primary.value))):
            return Observation(
                experiment.target.name, Outcome.SKIPPED, ("mode",), signature=plan.signature, timestamp=now,
                primary=experiment.primary,
            )  # fmt: skip
        if plan.isolation is None:
            return self._replay(plan, now)
        try:
            plan.isolation.take_arguments()
        except ArgumentsChanged as exc:
            return Observation(
                experiment.target.name, Outcome.SKIPPED, ("inplace",), signature=plan.signature, detail=str(exc),
                timestamp=now, primary=experiment.primary,
            )  # fmt: skip
        except MemoryError as exc:
            return self._skipped(exc, timestamp=now)
        return self._replay(plan, now)

    def _replay(self, plan: Plan, now: float) -> Observation | None:
        """The shadow run's arguments from the target's replay (the input the primary read, read once), or the skip
        observation of a call whose input cannot be given again (``ineligible``) or would not fit (``oom``)."""
        if plan.replay is None:
            return None
        try:
            self.replayed = plan.replay()
        except CannotReplay as exc:
            return Observation(
                self.experiment.target.name, Outcome.SKIPPED, ("ineligible",), signature=plan.signature,
                detail=bounded(str(exc)), timestamp=now, primary=self.experiment.primary,
            )  # fmt: skip
        except MemoryError as exc:
            return self._skipped(exc, timestamp=now)
        return None

    def _skipped(self, failure: BaseException, timestamp: float) -> Observation:
        """The observation of a call whose plan failed: out of memory, or a fault of this tool."""
        reason = "oom" if _is_oom(failure) else "comparator"
        if reason == "oom":
            _free_after_oom()
        return Observation(
            self.experiment.target.name, Outcome.SKIPPED, (reason,), detail=bounded(repr(failure)),
            timestamp=timestamp, signature="", primary=self.experiment.primary,
        )  # fmt: skip

    # ------------------------------------------------------------------ the shadow run

    def _shadow_run(self, plan: Plan, left_by_primary: TorchGlobals) -> tuple[Run | None, bool, TorchGlobals]:
        """The shadow on the plan's arguments, from the torch settings the caller had before the call (the primary's
        start), in the caller's grad mode, isolated where the target asks for it; whether a fire drill corrupted
        it; and the torch settings it left behind (primary's are put back before this returns). The run is None
        where it passed its deadline. A call that cannot block runs here, on the caller's thread."""
        experiment = self.experiment
        context = plan.isolation.shadow_run() if plan.isolation is not None else contextlib.nullcontext()
        drill = experiment.drill if experiment.drill is not None and experiment.drill.fires() else None
        if not left_by_primary.same_as(plan.before):  # (the primary changed a setting: the shadow starts where it did)
            experiment.record.put_back(plan.before)
        shadow = _ShadowRun(plan, experiment.shadow_fn, experiment.target.snapshot, drill, self.replayed)
        body = shadow.run
        start = time.perf_counter()
        finished = Finished(False)
        # (a consumed argument, a stream: where the primary left it, put back once the shadow read it from the start)
        left_there = experiment.target.rewind(*plan.upstream_arguments()) if plan.rewind is not None else None
        try:
            if plan.rewind is not None:
                plan.rewind()
            with context, shadow_run(experiment):
                if plan.here:
                    finished = run_here(body)
                else:
                    finished = within_deadline(experiment, experiment, plan.before, body, checks_its_settings=True)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the isolation's own failure (the shadow's are in finished): a fault of ours,
            experiment.record.put_back(left_by_primary)  # counted as a "comparator" skip, never a side's exception
            raise IsolationFailed(f"the isolation of the shadow run failed: {exc!r}") from exc
        finally:
            if left_there is not None:
                left_there()
        if isinstance(finished.error, IsolationFailed):
            experiment.record.put_back(left_by_primary)
            raise finished.error
        seconds = time.perf_counter() - start
        left_by_shadow = shadow.left if shadow.left is not None and finished.finished else TorchGlobals()
        unchanged = left_by_primary.same_as(plan.before) and left_by_shadow.same_as(plan.before)
        if not (finished.finished and unchanged):  # (where neither run changed a setting, they are as the primary left)
            experiment.record.put_back(left_by_primary)
        if not finished.finished:
            return None, shadow.drilled, left_by_shadow
        # (SystemExit, GeneratorExit: the shadow's outcome, never the caller's)
        return Run(finished.value, finished.error, seconds, shadow.autocast), shadow.drilled, left_by_shadow


class _ShadowRun:
    """The body of one shadow run, on whichever thread runs it: what it ran under and left behind."""

    def __init__(
        self, plan: Plan, shadow_fn: Callable, snapshot: Callable | None, drill: Any, arguments: tuple | None
    ) -> None:
        self.plan, self.shadow_fn, self.snapshot, self.drill = plan, shadow_fn, snapshot, drill
        self.arguments = arguments  # (the replayed input, where the target replays it)
        self.autocast, self.drilled = "", False
        self.left: TorchGlobals | None = None

    def run(self) -> Any:
        """The shadow function on the plan's arguments (a fire drill's fault injected where it fires); the settings
        it left are taken on its thread (thread-local ones too), and a worker whose run changed one ends with it."""
        plan, drill = self.plan, self.drill
        try:
            self.autocast = autocast_state()
            if drill is not None and drill.kind == "exception":
                self.drilled = True
                drill.before_upstream()
            args, kwargs = self.arguments if self.arguments is not None else plan.upstream_arguments()
            value = self.shadow_fn(*args, **kwargs)
            if self.snapshot is not None:  # (taken on the isolation's stand-ins, before they are put back)
                try:
                    value = self.snapshot(value, args, kwargs)
                except Exception as exc:  # (the target's own code, never the shadow side's outcome)
                    raise IsolationFailed(f"the target's snapshot failed: {exc!r}") from exc
            if drill is not None and drill.kind != "exception":
                value, self.drilled = drill.corrupt(value, (args, kwargs))
            return value
        finally:
            self.left = TorchGlobals()
            if not (plan.here or self.left.same_as(plan.before)):
                leave_worker()


def _raw_signature(experiment: Experiment, args: tuple, kwargs: dict) -> Any:
    """A sampled call's signature by the target's function, checked (:meth:`Experiment.signature_of`): one that
    changed a generator or the grad mode, now or before, names the call "unclassified"."""
    if experiment.target.signature is None:
        return "call"
    if experiment.classifier.has_side_effects:
        return UNCLASSIFIED_SIGNATURE
    try:
        return experiment.classifier.signature_of(args, kwargs)
    except SideEffects:
        return UNCLASSIFIED_SIGNATURE
