"""The upstream side of one sampled call: everything that runs after legacy, in a room of its own.

An :class:`UpstreamSide` is made for each sampled call before legacy runs (its :class:`Plan`: the isolation, the
signature, the settings legacy starts from, whether the oracle and the A/A run join in). Once legacy has run,
:meth:`UpstreamSide.observe` runs the shadow side the way legacy ran (on a thread of its own, within the deadline,
isolated), the A/A run and the single-device oracle where the plan asks for them, compares, and returns the
:class:`Observation`. It never publishes and never counts calls: the experiment that made it does
(:mod:`shadow.core.calls.engine`), and it catches whatever this room raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from shadow.core.calls.coin import Coin
from shadow.core.judging.compare import Comparison, compare, compare_custom, compare_exceptions, with_state
from shadow.core.judging.gradients import GradientComparison, compare_gradients, names_of, vjp
from shadow.core.judging.noise import NoiseFloor
from shadow.core.judging.truth import in_float64, judge, judge_both, run_upcast
from shadow.core.model.observation import (
    DIVERGENT_OUTCOMES,
    SHARED_DIVERGENCE_REASONS,
    UNCLASSIFIED_SIGNATURE,
    UPSTREAM,
    Evidence,
    Observation,
    Outcome,
    bounded,
    label_text,
    within_noise_floor,
)
from shadow.core.model.targets import Target
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs.deadline import Finished, leave_room, room, run_here, run_within
from shadow.core.runs.global_state import IMPORT_TIME_SETTINGS, TorchGlobals
from shadow.core.runs.isolation import ArgumentsChanged, Isolation, SideEffects, detach_tensors, find_modules
from shadow.core.runs.sides import LEGACY_AGAIN, current_run, marks, upstream_run
from shadow.core.support import trees

_PLAIN_TORCH_FUNCTION = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def is_hooked_subclass(leaf: Any) -> bool:
    """A tensor subclass with its own __torch_function__ or __torch_dispatch__ (nn.Parameter has neither)."""
    cls = type(leaf)
    if cls is torch.Tensor or not isinstance(leaf, torch.Tensor):
        return False
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    return function not in _PLAIN_TORCH_FUNCTION or cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


class IsolationFailed(RuntimeError):
    """Setting up or undoing the shadow run's isolation, or taking its snapshot, failed: this tool's (or the
    target's) fault, the call skipped as "comparator" (never compared as the shadow side's exception)."""


def _as_it_is(value: Any) -> Any:
    return value


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


def _any_sparse(grads: dict[int, torch.Tensor | None]) -> bool:
    return any(grad is not None and grad.layout != torch.strided for grad in grads.values())


def _backward_skip(failure: BaseException | None, ours: bool = False) -> str:
    """Why a backward comparison could not be made, from what its run (or, ``ours``, this tool) raised: one of
    BACKWARD_SKIP_REASONS."""
    text = str(failure).lower()
    if "checkpoint" in text and ("reentrant" in text or ".grad()" in text):
        return "reentrant"
    if "sparse" in text:
        return "sparse"
    return "failed" if ours else "raised"


def _value_difference(found: Comparison) -> bool:
    """A difference in value alone: where a float64 run can tell which side is nearer the truth."""
    return found.outcome == Outcome.CLOSE or (found.outcome == Outcome.MISMATCH and found.reasons == ("value",))


def autocast_state() -> str:
    """The autocast state of the CPU and the accelerator, as text (``cpu=off, npu=on/float16``)."""
    accelerator = torch.accelerator.current_accelerator()
    device_types = ["cpu"] + ([accelerator.type] if accelerator is not None else [])
    if "cuda" not in device_types and torch.is_autocast_enabled("cuda"):  # (the flag parallel_apply reads)
        device_types.append("cuda")

    def state(device_type: str) -> str:
        if not torch.is_autocast_enabled(device_type):
            return "off"
        return "on/" + str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")

    return ", ".join(f"{t}={state(t)}" for t in device_types)


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
    before: TorchGlobals
    #: The runs that join the shadow run, each in an isolated slot of its own (where the target is isolated), by
    #: name: the single-device oracle's, the backward comparison's legacy run (for a graph of its own), the A/A run
    #: (legacy a second time: the noise floor).
    extra: tuple[str, ...] = ()
    here: bool = False  # upstream cannot block (Target.never_blocks): it runs on the caller's thread
    backward_skip: str = ""  # a backward comparison drawn for a call that can have none (grad mode off)
    rewind: Callable[[], Any] | None = None  # puts the call's consumed arguments back where legacy found them
    modules_loaded: int = dataclasses.field(default_factory=lambda: len(sys.modules))

    @property
    def slots(self) -> tuple[str, ...]:
        """The isolated runs after legacy, in the isolation's order: the shadow run's, then the extra ones."""
        return (SHADOW, *self.extra)

    oracle = property(lambda self: ORACLE in self.extra, doc="Whether the single-device oracle runs.")
    backward = property(lambda self: BACKWARD in self.extra, doc="Whether the backward comparison runs.")
    aa = property(lambda self: AA in self.extra, doc="Whether the A/A run runs.")

    def upstream_arguments(self) -> tuple[tuple, dict]:
        """What upstream receives: the isolation's copies (once taken), or the arguments above."""
        return self.isolation.arguments(0) if self.isolation is not None else (self.args, self.kwargs)

    def stand_ins(self, slot: str) -> dict[int, torch.Tensor]:
        """The isolation's stand-ins of the tensors that require grad, in the run of ``slot``."""
        assert self.isolation is not None
        return self.isolation.stand_ins(self.slots.index(slot))

    @contextlib.contextmanager
    def in_slot(self, slot: str) -> Iterator[tuple[tuple, dict]]:
        """While the body runs, the isolation's world of the run of ``slot`` (its copies swapped in); it gets that
        run's arguments (the arguments as they are where the target is not isolated)."""
        if self.isolation is None:
            yield self.upstream_arguments()
            return
        index = self.slots.index(slot)
        with self.isolation.upstream_run(index):
            yield self.isolation.arguments(index)


