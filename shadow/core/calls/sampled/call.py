"""One sampled call, one object: :meth:`SampledCall.run` takes it from its eligibility to its observation's
publishing. The primary's run (its result or exception is the caller's), then the shadow side
(:class:`~shadow.core.calls.sampled.shadow_side.ShadowSide`), guarded: whatever that raises is this tool's fault,
counted as a "comparator" skip (:mod:`~shadow.core.calls.sampled.guards`), never the caller's problem."""

from __future__ import annotations

import time
from typing import Any

from shadow.core.calls.gate.sampling import UNDER_WAY
from shadow.core.calls.sampled import guards
from shadow.core.calls.sampled.context import CallContext
from shadow.core.calls.sampled.eligibility import skip_reason
from shadow.core.calls.sampled.plan import Run, plan
from shadow.core.calls.sampled.shadow_side import ShadowSide, free_after_oom, is_oom
from shadow.core.model.observation import Observation, Outcome, bounded
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.isolation import modules_in_call
from shadow.core.runs.sides import marks


def run_primary(context: CallContext, args: tuple, kwargs: dict) -> Any:
    """The primary, marked as running on this thread: its own nested calls of the wrapper are not new calls."""
    outer = getattr(marks, "in_legacy", None)
    try:
        marks.in_legacy = context.side
        return context.primary_fn(*args, **kwargs)
    finally:
        marks.in_legacy = outer


class SampledCall:
    """One admitted call of a target (``signature``: a guided target's, classified already; None: classified
    here), from the ``context`` frozen at its admission."""

    def __init__(self, context: CallContext, args: tuple, kwargs: dict, signature: str | None) -> None:
        self.context, self.args, self.kwargs, self.signature = context, args, kwargs, signature

    def run(self) -> Any:
        """Skipped with an observation where the shadow side cannot be the same call, else the primary's run
        against the shadow run. Returns what the primary returned (or raises what it raised)."""
        context, args, kwargs, cost = self.context, self.args, self.kwargs, self.context.cost
        start = cost.clock()
        modules = modules_in_call(args, kwargs)
        skip = skip_reason(context.target, context.pure_hooks, args, kwargs, modules)
        if skip is not None:
            self._publish(self._skipped(skip[0], skip[1], self.signature or ""))
            cost.charge(cost.clock() - start)
            return run_primary(context, args, kwargs)
        try:
            side: ShadowSide | BaseException = ShadowSide(context, plan(context, args, kwargs, modules, self.signature))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # (taking the plan: ours to count, the call skipped)
            side = exc
        cost.planned = cost.clock() - start
        cost.charge(cost.planned)
        start = time.perf_counter()
        try:
            result = run_primary(context, args, kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # (SystemExit too: the state it leaves is compared like any other ending)
            self._shadow_side(side, Run(error=exc, seconds=time.perf_counter() - start))
            raise
        self._shadow_side(side, Run(value=result, seconds=time.perf_counter() - start))
        return result

    def _shadow_side(self, side: ShadowSide | BaseException, primary: Run) -> None:
        """Everything after the primary's run: observe, publish. Whatever it does to torch's global state is undone,
        and whatever it raises is counted (a "comparator" skip, or a settings failure)."""
        # Calls of wrapped functions from here on (the shadow run's, the extra runs', exporters') are not compared
        # again. (set inside the try, put back first thing in its finally: no interrupt, wherever it lands, leaves
        # this thread marked, and the caller's later calls on the shadow)
        context, cost = self.context, self.context.cost
        outer, started, held = getattr(marks, "shadow_side", None), cost.clock(), False
        try:
            UNDER_WAY.hold()
            held = True
            marks.shadow_side = context.side
            left_by_primary = TorchGlobals()  # the shadow side's changes never reach the job
            try:
                self._publish(self._observe(side, primary, left_by_primary))
            finally:
                context.record.put_back(left_by_primary)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # taking torch's settings failed: ours to count, not the job's
            context.record.settings_failed(exc)
        finally:
            marks.shadow_side = outer
            if held:
                UNDER_WAY.release()
            seconds = cost.clock() - started
            cost.charge(seconds)
            cost.last = cost.planned + seconds

    def _observe(self, side: ShadowSide | BaseException, primary: Run, left_by_primary: TorchGlobals) -> Observation:
        """The shadow side's observation; a plan that could not be taken, or a failure of the shadow side, as the
        skip its guard says."""
        if isinstance(side, BaseException):  # (out of memory, or ours)
            reason = "oom" if is_oom(side) else guards.failed(self.context.record, "plan", side)
            if reason == "oom":
                free_after_oom()
            return self._skipped(reason, bounded(repr(side)), "")
        try:
            return side.observe(self.args, self.kwargs, primary, left_by_primary)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too
            step = "isolation" if isinstance(exc, guards.IsolationFailed) else "shadow_side"
            return self._skipped(guards.failed(self.context.record, step, exc), bounded(repr(exc)), "")

    def _skipped(self, reason: str, detail: str, signature: str) -> Observation:
        context = self.context
        return Observation(
            context.target.name, Outcome.SKIPPED, (reason,), signature=signature, detail=detail,
            timestamp=time.time(), primary=context.primary,
        )  # fmt: skip

    def _publish(self, observation: Observation) -> None:
        self.context.publish(observation)
