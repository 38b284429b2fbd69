"""One sampled call, from its eligibility to its observation's publishing: the primary's run (its result or
exception is the caller's), then the shadow side (:class:`~shadow.core.calls.shadow_side.ShadowSide`), guarded:
whatever that raises is this tool's fault, counted as a "comparator" skip, never the caller's problem."""

from __future__ import annotations

import time
from typing import Any

from shadow.core.calls import eligibility
from shadow.core.calls.plan import Run
from shadow.core.calls.sampling import UNDER_WAY
from shadow.core.calls.shadow_side import ShadowSide
from shadow.core.model.observation import Observation, Outcome, bounded
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.isolation import modules_in_call
from shadow.core.runs.sides import marks


def run_primary(experiment: Any, args: tuple, kwargs: dict) -> Any:
    """The primary, marked as running on this thread: its own nested calls of the wrapper are not new calls."""
    outer = getattr(marks, "in_legacy", None)
    try:
        marks.in_legacy = experiment
        return experiment.primary_fn(*args, **kwargs)
    finally:
        marks.in_legacy = outer


def compare(experiment: Any, args: tuple, kwargs: dict, signature: str | None) -> Any:
    """An admitted call of ``experiment``'s (an :class:`~shadow.core.calls.engine.Experiment`): skipped with an
    observation where the shadow side cannot be the same call (:func:`eligibility.skip_reason`), else the
    primary's run against the shadow run. Returns what the primary returned (or raises what it raised)."""
    modules = modules_in_call(args, kwargs)
    skip = eligibility.skip_reason(experiment.target, experiment.pure_hooks, args, kwargs, modules)
    cost = experiment.cost
    if skip is not None:
        start = cost.clock()
        skipped = Observation(
            experiment.target.name, Outcome.SKIPPED, (skip[0],), signature=signature or "", timestamp=time.time(),
            primary=experiment.primary, detail=skip[1],
        )  # fmt: skip
        experiment.publish(skipped)
        cost.charge(cost.clock() - start)
        return run_primary(experiment, args, kwargs)
    planning = cost.clock()
    side = ShadowSide.plan_call(experiment, args, kwargs, modules, signature)
    cost.planned = cost.clock() - planning
    cost.charge(cost.planned)
    start = time.perf_counter()
    try:
        result = run_primary(experiment, args, kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # (SystemExit too: the state it leaves is compared like any other ending)
        shadow_side(experiment, side, args, kwargs, Run(error=exc, seconds=time.perf_counter() - start))
        raise
    shadow_side(experiment, side, args, kwargs, Run(value=result, seconds=time.perf_counter() - start))
    return result


def shadow_side(experiment: Any, side: ShadowSide, args: tuple, kwargs: dict, primary: Run) -> None:
    """Everything after the primary's run: observe, publish. Whatever it does to torch's global state is undone,
    and whatever it raises is counted (a "comparator" skip, or a settings failure)."""
    # Calls of wrapped functions from here on (the shadow run's, the extra runs', exporters') are not compared
    # again. (set inside the try, put back first thing in its finally: no interrupt, wherever it lands, leaves this
    # thread marked, and the caller's later calls on the shadow)
    record, cost = experiment.record, experiment.cost
    outer, started, held = getattr(marks, "shadow_side", None), cost.clock(), False
    try:
        UNDER_WAY.hold()
        held = True
        marks.shadow_side = experiment
        left_by_primary = TorchGlobals()  # the shadow side's changes never reach the job
        try:
            try:
                observation = side.observe(args, kwargs, primary, left_by_primary)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too
                record.log_limited("comparator", "upstream side failed: %r", exc)
                observation = Observation(
                    experiment.target.name, Outcome.SKIPPED, ("comparator",), detail=bounded(repr(exc)),
                    signature="", primary=experiment.primary,
                )  # fmt: skip
            experiment.publish(observation)
        finally:
            record.put_back(left_by_primary)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # taking torch's settings failed: ours to count, not the job's
        record.settings_failed(exc)
    finally:
        marks.shadow_side = outer
        if held:
            UNDER_WAY.release()
        seconds = cost.clock() - started
        cost.charge(seconds)
        cost.last = cost.planned + seconds
