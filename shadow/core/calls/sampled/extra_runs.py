"""The runs that join a sampled call's shadow run, one protocol for all: the A/A run (legacy again: the noise
floor), the single-device oracle, the backward comparison and the float64 truth run. Each is drawn by its coin
(:class:`~shadow.core.calls.sampled.plan.Coins`), runs in its own named isolation slot where it takes one
(:attr:`~shadow.core.calls.sampled.plan.Plan.slots`), through one :meth:`ExtraRuns._run` (put-back, slot, side,
deadline), guarded and timed by one :meth:`ExtraRuns._guarded` (a failure loses its finding alone:
:data:`~shadow.core.calls.sampled.guards.GUARDS`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shadow.core.calls.sampled import guards
from shadow.core.calls.sampled.plan import AA, BACKWARD, BACKWARD_AA, ORACLE, SHADOW, CallContext, Plan, Run
from shadow.core.judging.compare import Comparison, compare, compare_exceptions
from shadow.core.judging.gradients import GradientComparison, compare_gradients, names_of, vjp
from shadow.core.judging.noise import BEYOND, CHECKS, NOISE_CHECKS, PENDING, WITHIN, NoiseFloor
from shadow.core.judging.truth import in_float64, judge, judge_both, run_upcast
from shadow.core.model.observation import SHARED_DIVERGENCE_REASONS, Outcome, bounded, within_noise_floor
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs import hook_watch
from shadow.core.runs.deadline import Finished
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.sides import LEGACY_AGAIN, Lean, keeping_no_activations, shadow_run


class ExtraRuns:
    """The extra runs of one sampled call, made after its shadow run.

    Args:
        context: the call's context.
        plan: the call's plan (which runs joined, their slots).
        left_by_legacy: the settings the primary's run left, put back after each run.
    """

    def __init__(self, context: CallContext, plan: Plan, left_by_legacy: TorchGlobals) -> None:
        self.context, self.plan, self.left_by_legacy = context, plan, left_by_legacy
        self._legacy_changed = not left_by_legacy.same_as(plan.before)

    def _run(
        self,
        side: object,
        on: Callable[[], contextlib.AbstractContextManager[Any]],
        run: Callable[[Any], Any],
        backward: bool = False,
    ) -> Finished | None:
        """One run after the shadow run, the way every extra run is made: from the settings legacy started from,
        within ``on()`` (a context giving what the run is made on: an isolation slot's arguments, float64 copies;
        None: nothing to run, and None is returned), as one of ``side``'s runs (``backward``: a backward
        comparison's), within the deadline; the settings legacy left are put back after, whatever happens.

        The run is on a worker: this thread's settings are legacy's before and after it, and a process-wide one the
        run wrote is in ``plan.written``. So they are written here only where legacy changed one, a run of the call
        wrote one, or this run did not end as planned."""
        context, plan, left_by_legacy = self.context, self.plan, self.left_by_legacy
        if self._legacy_changed:
            context.record.put_back(plan.before)
        ran = None
        try:
            with on() as bound, shadow_run(side, backward=backward) as key:
                if bound is None:
                    return None
                ran = context.within_deadline(key, side, plan.before, lambda: run(bound), written=plan.written)
                return ran
        finally:
            if self._legacy_changed or plan.written or ran is None or not ran.finished:
                context.record.put_back(left_by_legacy, plan.written)

    def _guarded(
        self, kind: str, work: Callable[[], dict[str, Any] | None], **failed: Callable[[BaseException], Any]
    ) -> dict[str, Any]:
        """``work()``'s Observation fields, with the seconds it took as ``<kind>_seconds`` (none where it returns
        None: nothing ran). A failure of an extra run is this tool's: its finding is lost (the fields are then
        ``failed``'s, each made from the failure), said in the log (:mod:`~shadow.core.calls.sampled.guards`)."""
        start = time.perf_counter()
        try:
            fields = work()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            guards.failed(self.context.record, kind, exc)
            fields = {name: make(exc) for name, make in failed.items()}
        if fields is None:
            return {}
        return {**fields, f"{kind}_seconds": time.perf_counter() - start}

    def after_comparing(
        self, args: tuple, kwargs: dict, runs: tuple[Run, Run], primary: Run, found: Comparison, returned: bool
    ) -> tuple[Comparison, dict[str, Any]]:
        """The extra runs made once the two runs are compared (``runs``: legacy's, upstream's; ``primary``: the
        caller's; ``returned``: both returned): the backward comparison where the plan drew it and the forward
        agreed, the truth run where its coin draws a value difference, the oracle where the plan drew it and the two
        agreed. The comparison (a ``grad`` mismatch where the gradients differ) and their Observation fields."""
        context, plan = self.context, self.plan
        fields: dict[str, Any] = {"backward_skip": plan.backward_skip}
        if plan.backward and not returned:
            fields = {"backward_skip": "raised"}
        elif plan.backward and found.outcome not in (Outcome.MATCH, Outcome.CLOSE, Outcome.NOISE):
            fields = {"backward_skip": "diverged"}  # (the forward is the finding; its gradients are not)
        elif plan.backward:
            found, fields = self.backward(args, kwargs, runs[1], found)
        if (
            context.coins.truth is not None
            and context.plain
            and returned
            and _value_difference(found)
            and context.coins.truth.flip()
        ):
            fields.update(self.truth(args, kwargs, runs[0].value, runs[1].value))
        if plan.oracle and returned and found.outcome in (Outcome.MATCH, Outcome.CLOSE):
            fields.update(self.single_device(primary.value))
        return found, fields

    def backward(
        self, args: tuple, kwargs: dict, upstream: Run, found: Comparison
    ) -> tuple[Comparison, dict[str, Any]]:
        """The backward comparison (:mod:`shadow.core.judging.gradients`): legacy again, isolated, for a graph of
        its own, and the same seeded products through both graphs; with A/A runs on, legacy's products once more
        through a second graph of its own (the gradients' A/A: their noise floor, :mod:`shadow.core.judging.noise`).
        A difference of value within that floor is noise; one the floor cannot judge yet is held until it can; any
        other is a ``grad`` mismatch. Returns the comparison and the Observation fields of the backward run."""
        context, plan = self.context, self.plan
        seed = context.coins.backward.bits(40)  # type: ignore[union-attr]  # (drawn: it flipped)

        # (the stand-ins are looked up before each run: the run's own watch sees the run's calls alone)
        def legacy_products(slot: str) -> Callable[[tuple[tuple, dict]], Any]:
            wrt = plan.stand_ins(slot)

            def products(on: tuple[tuple, dict]) -> Any:
                outputs = context.legacy(*on[0], **on[1])
                if hook_watch.registered() != plan.hooks_seen:
                    raise _HooksRegistered  # (its backward would run the job's hooks again)
                return vjp(outputs, wrt, seed)

            return products

        def gradients() -> dict[str, Any]:
            if hook_watch.registered() != plan.hooks_seen:  # (the shadow run registered hooks on its graph)
                return {"compared": (None, "hooks")}
            ran = self._run(LEGACY_AGAIN, lambda: plan.in_slot(BACKWARD), legacy_products(BACKWARD), backward=True)
            if ran is not None and isinstance(ran.error, _HooksRegistered):
                return {"compared": (None, "hooks")}
            theirs = again = Finished(False)
            if ran is not None and ran.finished:
                wrt = plan.stand_ins(SHADOW)
                theirs = self._run(context.experiment, lambda: contextlib.nullcontext(True),
                    lambda _: vjp(upstream.value, wrt, seed), backward=True,
                )  # fmt: skip
            if ran is not None and ran.finished and BACKWARD_AA in plan.slots:
                again = self._run(
                    LEGACY_AGAIN, lambda: plan.in_slot(BACKWARD_AA), legacy_products(BACKWARD_AA), backward=True
                )
            names = names_of(args, kwargs)
            return {
                "compared": _gradients_compared(ran, theirs, names, context.tolerance),
                "floor": _gradients_compared(ran, again, names, context.tolerance)[0]
                if again and again.finished
                else None,
            }

        fields = self._guarded(BACKWARD, gradients, compared=lambda exc: (None, _backward_skip(exc, ours=True)))
        (compared, skip), floor = fields.pop("compared"), fields.pop("floor", None)
        fields.update({"backward": compared is not None, "backward_skip": skip if compared is None else ""})
        if compared is None:
            return found, fields
        noise, signature, with_aa = context.noise, plan.signature, BACKWARD_AA in plan.slots
        return _judged_by_floor(noise, signature, with_aa, found, compared, floor, fields)

    def truth(self, args: tuple, kwargs: dict, legacy: Any, upstream: Any) -> dict[str, Any]:
        """The float64 CPU runs (:mod:`shadow.core.judging.truth`: the single-device call's, or each side's code
        path's) and each side's error against them: the Observation fields (none where the results cannot be
        paired with them)."""
        context, target = self.context, self.context.target

        def truth() -> dict[str, Any]:
            with torch.no_grad():  # (the single-device call's scatter: no graph on the caller's inputs)
                call = target.oracle(args, kwargs) if target.oracle is not None else None
            if call is not None:
                paths, on, parts = [(call.module, context.experiment)], (call.args, call.kwargs), call.legacy_part
            else:
                # (legacy's path as the A/A run runs it: the calls it makes of wrapped functions are legacy's)
                paths = [(target.upstream, context.experiment), (context.legacy, LEGACY_AGAIN)]
                on, parts = (args, kwargs), (lambda result, truth: result)
            truths = []
            for function, side in paths:
                ran = self._run(side, functools.partial(in_float64, function, *on),
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

    def aa(self, legacy: Run) -> dict[str, Any]:
        """Legacy once more (legacy, whatever the primary: the noise floor is the reference's own variation), from
        the same start and as isolated as the shadow run, compared with legacy's result (``legacy``): the
        Observation fields of the A/A run, its errors added to the noise floor. Legacy raising the second time is
        noise of a kind not measured: the finding is lost."""
        context, plan = self.context, self.plan

        def aa() -> dict[str, Any]:
            # (a run of its own: the calls legacy makes of wrapped functions are nested calls, never upstream's)
            on, again = (lambda: plan.in_slot(AA)), (lambda on: forward_only(context.legacy, *on[0], **on[1]))
            ran = self._run(LEGACY_AGAIN, on, again)
            if ran is None or not ran.finished or (ran.error is None and ran.value is _READ_ITS_GRAPH):
                return {}
            if ran.error is not None:
                raise ran.error
            found = compare(legacy.value, ran.value, tolerance=context.tolerance)
            differs = found.outcome != Outcome.MATCH
            abs_error = found.max_abs_error if differs else 0.0
            rel_error = found.max_rel_error if differs else 0.0
            check = context.noise.add_aa(plan.signature, found.leaf_errors, rel_error, differs)
            return {
                "aa": True, "aa_abs_error": abs_error, "aa_rel_error": rel_error,
                "aa_check": _beyond_only_as_mismatch(check, found.outcome),
            }  # fmt: skip

        return self._guarded(AA, aa)

    def single_device(self, legacy_result: Any) -> dict[str, Any]:
        """Run the call's replica 0 on its own device, isolated and from the same settings as the upstream run,
        and compare legacy's replica-0 output with it: the Observation fields of a shared divergence (none if
        they agree)."""
        context, plan = self.context, self.plan

        @contextlib.contextmanager
        def single_device() -> Iterator[Any]:
            with plan.in_slot(ORACLE) as (args, kwargs):
                yield context.target.oracle(args, kwargs)  # (None: the call has no single-device equivalent)

        def oracle() -> dict[str, Any]:
            ran = self._run(context.experiment, single_device, lambda call: (call, forward_only(call.run)))
            if ran is None:
                return None  # (no single-device equivalent: no oracle run)
            if not ran.finished or (ran.error is None and ran.value[1] is _READ_ITS_GRAPH):
                return {}
            if ran.error is not None:
                raise ran.error
            call, single = ran.value
            context.record.add("oracle_runs")
            found = compare(call.legacy_part(legacy_result, single), single, tolerance=context.tolerance)
            if found.outcome != Outcome.MISMATCH:
                return {}
            reason = next((r for r in found.reasons if r in SHARED_DIVERGENCE_REASONS), "value")
            return {
                "shared_divergence": reason,
                "shared_detail": bounded(f"legacy and upstream agree; replica 0 alone on its device: {found.detail}"),
            }

        return self._guarded(ORACLE, oracle)


#: What :func:`forward_only` returns for a run whose code read its own graph (its finding is then lost).
_READ_ITS_GRAPH = object()


def forward_only(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` keeping no activations where grad mode is on (an extra run compared forward
    only: :func:`~shadow.core.runs.sides.keeping_no_activations`), or ``_READ_ITS_GRAPH`` where its code read them."""
    lean = Lean() if torch.is_grad_enabled() else None
    try:
        with keeping_no_activations(lean):
            value = function(*args, **kwargs)
    except Exception:
        if lean is not None and lean.read:  # (what it raised is what keeping no activations made it raise)
            return _READ_ITS_GRAPH
        raise
    return _READ_ITS_GRAPH if lean is not None and lean.read else value


class _HooksRegistered(Exception):
    """A run of the backward comparison's registered autograd hooks: its backward would run the job's code."""


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


def _judged_by_floor(
    noise: NoiseFloor,
    signature: str,
    with_aa: bool,
    found: Comparison,
    compared: Comparison,
    floor: Comparison | None,
    fields: dict[str, Any],
) -> tuple[Comparison, dict[str, Any]]:
    """A backward comparison's gradients (``compared``) against ``signature``'s thresholds in ``noise``
    (:mod:`shadow.core.judging.noise`): noise, held, or a ``grad`` mismatch of the call (``found``); the gradients'
    A/A products (``floor``, where ``with_aa``) fix the thresholds, then are judged against them, as the A/B products
    are (``grad_aa_check``, ``grad_noise_check`` in ``fields``)."""
    if floor is not None and floor.value_only:
        differs = floor.outcome != Outcome.MATCH.value
        check = noise.add_aa(signature, floor.leaf_errors, floor.max_rel_error, differs, summarize=False)
        fields["grad_aa_check"] = _beyond_only_as_mismatch(check, floor.outcome)
    judged, test = "", ""
    if compared.value_only and with_aa:  # (no A/A runs: no floor, nothing is noise)
        judged, test = noise.judge(signature, compared.leaf_errors)
        if judged in CHECKS:
            fields["grad_noise_check"] = _beyond_only_as_mismatch(judged, compared.outcome)
    if compared.outcome != Outcome.MISMATCH.value:
        return found, fields
    if judged in NOISE_CHECKS:
        return within_noise_floor(found, test), {**fields, "noise_test": test}
    detail = "; ".join(part for part in (compared.detail, found.detail) if part)
    found = dataclasses.replace(
        found, outcome=Outcome.MISMATCH.value, reasons=("grad",), detail=bounded(detail),
        max_abs_error=max(found.max_abs_error, compared.max_abs_error),
        max_rel_error=max(found.max_rel_error, compared.max_rel_error),
    )  # fmt: skip
    if judged == PENDING:  # (held until the gradients' burn-in ends: neither noise nor a mismatch meanwhile)
        fields.update(noise_test=test, noise_pending=True, leaf_errors=compared.leaf_errors)
    elif test:
        fields["noise_test"] = test
    return found, fields


def _beyond_only_as_mismatch(check: str, outcome: str) -> str:
    """A check of legacy's own A/A run (or of an A/B comparison) as the verdict counts it: ``beyond`` only where the
    run also differs beyond the tolerance (an A/B call within it is no mismatch, so neither is an A/A run: both sides
    are counted alike), ``within`` otherwise, "" where it was not judged."""
    if check == BEYOND and outcome != Outcome.MISMATCH.value:
        return WITHIN
    return check


def _value_difference(found: Comparison) -> bool:
    """A difference in value alone: where a float64 run can tell which side is nearer the truth."""
    return found.outcome == Outcome.CLOSE or (found.outcome == Outcome.MISMATCH and found.reasons == ("value",))
