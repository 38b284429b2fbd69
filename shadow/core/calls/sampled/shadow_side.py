"""The shadow side of one sampled call: everything after the primary's run (legacy while shadowing, upstream in a
canary), on a worker of its own.

:meth:`ShadowSide.observe` runs the shadow the way the primary ran (on a worker thread, within the deadline,
isolated, from the settings the primary started from), the extra runs the plan drew
(:mod:`~shadow.core.calls.sampled.extra_runs`), compares (:mod:`~shadow.core.calls.sampled.findings`), and returns
the :class:`Observation`. It never publishes and never counts calls: the sampled call does
(:mod:`shadow.core.calls.sampled.call`), and it guards whatever this raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.calls.sampled import findings, guards
from shadow.core.calls.sampled.extra_runs import ExtraRuns
from shadow.core.calls.sampled.guards import IsolationFailed
from shadow.core.calls.sampled.plan import CallContext, Plan, Run, autocast_state
from shadow.core.model.observation import DIVERGENT_OUTCOMES, UPSTREAM, Observation, Outcome, bounded
from shadow.core.model.target import CannotCompare, CannotReplay
from shadow.core.runs.deadline import Finished, run_here
from shadow.core.runs.global_state import TorchGlobals, Writes
from shadow.core.runs.isolation import ArgumentsChanged, holds_hooked_subclass
from shadow.core.runs.sides import Lean, keeping_no_activations, shadow_run

#: Why a call is not compared when another thread changed torch's process-wide settings while its two runs ran.
_FOREIGN = (
    "another thread of the job changed torch's process-wide settings while the call ran twice ({}): the two runs "
    "did not start from the same settings"
)

#: What an allocator's failure says: a device's "out of memory", the host allocator's "can't allocate memory".
_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's failure (a device's or the host's)."""
    text = str(exc).lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or any(words in text for words in _OOM_TEXTS)


def free_after_oom() -> None:
    """Give the accelerator's cached blocks back after the shadow side ran out of memory."""
    with contextlib.suppress(Exception):
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.empty_cache()