#: The isolated runs of a sampled call, by name (:attr:`Plan.slots`).
SHADOW, ORACLE, BACKWARD, AA = "shadow", "oracle", "backward", "aa"

#: What a failure in each part of a sampled call's shadow side becomes: the monitor's failures are never a side's
#: outcome. The plan, the isolation and a target's snapshot: the call is skipped as "comparator" (counted; see
#: :class:`IsolationFailed`). An extra run's (the A/A run, the oracle, the backward comparison, the truth run):
#: its finding alone is lost, said in the log (at most once a minute) with the message below.
GUARDS: dict[str, str] = {
    "plan": "skip: comparator",
    "isolation": "skip: comparator",
    AA: "A/A run failed: %r",
    ORACLE: "single-device oracle failed: %r",
    BACKWARD: "backward comparison failed: %r",
    "truth": "float64 truth run failed: %r",
}


class Experiment(Protocol):
    """What the room reads of the experiment that made it (:class:`shadow.core.calls.engine.Experiment`)."""

    target: Target
    tolerance: ToleranceSpec
    legacy: Callable
    legacy_origin: str
    shadow_fn: Callable
    primary: str
    drill: Any
    deadline: float | None
    oracle_coin: Coin | None
    aa_coin: Coin
    backward_coin: Coin
    truth_coin: Coin
    noise: NoiseFloor
    signature_has_side_effects: bool

    def admit(self, signature: str) -> str: ...
    def signature_of(self, args: tuple, kwargs: dict) -> Any: ...
    def put_back(self, settings: TorchGlobals) -> bool: ...
    def log_limited(self, kind: str, message: str, *args: Any) -> None: ...
    def count_oracle_run(self) -> None: ...
    def deadline_missed(self) -> None: ...


