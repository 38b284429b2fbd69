"""One sampled call, one object: :meth:`SampledCall.run` takes it from its eligibility (:func:`skip_reason`: can it
run twice as the same call?) to its observation's publishing. The primary's run (its result or exception is the
caller's), then the shadow side (:class:`~shadow.core.calls.sampled.shadow_side.ShadowSide`), guarded: whatever that
raises is this tool's fault, counted as a "comparator" skip (:mod:`~shadow.core.calls.sampled.guards`), never the
caller's problem."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from shadow.core.calls.gate.sampling import UNDER_WAY
from shadow.core.calls.sampled import guards
from shadow.core.calls.sampled.plan import CallContext, Run, plan
from shadow.core.calls.sampled.shadow_side import (
    DeferredObservation,
    ShadowSide,
    device_allocated,
    free_after_oom,
    is_oom,
)
from shadow.core.model.observation import Observation, Outcome, bounded
from shadow.core.model.targets import Target
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.isolation import user_code_reached
from shadow.core.runs.sides import SAMPLED_CALLS, job_threads_besides_this_one, marks
from shadow.core.support.memory import InsufficientMemory

#: Why a call is not run again when torch's process-wide settings changed while it ran.
_MOVED = (
    "torch's process-wide settings changed while the call ran ({}), and other threads of the job are alive: running "
    "it again from the old values would show them those values meanwhile"
)

#: torch's own TorchFunctionModes: they are part of the call's context, active for legacy and upstream alike.
_TORCHS_OWN_MODES = (DeviceContext,)  # torch.set_default_device, ``with torch.device(...)``


def skip_reason(
    target: Target, pure_hooks: bool, args: tuple, kwargs: dict
) -> tuple[list[torch.nn.Module], tuple[str, str] | None]:
    """(the modules in the call, and (reason, detail) where a sampled call of ``target`` cannot be compared
    faithfully, else None).

    Args:
        target: the call's target (its ``run_if``).
        pure_hooks: the user's module hooks are declared free of side effects.
        args, kwargs: the call's arguments.

    Why the shadow side would be visible to code the job runs: a user's TorchFunctionMode or any TorchDispatchMode
    is active, or the call reaches a tensor subclass with its own hooks, or a user's module hooks (their code would
    see every operation of the shadow side, and upstream's calls would come back through them to the wrapper, so
    the comparison would not be faithful: reason "mode", or "hooks"; torch's own modes, a default device, are part
    of the call: upstream runs under them too); the call is being compiled; or the target says the call cannot run
    twice (:attr:`Target.run_if`). None when it can be compared.
    """
    if torch.compiler.is_compiling():
        return [], ("compiling", "")
    if torch._C._len_torch_dispatch_stack() or (
        torch._C._len_torch_function_stack()
        and not all(isinstance(mode, _TORCHS_OWN_MODES) for mode in _get_current_function_mode_stack())
    ):
        return [], ("mode", "")
    scanned = (target.reaches(args, kwargs), {}) if target.reaches is not None else (args, kwargs)
    modules, reached = user_code_reached(*scanned, pure_hooks)
    if reached:
        return modules, (reached, "")
    if target.run_if is not None:
        try:
            why = target.run_if(args, kwargs)
        except InsufficientMemory as exc:
            return modules, ("oom", bounded(str(exc)))
        except Exception as exc:  # (the target's own check: its failure is ours to count, never the job's)
            return modules, ("comparator", bounded(f"run_if raised {exc!r}"))
        if why is not None:
            return modules, ("ineligible", bounded(str(why)))
    return modules, None


def run_primary(context: CallContext, args: tuple, kwargs: dict) -> Any:
    """The primary, marked as running on this thread: its own nested calls of the wrapper are not new calls."""
    outer = getattr(marks, "in_primary", None)
    try:
        marks.in_primary = context.experiment
        return context.primary_fn(*args, **kwargs)
    finally:
        marks.in_primary = outer


class SampledCall:
    """One admitted call of a target (``signature``: a guided target's, classified already; None: classified
    here), from the ``context`` frozen at its admission."""

    def __init__(self, context: CallContext, args: tuple, kwargs: dict, signature: str | None) -> None:
        self.context, self.args, self.kwargs, self.signature = context, args, kwargs, signature

    def run(self) -> Any:
        """Skipped with an observation where the shadow side cannot be the same call, else the primary's run
        against the shadow run. Returns what the primary returned (or raises what it raised)."""
        under_way = SAMPLED_CALLS  # (calls of a release's counted patches meanwhile are told apart: patch_calls)
        with under_way.lock:
            under_way.count += 1
        try:
            return self._run()
        finally:
            with under_way.lock:
                under_way.count -= 1

    def _run(self) -> Any:
        context, args, kwargs, cost = self.context, self.args, self.kwargs, self.context.cost
        start = cost.clock()
        if context.record.deferred:  # (earlier calls' comparisons the device has finished since)
            context.record.finish_deferred()
        try:
            modules, skip = skip_reason(context.target, context.pure_hooks, args, kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # (reading the call's arguments: a half-built module in a deepcopy's memo)
            modules, skip = [], (guards.failed(context.record, "admission", exc), bounded(repr(exc)))
        if skip is not None:
            context.record.publish(self._skipped(skip[0], skip[1], self.signature or ""), context.noise)
            cost.charge(cost.clock() - start)
            return run_primary(context, args, kwargs)
        try:
            side: ShadowSide | BaseException = ShadowSide(context, plan(context, args, kwargs, modules, self.signature))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # (taking the plan: ours to count, the call skipped)
            side = exc
        cost.planned = cost.clock() - start  # (charged with the shadow side's time, once it ended)
        # (what the primary's forward allocates: the graph a backward comparison of its signature would hold twice)
        graphs = context.graph_memory if isinstance(side, ShadowSide) and torch.is_grad_enabled() else None
        allocated_before = device_allocated() if graphs is not None else 0
        start = time.perf_counter()
        try:
            result = run_primary(context, args, kwargs)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # (SystemExit too: the state it leaves is compared like any other ending)
            self._shadow_side(side, Run(error=exc, seconds=time.perf_counter() - start))
            raise
        seconds = time.perf_counter() - start
        if graphs is not None:
            graphs.observe(side.plan.signature, allocated_before, device_allocated())
        self._shadow_side(side, Run(value=result, seconds=seconds))
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
            left_by_primary = TorchGlobals()  # the shadow side's changes never reach the job
            changed = isinstance(side, ShadowSide) and not left_by_primary.same_as(side.plan.before)
            moved = left_by_primary.process_wide_differences(side.plan.before) if changed else []  # type: ignore[union-attr]
            if moved and not job_threads_besides_this_one():  # (none would see them: run again from the old values)
                side.plan.written.update(moved)  # type: ignore[union-attr]
                moved = []
            UNDER_WAY.hold()
            held = True
            marks.shadow_side = context.experiment
            try:
                if moved:  # (the shadow would start from the old values, and every thread would see them meanwhile)
                    observation = side.skipped("ineligible", _MOVED.format(", ".join(moved)))  # type: ignore[union-attr]
                elif isinstance(side, ShadowSide):
                    observation = side.observe(self.args, self.kwargs, primary, left_by_primary, changed)
                else:
                    observation = self._plan_failed(side)
                if isinstance(observation, DeferredObservation):  # (the device has not finished comparing)
                    context.record.defer(observation, context.noise)
                else:
                    context.record.publish(observation, context.noise)
            finally:
                context.record.put_back(left_by_primary, side.plan.written if isinstance(side, ShadowSide) else ())
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # taking torch's settings failed: ours to count, not the job's
            context.record.settings_failed(exc)
        finally:
            marks.shadow_side = outer
            if held:
                UNDER_WAY.release()
            cost.last = cost.planned + cost.clock() - started
            cost.charge(cost.last)

    def _plan_failed(self, failure: BaseException) -> Observation:
        """The observation of a call whose plan could not be taken: out of memory, or ours (its guard's skip)."""
        reason = "oom" if is_oom(failure) else guards.failed(self.context.record, "plan", failure)
        if reason == "oom":
            free_after_oom()
        return self._skipped(reason, bounded(repr(failure)), "")

    def _skipped(self, reason: str, detail: str, signature: str) -> Observation:
        context = self.context
        return Observation(
            context.target.name, Outcome.SKIPPED, (reason,), signature=signature, detail=detail,
            timestamp=time.time(), primary=context.primary,
        )  # fmt: skip