@dataclasses.dataclass
class ShadowSide:
    """The shadow side of one sampled call, from its plan (taken before the primary ran)."""

    context: CallContext
    plan: Plan
    #: What the shadow receives, once the primary ran: the isolation's copies, or the plan's arguments
    #: (:meth:`Plan.shadow_arguments`), and what its run is made on (the replayed input where the target replays
    #: it, Target.replay; else the same).
    shadow_arguments: tuple = ()
    run_arguments: tuple = ()
    #: What the shadow run saw where it kept no activations (:func:`~shadow.core.runs.sides.keeping_no_activations`).
    lean: Lean | None = None
    #: The process-wide settings another thread changed while the primary and the shadow ran.
    foreign: list[str] = dataclasses.field(default_factory=list)

    def skipped(self, reason: str, detail: str = "", **fields: Any) -> Observation:
        """The observation of this call skipped for ``reason``."""
        context = self.context
        return Observation(
            context.target.name, Outcome.SKIPPED, (reason,), signature=self.plan.signature, detail=detail,
            timestamp=time.time(), primary=context.primary, **fields,
        )  # fmt: skip

    def observe(
        self, args: tuple, kwargs: dict, primary: Run, left_by_primary: TorchGlobals, primary_changed: bool
    ) -> Observation | DeferredObservation:
        """Run the shadow the way the primary ran and compare the two runs: their results (or exceptions) and the
        torch settings each left behind (``primary`` and ``left_by_primary``: the primary's run; ``primary_changed``:
        those are not the settings it started from), with the bytes by which it raised the devices' peak allocation.
        Never raises: a failure here is the skip its guard says (:mod:`~shadow.core.calls.sampled.guards`)."""
        peaks = _device_peaks()
        try:
            return _with_peak(self._observe(args, kwargs, primary, left_by_primary, primary_changed), peaks)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too
            step = "isolation" if isinstance(exc, IsolationFailed) else "shadow_side"
            if is_oom(exc):  # (the device filled up under the shadow side: its memory, never a fault of ours)
                free_after_oom()
                reason = "oom"
            else:
                reason = guards.failed(self.context.record, step, exc)
            return Observation(
                self.context.target.name, Outcome.SKIPPED, (reason,), signature="", detail=bounded(repr(exc)),
                timestamp=time.time(), primary=self.context.primary,
            )  # fmt: skip

    def _observe(
        self, args: tuple, kwargs: dict, primary: Run, left_by_primary: TorchGlobals, primary_changed: bool
    ) -> Observation | DeferredObservation:
        context = self.context
        snapshot = context.target.snapshot
        if snapshot is not None and primary.error is None:  # (what the primary's run left on the caller's object)
            primary = dataclasses.replace(primary, value=snapshot(primary.value, args, kwargs))
        cannot = self._cannot_run_shadow(primary)
        if cannot is not None:
            return cannot
        shadow, drilled, left_by_shadow, changed = self._shadow_run(left_by_primary, primary_changed)
        if self.lean is not None and self.lean.read:  # (the call reads its graph in the forward: not the same call)
            context.record.keeps_activations.add(self.plan.signature)
            return self.skipped("ineligible", "the call reads its own graph in its forward: its signature's shadow "
                                "runs keep their activations from now on")  # fmt: skip
        if shadow is None:
            return self.skipped("deadline", f"the shadow side took longer than its deadline ({context.deadline:g} s)")
        if self.foreign:  # (the two runs did not start from the same settings: not the same call)
            return self.skipped("ineligible", _FOREIGN.format(", ".join(self.foreign)))
        common = {
            "primary_seconds": primary.seconds,
            "shadow_seconds": shadow.seconds,
            "legacy": context.legacy_origin,
            "drill": drilled,
        }
        if shadow.error is not None and primary.error is None and is_oom(shadow.error):
            del shadow  # its error's traceback holds shadow's tensors
            free_after_oom()
            return self.skipped("oom", **common)
        left = (left_by_primary, left_by_shadow) if changed else None
        return self._compared(args, kwargs, (primary, shadow), left_by_primary, left, common)

    def _compared(
        self,
        args: tuple,
        kwargs: dict,
        ran: tuple[Run, Run],
        left_by_primary: TorchGlobals,
        left: tuple[TorchGlobals, TorchGlobals] | None,
        common: dict,
    ) -> Observation | DeferredObservation:
        """The observation of two runs that both ended (``ran``: the primary's, the shadow's; ``left``: the settings
        each left, None where neither changed one): compared, held against the noise floor, and the extra runs the
        plan drew made. Where no extra run was drawn, no exporter wants a divergence's evidence and the device has
        not finished the comparison, its observation is deferred: read, judged and published once it has
        (:meth:`~shadow.core.calls.record.record.Record.defer`), so the caller never waits for the device."""
        context, plan = self.context, self.plan
        (primary, shadow) = ran
        returned = primary.error is None and shadow.error is None
        canary = context.primary == UPSTREAM
        runs = ran[::-1] if canary else ran  # (legacy's, upstream's)
        if left is not None and canary:
            left = left[::-1]
        drawn = plan.aa or plan.oracle or plan.backward or plan.backward_skip or context.coins.truth is not None
        extra = ExtraRuns(context, plan, left_by_primary) if drawn else None
        aa = extra.aa(runs[0]) if extra is not None and plan.aa and returned else {}
        start = time.perf_counter()
        may_defer = extra is None and not context.record.publisher.wants_evidence
        try:
            finding = findings.judge(
                context, plan, ((args, kwargs), self.shadow_arguments), runs, left, may_defer, bool(common["drill"])
            )
        except CannotCompare as exc:  # (the target's own comparison cannot tell: neither agreement nor divergence)
            return self.skipped("ineligible", bounded(str(exc)), **common)
        if isinstance(finding, findings.PendingFinding):
            return DeferredObservation(
                finding, plan.signature, {**common, "compare_seconds": time.perf_counter() - start}
            )
        found, noise_test, pending, check = finding
        fields: dict[str, Any] = {**common, **aa, "compare_seconds": time.perf_counter() - start, "noise_check": check}
        leaf_errors = tuple(found.leaf_errors) if pending else ()
        if extra is not None:  # (the extra runs the plan drew, and a truth run a difference may draw)
            found, extra_fields = extra.after_comparing(args, kwargs, runs, primary, found, returned)
            # (a gradient difference its floor cannot judge yet is held like a value difference: its own errors)
            pending = pending or extra_fields.pop("noise_pending", False)
            leaf_errors = extra_fields.pop("leaf_errors", leaf_errors)
            noise_test = extra_fields.pop("noise_test", noise_test)
            fields.update(extra_fields)
        # (a replay is of the forward; a pending difference is held, and holds no tensors while it waits)
        if found.outcome in DIVERGENT_OUTCOMES and "grad" not in found.reasons and not pending:
            fields["evidence"] = findings.evidence(context, self.shadow_arguments, *runs)
        return Observation.compared(
            context.target.name, found, plan.signature, context.primary, noise_test=noise_test, noise_pending=pending,
            leaf_errors=leaf_errors, **fields,
        )  # fmt: skip

    def _cannot_run_shadow(self, primary: Run) -> Observation | None:
        """The skip observation of a call whose shadow run would not be faithful, seen once the primary ran: the
        primary returned a tensor subclass with hooks (comparing it would run its code), wrote an argument in place,
        or the argument copies would not fit. None when the shadow can run (the isolation's copies are then
        taken)."""
        plan, environmental = self.plan, self.context.target.environmental
        value = primary.value
        faced_alone = environmental(primary.error) if primary.error is not None and environmental else None
        if faced_alone is not None:  # (the primary met an environment the shadow run never would: not comparable)
            return self.skipped("ineligible", bounded(faced_alone))
        if primary.error is None and type(value) is not torch.Tensor and holds_hooked_subclass(value):
            return self.skipped("mode")
        try:
            if plan.isolation is not None:
                self.shadow_arguments = plan.isolation.take_arguments()
            else:
                self.shadow_arguments = (plan.args, plan.kwargs)
            # (the input the primary read, read once, where the target replays it)
            self.run_arguments = plan.replay() if plan.replay is not None else self.shadow_arguments
        except ArgumentsChanged as exc:
            return self.skipped("inplace", str(exc))
        except CannotReplay as exc:
            return self.skipped("ineligible", bounded(str(exc)))
        except MemoryError as exc:
            return self.failed(exc)
        return None

    def failed(self, failure: BaseException) -> Observation:
        """The observation of a call whose shadow side ran out of memory before comparing (or, anything else, a
        fault of this tool)."""
        if is_oom(failure):
            free_after_oom()
            return self.skipped("oom", bounded(repr(failure)))
        return self.skipped("comparator", bounded(repr(failure)))

    def _shadow_run(
        self, left_by_primary: TorchGlobals, primary_changed: bool
    ) -> tuple[Run | None, bool, TorchGlobals, bool]:
        """The shadow on the plan's arguments, from the torch settings the caller had before the call (the primary's
        start), in the caller's grad mode, isolated where the target asks for it; whether a fire drill corrupted
        it; the torch settings it left behind (the primary's are put back before this returns); and whether either
        run left a setting changed. The run is None where it passed its deadline. A call that cannot block runs
        here, on the caller's thread."""
        context, plan, record = self.context, self.plan, self.context.record
        isolated = plan.isolation.shadow_run() if plan.isolation is not None else contextlib.nullcontext()
        drill = context.drill if context.drill is not None and context.drill.fires() else None
        if primary_changed:  # (the primary changed a setting: the shadow starts where it did)
            record.put_back(plan.before, plan.written)
        # (compared forward only: its activations are not kept, and the job's memory holds one forward's, not two)
        if not plan.backward and torch.is_grad_enabled() and plan.signature not in record.keeps_activations:
            self.lean = Lean()
        shadow = _ShadowRun(context.shadow_fn, context.target.snapshot, drill, self.run_arguments, self.lean)
        start = time.perf_counter()
        finished = Finished(False)
        # (a consumed argument, a stream: where the primary left it, put back once the shadow read it from the start)
        left_there = context.target.rewind(*self.shadow_arguments) if plan.rewind is not None else None
        try:
            if plan.rewind is not None:
                plan.rewind()
            with isolated, shadow_run(context.experiment) as run:
                if plan.here:
                    with Writes() as writes:
                        finished = run_here(shadow.run)
                    shadow.left = TorchGlobals()
                    plan.written.update(writes.names)
                else:
                    finished = context.within_deadline(
                        run, context.experiment, plan.before, shadow.run, plan.written, shadow.settled
                    )
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the isolation's own failure (the shadow's are in finished): a fault of ours,
            record.put_back(left_by_primary, plan.written)  # counted as a "comparator" skip, never a side's exception
            raise IsolationFailed(f"the isolation of the shadow run failed: {exc!r}") from exc
        finally:
            if left_there is not None:
                left_there()
        if isinstance(finished.error, IsolationFailed):
            record.put_back(left_by_primary, plan.written)
            raise finished.error
        seconds = time.perf_counter() - start
        left_by_shadow = shadow.left if shadow.left is not None and finished.finished else TorchGlobals()
        # (a process-wide setting the shadow run did not write, changed meanwhile, is another thread's: no difference
        # of the call's, but the two runs may have read it differently)
        left_by_shadow, self.foreign = left_by_shadow.attributed(plan.written, left_by_primary, plan.before)
        changed = primary_changed or not left_by_shadow.same_as(plan.before)
        if changed or not finished.finished:  # (where neither run changed a setting, they are as the primary left)
            record.put_back(left_by_primary, plan.written)
        if not finished.finished:
            return None, shadow.drilled, left_by_shadow, changed
        # (SystemExit, GeneratorExit: the shadow's outcome, never the caller's)
        return Run(finished.value, finished.error, seconds, shadow.autocast), shadow.drilled, left_by_shadow, changed