class UpstreamSide:
    """The upstream side of one sampled call of ``experiment``'s target: planned before legacy runs
    (:meth:`plan`), observed after it (:meth:`observe`)."""

    def __init__(self, experiment: Experiment, plan: Plan | BaseException) -> None:
        self.experiment = experiment
        #: The plan, or the exception taking it raised (the call is then skipped as this tool's fault).
        self.plan = plan

    @classmethod
    def plan_call(
        cls, experiment: Experiment, args: tuple, kwargs: dict, modules: list[torch.nn.Module], signature: str | None
    ) -> UpstreamSide:
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
                signature = experiment.admit(label_text(str(_raw_signature(experiment, args, kwargs)), 64))
            rewind = target.rewind(args, kwargs) if target.rewind is not None else None
            # (a run that reads the caller's stream is never left running past a deadline: it would move the
            # stream under the job later; it runs on the caller's thread)
            here = rewind is not None or (target.never_blocks is not None and bool(target.never_blocks(args, kwargs)))
            plan = Plan(
                isolation, up_args, up_kwargs, signature, autocast, before, extra, here,
                backward_skip="no_grad" if drawn and not backward else "", rewind=rewind,
            )  # fmt: skip
            return cls(experiment, plan)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            return cls(experiment, exc)

    # ------------------------------------------------------------------ observing

    def observe(self, args: tuple, kwargs: dict, legacy: Run, left_by_legacy: TorchGlobals) -> Observation:
        """Run upstream the way legacy ran and compare the two runs: their results (or exceptions) and the torch
        settings each left behind (``legacy`` and ``left_by_legacy`` are the primary's run: upstream's in a
        canary)."""
        experiment, plan = self.experiment, self.plan
        now = time.time()
        if isinstance(plan, BaseException):
            return self._skipped(plan, timestamp=now)
        snapshot = experiment.target.snapshot
        if snapshot is not None and legacy.error is None:  # (what the primary's run left on the caller's object)
            legacy = dataclasses.replace(legacy, value=snapshot(legacy.value, args, kwargs))
        cannot = self._cannot_run_upstream(plan, legacy, now)
        if cannot is not None:
            return cannot
        upstream, drilled, left_by_upstream = self._run_upstream(plan, left_by_legacy)
        if upstream is None:
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
        runs, left = (legacy, upstream), (left_by_legacy, left_by_upstream)
        if experiment.primary == UPSTREAM:
            runs, left = runs[::-1], left[::-1]
        aa = self._aa_run(plan, runs[0], left_by_legacy) if plan.aa and returned else {}
        start = time.perf_counter()
        found = self._compare_runs(plan, args, kwargs, *runs)
        found = with_state(found, {**self._state_differences(plan, *left), **self._module_differences(plan)})
        found, noise_test, pending = self._within_noise(plan.signature, found)
        compare_seconds = time.perf_counter() - start
        backward: dict[str, Any] = {"backward_skip": plan.backward_skip}
        if plan.backward and not returned:
            backward = {"backward_skip": "raised"}
        elif plan.backward and found.outcome not in (Outcome.MATCH, Outcome.CLOSE, Outcome.NOISE):
            backward = {"backward_skip": "diverged"}  # (the forward is the finding; its gradients are not)
        elif plan.backward:
            found, backward = self._backward(plan, args, kwargs, upstream, left_by_legacy, found)
        truth = {}
        if (
            experiment.truth_coin.rate > 0
            and experiment.target.plain
            and returned
            and _value_difference(found)
            and experiment.truth_coin.flip()
        ):
            truth = self._truth(plan, args, kwargs, runs[0].value, runs[1].value, left_by_legacy)
        shared = {}
        if plan.oracle and returned and found.outcome in (Outcome.MATCH, Outcome.CLOSE):
            shared = self._single_device(plan, legacy.value, left_by_legacy)
        evidence = None
        # (a replay is of the forward; a pending difference is held, and holds no tensors while it waits)
        if found.outcome in DIVERGENT_OUTCOMES and "grad" not in found.reasons and not pending:
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
            noise_pending=pending,
            leaf_errors=tuple(found.leaf_errors) if pending else (),
            **shared,
            **aa,
            **backward,
            **truth,
            **common,
        )

    def _cannot_run_upstream(self, plan: Plan, legacy: Run, now: float) -> Observation | None:
        """The skip observation of a call whose upstream run would not be faithful, seen once legacy ran: legacy
        returned a tensor subclass with hooks (comparing it would run its code), wrote an argument in place, or the
        argument copies would not fit. None when upstream can run (the isolation's copies are then taken)."""
        experiment = self.experiment
        if legacy.error is None and any(map(is_hooked_subclass, trees.leaves(legacy.value))):
            return Observation(
                experiment.target.name, Outcome.SKIPPED, ("mode",), signature=plan.signature, timestamp=now,
                primary=experiment.primary,
            )  # fmt: skip
        if plan.isolation is None:
            return None
        try:
            plan.isolation.take_arguments()
        except ArgumentsChanged as exc:
            return Observation(
                experiment.target.name, Outcome.SKIPPED, ("inplace",), signature=plan.signature, detail=str(exc),
                timestamp=now, primary=experiment.primary,
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

    # ------------------------------------------------------------------ the runs after legacy

    def _within_deadline(
        self, side: object, before: TorchGlobals, body: Callable[[], Any], checks_its_settings: bool = False
    ) -> Finished:
        """``body()`` (a run of the shadow side, as ``side``'s upstream side, from the settings ``before``, which
        this thread has written already): on a daemon thread of the shadow side's, waited for at most the deadline
        (:mod:`shadow.core.runs.deadline`; without one, until it ends). Past the deadline the run is abandoned and the
        target stops shadowing (:meth:`Experiment.deadline_missed`). An interrupt the body raised is raised here, as
        it would be on the caller's thread. A run that leaves a setting of its thread changed ends its room (the
        body says so itself where ``checks_its_settings``)."""
        experiment = self.experiment
        run = current_run()

        def start() -> None:
            marks.upstream_side, marks.run = side, run
            # (a room whose run changed a setting ends with it: a room kept holds what its last run started from)
            known = getattr(room, "settings", None)
            if known is not None and known.same_as(before):
                return
            if experiment.put_back(before):  # (on the room: its thread-local settings the caller's)
                room.settings = before
            else:
                leave_room()

        def checked() -> Any:
            try:
                return body()
            finally:
                if not TorchGlobals().same_as(before):
                    leave_room()

        found = run_within(experiment.deadline, body if checks_its_settings else checked, start=start)
        if isinstance(found.error, KeyboardInterrupt):
            raise found.error
        if not found.finished:
            experiment.deadline_missed()
        return found

    def _run_upstream(self, plan: Plan, left_by_legacy: TorchGlobals) -> tuple[Run | None, bool, TorchGlobals]:
        """Upstream on the plan's arguments, from the torch settings the caller had before the call (legacy's
        start), in the caller's grad mode, isolated where the target asks for it; whether a fire drill corrupted
        it; and the torch settings it left behind (legacy's are put back before this returns). The run is None
        where it passed its deadline. A call that cannot block runs here, on the caller's thread."""
        experiment = self.experiment
        context = plan.isolation.upstream_run() if plan.isolation is not None else contextlib.nullcontext()
        drill = experiment.drill if experiment.drill is not None and experiment.drill.fires() else None
        drilled = False
        autocast = ""
        if not left_by_legacy.same_as(plan.before):  # (legacy changed a setting: upstream starts where it did)
            experiment.put_back(plan.before)
        shadow_fn = experiment.shadow_fn
        snapshot = experiment.target.snapshot

        left: TorchGlobals | None = None

        def body() -> Any:
            nonlocal autocast, drilled, left
            try:
                autocast = autocast_state()
                if drill is not None and drill.kind == "exception":
                    drilled = True
                    drill.before_upstream()
                args, kwargs = plan.upstream_arguments()
                value = shadow_fn(*args, **kwargs)
                if snapshot is not None:  # (taken on the isolation's stand-ins, before they are put back)
                    try:
                        value = snapshot(value, args, kwargs)
                    except Exception as exc:  # (the target's own code, never the shadow side's outcome)
                        raise IsolationFailed(f"the target's snapshot failed: {exc!r}") from exc
                if drill is not None and drill.kind != "exception":
                    value, drilled = drill.corrupt(value, (args, kwargs))
                return value
            finally:
                left = TorchGlobals()  # (on the thread that ran it: its thread-local settings too)
                if not (plan.here or left.same_as(plan.before)):
                    leave_room()

        start = time.perf_counter()
        finished = Finished(False)
        # (a consumed argument, a stream: where legacy left it, put back once the shadow run read it from the start)
        left_there = experiment.target.rewind(*plan.upstream_arguments()) if plan.rewind is not None else None
        try:
            if plan.rewind is not None:
                plan.rewind()
            with context, upstream_run(experiment):
                if plan.here:
                    finished = run_here(body)
                else:
                    finished = self._within_deadline(experiment, plan.before, body, checks_its_settings=True)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the isolation's own failure (upstream's are in finished): a fault of ours,
            experiment.put_back(left_by_legacy)  # counted as a "comparator" skip, never a side's exception
            raise IsolationFailed(f"the isolation of the shadow run failed: {exc!r}") from exc
        finally:
            if left_there is not None:
                left_there()
        if isinstance(finished.error, IsolationFailed):
            experiment.put_back(left_by_legacy)
            raise finished.error
        seconds = time.perf_counter() - start
        left_by_upstream = left if left is not None and finished.finished else TorchGlobals()
        unchanged = left_by_legacy.same_as(plan.before) and left_by_upstream.same_as(plan.before)
        if not (finished.finished and unchanged):  # (where neither run changed a setting, they are as legacy left)
            experiment.put_back(left_by_legacy)
        if not finished.finished:
            return None, drilled, left_by_upstream
        # (SystemExit, GeneratorExit: upstream's outcome, never the caller's)
        return Run(finished.value, finished.error, seconds, autocast), drilled, left_by_upstream

    def _extra_run(
        self,
        plan: Plan,
        left_by_legacy: TorchGlobals,
        side: object,
        on: Callable[[], contextlib.AbstractContextManager[Any]],
        run: Callable[[Any], Any],
        backward: bool = False,
    ) -> Finished | None:
        """One run after the shadow run, the way every extra run is made: from the settings legacy started from,
        within ``on()`` (a context giving what the run is made on: an isolation slot's arguments, float64 copies;
        None: nothing to run, and None is returned), as one of ``side``'s runs (``backward``: a backward
        comparison's), within the deadline; the settings legacy left are put back after, whatever happens."""
        experiment = self.experiment
        experiment.put_back(plan.before)
        try:
            with on() as bound, upstream_run(side, backward=backward):
                if bound is None:
                    return None
                return self._within_deadline(side, plan.before, lambda: run(bound))
        finally:
            experiment.put_back(left_by_legacy)

    def _guarded(
        self, kind: str, work: Callable[[], dict[str, Any] | None], **failed: Callable[[BaseException], Any]
    ) -> dict[str, Any]:
        """``work()``'s Observation fields, with the seconds it took as ``<kind>_seconds`` (none where it returns
        None: nothing ran). A failure of an extra run is this tool's: its finding is lost (the fields are then
        ``failed``'s, each made from the failure), said in the log (:data:`GUARDS`)."""
        start = time.perf_counter()
        try:
            fields = work()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.experiment.log_limited(kind, GUARDS[kind], exc)
            fields = {name: make(exc) for name, make in failed.items()}
        if fields is None:
            return {}
        return {**fields, f"{kind}_seconds": time.perf_counter() - start}

    def _backward(
        self, plan: Plan, args: tuple, kwargs: dict, upstream: Run, left_by_legacy: TorchGlobals, found: Comparison
    ) -> tuple[Comparison, dict[str, Any]]:
        """The backward comparison (:mod:`shadow.core.judging.gradients`): legacy again, isolated, for a graph of
        its own, and the same seeded products through both graphs; the comparison turned into a ``grad`` mismatch
        where they differ, and the Observation fields of the backward run."""
        experiment = self.experiment
        seed = experiment.backward_coin.bits(40)

        def gradients() -> dict[str, Any]:
            ran = self._extra_run(
                plan, left_by_legacy, LEGACY_AGAIN, lambda: plan.in_slot(BACKWARD),
                lambda on: vjp(experiment.legacy(*on[0], **on[1]), plan.stand_ins(BACKWARD), seed), backward=True,
            )  # fmt: skip
            theirs = Finished(False)
            if ran is not None and ran.finished:
                theirs = self._extra_run(
                    plan, left_by_legacy, experiment, lambda: contextlib.nullcontext(True),
                    lambda _: vjp(upstream.value, plan.stand_ins(SHADOW), seed), backward=True,
                )  # fmt: skip
            return {"compared": _gradients_compared(ran, theirs, names_of(args, kwargs), experiment.tolerance)}

        fields = self._guarded(BACKWARD, gradients, compared=lambda exc: (None, _backward_skip(exc, ours=True)))
        compared, skip = fields.pop("compared")
        fields.update({"backward": compared is not None, "backward_skip": skip if compared is None else ""})
        if compared is not None and compared.outcome == Outcome.MISMATCH.value:
            detail = "; ".join(part for part in (compared.detail, found.detail) if part)
            found = dataclasses.replace(
                found, outcome=Outcome.MISMATCH.value, reasons=("grad",), detail=bounded(detail),
                max_abs_error=max(found.max_abs_error, compared.max_abs_error),
                max_rel_error=max(found.max_rel_error, compared.max_rel_error),
            )  # fmt: skip
        return found, fields

    def _truth(
        self, plan: Plan, args: tuple, kwargs: dict, legacy: Any, upstream: Any, left_by_legacy: TorchGlobals
    ) -> dict[str, Any]:
        """The float64 CPU runs (:mod:`shadow.core.judging.truth`: the single-device call's, or each side's code
        path's) and each side's error against them: the Observation fields (none where the results cannot be
        paired with them)."""
        experiment, target = self.experiment, self.experiment.target

        def truth() -> dict[str, Any]:
            with torch.no_grad():  # (the single-device call's scatter: no graph on the caller's inputs)
                call = target.oracle(args, kwargs) if target.oracle is not None else None
            if call is not None:
                paths, on, parts = [(call.module, experiment)], (call.args, call.kwargs), call.legacy_part
            else:
                # (legacy's path as the A/A run runs it: the calls it makes of wrapped functions are legacy's)
                paths = [(target.upstream, experiment), (experiment.legacy, LEGACY_AGAIN)]
                on, parts = (args, kwargs), (lambda result, truth: result)
            truths = []
            for function, side in paths:
                ran = self._extra_run(
                    plan, left_by_legacy, side, functools.partial(in_float64, function, *on),
                    functools.partial(_upcast_run, function),
                )  # fmt: skip
                if ran is None or not ran.finished or ran.error is not None:
                    return {}
                truths.append(ran.value)
            if len(truths) == 1:
                judged = judge(parts(legacy, truths[0]), parts(upstream, truths[0]), truths[0])
            else:
                judged = judge_both(legacy, upstream, legacy_truth=truths[1], upstream_truth=truths[0])
            if judged is None:
                return {}
            return {
                "nearer": judged.nearer,
                "legacy_truth_error": judged.legacy_error,
                "upstream_truth_error": judged.upstream_error,
            }

        return self._guarded("truth", truth)

    def _aa_run(self, plan: Plan, legacy: Run, left_by_legacy: TorchGlobals) -> dict[str, Any]:
        """Legacy once more (legacy, whatever the primary: the noise floor is the reference's own variation), from
        the same start and as isolated as the shadow run, compared with legacy's result (``legacy``): the
        Observation fields of the A/A run, its errors added to the noise floor. Legacy raising the second time is
        noise of a kind not measured: the finding is lost."""
        experiment = self.experiment

        def aa() -> dict[str, Any]:
            # (a run of its own: the calls legacy makes of wrapped functions are nested calls, never upstream's)
            on, again = (lambda: plan.in_slot(AA)), (lambda on: experiment.legacy(*on[0], **on[1]))
            ran = self._extra_run(plan, left_by_legacy, LEGACY_AGAIN, on, again)
            if ran is None or not ran.finished:
                return {}
            if ran.error is not None:
                raise ran.error
            found = compare(legacy.value, ran.value, tolerance=experiment.tolerance, exact=True)
            differs = found.outcome != Outcome.MATCH
            abs_error = found.max_abs_error if differs else 0.0
            rel_error = found.max_rel_error if differs else 0.0
            experiment.noise.add_aa(plan.signature, found.leaf_errors, rel_error, differs)
            return {"aa": True, "aa_abs_error": abs_error, "aa_rel_error": rel_error}

        return self._guarded(AA, aa)

    def _single_device(self, plan: Plan, legacy_result: Any, left_by_legacy: TorchGlobals) -> dict[str, Any]:
        """Run the call's replica 0 on its own device, isolated and from the same settings as the upstream run,
        and compare legacy's replica-0 output with it: the Observation fields of a shared divergence (none if
        they agree)."""
        experiment = self.experiment

        @contextlib.contextmanager
        def single_device() -> Iterator[Any]:
            with plan.in_slot(ORACLE) as (args, kwargs):
                yield experiment.target.oracle(args, kwargs)  # (None: the call has no single-device equivalent)

        def oracle() -> dict[str, Any]:
            ran = self._extra_run(plan, left_by_legacy, experiment, single_device, lambda call: (call, call.run()))
            if ran is None:
                return None  # (no single-device equivalent: no oracle run)
            if not ran.finished:
                return {}
            if ran.error is not None:
                raise ran.error
            call, single = ran.value
            experiment.count_oracle_run()
            found = compare(call.legacy_part(legacy_result, single), single, tolerance=experiment.tolerance)
            if found.outcome != Outcome.MISMATCH:
                return {}
            reason = next((r for r in found.reasons if r in SHARED_DIVERGENCE_REASONS), "value")
            return {
                "shared_divergence": reason,
                "shared_detail": bounded(f"legacy and upstream agree; replica 0 alone on its device: {found.detail}"),
            }

        return self._guarded(ORACLE, oracle)

    # ------------------------------------------------------------------ comparing

    def _compare_runs(self, plan: Plan, args: tuple, kwargs: dict, legacy: Run, upstream: Run) -> Comparison:
        """Legacy's result against upstream's (with both runs' autocast state where they mismatch), or the one rule
        for exceptions where either raised."""
        if legacy.error is not None or upstream.error is not None:
            return compare_exceptions(legacy.error, upstream.error)
        target = self.experiment.target
        if target.compare is not None:
            return compare_custom(target.compare, legacy.value, upstream.value)
        found = compare(
            legacy.value,
            upstream.value,
            tolerance=self.experiment.tolerance,
            exact=target.exact,
            legacy_inputs=(args, kwargs),
            upstream_inputs=plan.upstream_arguments(),
        )
        if found.outcome == Outcome.MISMATCH:
            autocast = f"autocast legacy: {plan.autocast}; upstream: {upstream.autocast}"
            found = dataclasses.replace(found, detail=bounded(f"{found.detail} | {autocast}"))
        return found

    @staticmethod
    def _state_differences(plan: Plan, first: TorchGlobals, second: TorchGlobals) -> dict[str, tuple[Any, Any]]:
        """The settings the two runs left differently, less those a module's first import writes (warning
        filters) where the first run imported modules: the second, started from the state before it, finds them
        imported and cannot write them again."""
        if first.same_as(second):
            return {}
        found = first.differences(second)
        if len(sys.modules) != plan.modules_loaded:
            for name in IMPORT_TIME_SETTINGS:
                found.pop(name, None)
        return found

    def _module_differences(self, plan: Plan) -> dict[str, tuple[str, str]]:
        """The module attributes the two runs left differently (:func:`shadow.core.runs.isolation.module_differences`),
        as (legacy's, upstream's)."""
        found = plan.isolation.module_differences if plan.isolation is not None else {}
        if found and self.experiment.primary == UPSTREAM:  # (the isolated run was legacy's)
            return {name: (b, a) for name, (a, b) in found.items()}
        return found

    def _within_noise(self, signature: str, found: Comparison) -> tuple[Comparison, str, bool]:
        """(the comparison, the noise test as text, whether it is pending): a value mismatch (nothing else) is
        reported as noise while the noise floor says legacy differs from itself as much
        (:mod:`shadow.core.judging.noise`),
        and is pending while the floor cannot judge it yet (too few A/A runs: the engine holds it until it can).
        Anything beyond the floor, or of another kind, stays a mismatch. Every value comparison's errors join the
        A/B sample."""
        experiment = self.experiment
        if not experiment.aa_coin.rate:  # (no A/A runs: no floor, nothing is noise, and no sample is kept)
            return found, "", False
        noise_floor = experiment.noise
        if found.outcome in (Outcome.MATCH, Outcome.CLOSE) or set(found.reasons) == {"value"}:
            noise_floor.add_ab(signature, found.leaf_errors)
        if found.outcome != Outcome.MISMATCH or set(found.reasons) != {"value"}:
            return found, "", False
        noise, test = noise_floor.judge(signature, found.leaf_errors)
        if noise is None:
            return found, test, True
        if not noise:
            return found, test, False
        return within_noise_floor(found, test), test, False

    def _evidence(self, plan: Plan, legacy: Run, upstream: Run) -> Evidence:
        """What a repro capture needs: the inputs as upstream received them, both outputs, the module state."""
        experiment = self.experiment
        args, kwargs = plan.upstream_arguments()
        modules = find_modules((args, kwargs))
        clean = experiment.target.clean or _as_it_is
        with torch._C.DisableTorchFunction():  # (no subclass sees the detach)
            upstream_value = trees.map_only(torch.Tensor, torch.Tensor.detach, clean(upstream.value))
        try:
            module_state = modules[0].state_dict() if modules else None
        except Exception as exc:  # the user's state_dict: its failure loses the state, never the observation
            experiment.log_limited("state_dict", "module state for the capture failed: %r", exc)
            module_state = None
        return Evidence(
            args,
            kwargs,
            legacy=legacy.error or clean(legacy.value),
            # (detached: the evidence never keeps upstream's autograd graph alive)
            upstream=upstream.error or upstream_value,
            module_state=module_state,
            legacy_fn=experiment.legacy,
            upstream_fn=experiment.target.upstream,
            exact=experiment.target.exact,
            device=_current_device(),
        )