@dataclasses.dataclass
class _ShadowRun:
    """The body of one shadow run (the shadow function on ``arguments``, its snapshot taken, a drill's fault
    injected), on whichever thread runs it: what it ran under and left behind."""

    shadow_fn: Callable
    snapshot: Callable | None
    drill: Any
    arguments: tuple[tuple, dict]
    lean: Lean | None = None
    autocast: str = ""
    drilled: bool = False
    left: TorchGlobals | None = None

    def run(self) -> Any:
        """The shadow function on the plan's arguments (a fire drill's fault injected where it fires)."""
        drill = self.drill
        self.autocast = autocast_state()
        if drill is not None and drill.kind == "exception":
            self.drilled = True
            drill.before_upstream()
        args, kwargs = self.arguments
        with keeping_no_activations(self.lean):
            value = self.shadow_fn(*args, **kwargs)
        if self.snapshot is not None:  # (taken on the isolation's stand-ins, before they are put back)
            try:
                value = self.snapshot(value, args, kwargs)
            except Exception as exc:  # (the target's own code, never the shadow side's outcome)
                raise IsolationFailed(f"the target's snapshot failed: {exc!r}") from exc
        if drill is not None and drill.kind != "exception":
            value, self.drilled = drill.corrupt(value, (args, kwargs))
        return value

    def settled(self, left: TorchGlobals) -> None:
        """The settings the run left, taken on its thread (thread-local ones too) once it ended."""
        self.left = left


@dataclasses.dataclass
class DeferredObservation:
    """A sampled call's observation whose comparison the device has not finished when the call returns: read,
    judged and made once it has (the record publishes it then: :meth:`Record.defer`). Holds the comparison's
    statistics and the call's plain fields, never either run's tensors."""

    finding: findings.PendingFinding
    signature: str
    fields: dict[str, Any]

    def ready(self) -> bool:
        """Whether the device finished the comparison (never waits)."""
        return self.finding.ready()

    def observation(self) -> Observation:
        """The observation, once the comparison is read (waiting for the device where it has not finished)."""
        found, noise_test, pending, check = self.finding.finish()
        leaf_errors = tuple(found.leaf_errors) if pending else ()
        context = self.finding.context
        return Observation.compared(
            context.target.name, found, self.signature, context.primary, noise_test=noise_test, noise_pending=pending,
            leaf_errors=leaf_errors, noise_check=check, **self.fields,
        )  # fmt: skip

    def failed(self, failure: BaseException) -> Observation:
        """The observation of a deferred comparison whose reading failed: this tool's fault, counted as a
        ``comparator`` skip (:mod:`~shadow.core.calls.sampled.guards`)."""
        context = self.finding.context
        reason = guards.failed(context.record, "shadow_side", failure)
        return Observation(
            context.target.name, Outcome.SKIPPED, (reason,), signature=self.signature, detail=bounded(repr(failure)),
            timestamp=time.time(), primary=context.primary,
        )  # fmt: skip


def _per_device(counter: str) -> tuple[int, ...]:
    """An allocator's ``counter`` (``memory_allocated``, ``max_memory_allocated``) of each device of the accelerator,
    read without waiting for the device; () without an accelerator or where its module does not say."""
    accelerator = torch.accelerator.current_accelerator()
    read = getattr(getattr(torch, accelerator.type, None), counter, None) if accelerator else None
    if read is None:
        return ()
    try:
        return tuple(int(read(index)) for index in range(torch.accelerator.device_count()))
    except Exception:  # (a device module that cannot say: nothing measured)
        return ()


def _device_peaks() -> tuple[int, ...]:
    """Each accelerator device's peak allocated bytes."""
    return _per_device("max_memory_allocated")


def device_allocated() -> int:
    """Bytes allocated on the accelerator's devices together (0 without one, or where its module does not say)."""
    return sum(_per_device("memory_allocated"))


def _with_peak(
    observation: Observation | DeferredObservation, before: tuple[int, ...]
) -> Observation | DeferredObservation:
    """``observation`` with the bytes by which its shadow side raised the devices' peak allocation (from
    ``before`` it to now: :func:`_device_peaks`)."""
    raised = sum(max(0, end - start) for start, end in zip(before, _device_peaks(), strict=False))
    if not raised:
        return observation
    if isinstance(observation, DeferredObservation):
        observation.fields["shadow_peak_bytes"] = raised
        return observation
    return dataclasses.replace(observation, shadow_peak_bytes=raised)