def _upcast_run(function: Callable, on: tuple[tuple, dict]) -> Any:
    """``function`` on the float64 copies ``on`` (args, kwargs), without a graph or autocast."""
    return run_upcast(function, *on)


def _gradients_compared(
    ran: Finished | None, theirs: Finished, names: Any, tolerance: ToleranceSpec
) -> tuple[GradientComparison | None, str]:
    """(the gradients compared, or None with the reason a backward comparison could not be made) from legacy's
    and upstream's vector-Jacobian products."""
    if ran is None or not (ran.finished and theirs.finished):
        return None, "deadline"
    if ran.error is not None or theirs.error is not None:
        if type(ran.error) is not type(theirs.error):
            detail = bounded("backward: " + compare_exceptions(ran.error, theirs.error).detail)
            return GradientComparison(Outcome.MISMATCH.value, detail), ""
        return None, _backward_skip(ran.error or theirs.error)  # (both raised alike)
    if ran.value is None or theirs.value is None:
        return None, "no_grad"  # (no output requires grad)
    if _any_sparse(ran.value) or _any_sparse(theirs.value):
        return None, "sparse"
    return compare_gradients(ran.value, theirs.value, names, tolerance), ""


def _raw_signature(experiment: Experiment, args: tuple, kwargs: dict) -> Any:
    """A sampled call's signature by the target's function, checked (:meth:`Experiment.signature_of`): one that
    changed a generator or the grad mode, now or before, names the call "unclassified"."""
    if experiment.target.signature is None:
        return "call"
    if experiment.signature_has_side_effects:
        return UNCLASSIFIED_SIGNATURE
    try:
        return experiment.signature_of(args, kwargs)
    except SideEffects:
        return UNCLASSIFIED_SIGNATURE
