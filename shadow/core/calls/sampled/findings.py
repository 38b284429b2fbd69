"""Two runs of one call turned into a finding (:func:`judge`): their results (or exceptions) compared, the settings
and module attributes each left, a value difference held against the noise floor; and a divergence's capture
(:func:`evidence`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from shadow.core.calls.sampled.guards import failed
from shadow.core.calls.sampled.plan import CallContext, Plan, Run
from shadow.core.judging import noise
from shadow.core.judging.compare import (
    Comparison,
    PendingComparison,
    compare_custom,
    compare_exceptions,
    with_state,
)
from shadow.core.judging.compare import start as start_comparing
from shadow.core.model.observation import UPSTREAM, Evidence, Outcome, bounded, within_noise_floor
from shadow.core.runs.global_state import IMPORT_TIME_SETTINGS, TorchGlobals
from shadow.core.runs.isolation import find_modules
from shadow.core.support import trees


def _as_it_is(value: Any) -> Any:
    return value


def _current_device() -> str | None:
    """The accelerator's current device ("npu:1"), or None without an accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else f"{accelerator.type}:{torch.accelerator.current_device_index()}"


@dataclasses.dataclass
class PendingFinding:
    """Two runs of one call whose comparison the device has not finished (:func:`judge`, where it may be
    deferred): :meth:`ready` says so without waiting, :meth:`finish` turns it into the finding. Holds no tensor of
    either run."""

    context: CallContext
    signature: str
    comparison: Comparison | PendingComparison
    autocast: str
    differences: dict[str, tuple[Any, Any]]
    #: A fire drill injected this difference: the monitor's own, known, decided at once (never held for the noise
    #: floor, never part of its sample).
    drilled: bool = False

    def ready(self) -> bool:
        return not isinstance(self.comparison, PendingComparison) or self.comparison.ready()

    def finish(self) -> tuple[Comparison, str, bool, str]:
        """(the finding, the noise test as text, whether it is pending, where it stood against the noise
        thresholds): the comparison (with both runs' autocast state where they mismatch), the settings and module
        attributes each run left, and a value difference held against the noise floor (:func:`within_noise`)."""
        found = self.comparison if isinstance(self.comparison, Comparison) else self.comparison.finish()
        if found.outcome == Outcome.MISMATCH and self.autocast:
            found = dataclasses.replace(found, detail=bounded(f"{found.detail} | {self.autocast}"))
        if self.differences:
            found = with_state(found, self.differences)
        if self.drilled:
            return found, "", False, ""
        return within_noise(self.context, self.signature, found)


def judge(
    context: CallContext,
    plan: Plan,
    arguments: tuple,
    runs: tuple[Run, Run],
    left: tuple | None,
    may_defer: bool = False,
    drilled: bool = False,
) -> tuple[Comparison, str, bool, str] | PendingFinding:
    """(the finding, the noise test as text, whether it is pending, where it stood against the noise thresholds) of
    two runs of one call (``arguments``: what
    legacy and upstream received; ``runs`` and ``left``: their results and the settings each left, legacy's and
    upstream's, ``left`` None where neither left one changed): compared, with the settings and module attributes
    each left, and a value difference held against the noise floor (:func:`within_noise`). Where it ``may_defer``
    and the device has not finished the comparison, the :class:`PendingFinding` instead (nothing waited for).
    ``drilled``: a fire drill corrupted upstream's run, and its difference is decided as it is found."""
    states = state_differences(plan, *left) if left is not None else {}
    differences = {**states, **module_differences(context, plan)}
    legacy, upstream = runs
    autocast = ""
    if legacy.error is not None or upstream.error is not None:
        found: Comparison | PendingComparison = compare_exceptions(legacy.error, upstream.error)
    elif context.target.compare is not None:
        found = compare_custom(context.target.compare, legacy.value, upstream.value)
    else:
        found = start_comparing(
            legacy.value,
            upstream.value,
            tolerance=context.tolerance,
            exact=context.target.exact,
            legacy_inputs=arguments[0],
            upstream_inputs=arguments[1],
            may_defer=may_defer,
        )
        autocast = f"autocast legacy: {plan.autocast}; upstream: {upstream.autocast}"
    finding = PendingFinding(context, plan.signature, found, autocast, differences, drilled)
    return finding if isinstance(found, PendingComparison) else finding.finish()


def state_differences(plan: Plan, first: TorchGlobals, second: TorchGlobals) -> dict[str, tuple[Any, Any]]:
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


def module_differences(context: CallContext, plan: Plan) -> dict[str, tuple[str, str]]:
    """The module attributes the two runs left differently (:func:`shadow.core.runs.isolation.module_differences`),
    as (legacy's, upstream's)."""
    found = plan.isolation.module_differences if plan.isolation is not None else {}
    if found and context.primary == UPSTREAM:  # (the isolated run was legacy's)
        return {name: (b, a) for name, (a, b) in found.items()}
    return found


def within_noise(context: CallContext, signature: str, found: Comparison) -> tuple[Comparison, str, bool, str]:
    """(the comparison, the noise test as text, whether it is pending, where the call stood against its signature's
    noise levels: ``below``, ``within``, ``beyond`` or "" where it was not judged): with A/A runs on, a comparison of
    value (a match, a close, a value mismatch) is judged against the levels its signature's A/A burn-in fixed
    (:mod:`shadow.core.judging.noise`): a value mismatch within them is noise, beyond them stays a mismatch (an
    exceedance, counted as such), and one on a leaf whose burn-in is not over is held (pending) until it is. A
    difference of another kind is never noise. Without A/A runs nothing is noise and nothing is judged."""
    if context.coins.aa is None:  # (no A/A runs: no floor, nothing is noise, nothing judged)
        return found, "", False, ""
    mismatch = found.outcome == Outcome.MISMATCH
    of_value = found.outcome in (Outcome.MATCH, Outcome.CLOSE) or (mismatch and set(found.reasons) == {"value"})
    if not of_value:
        return found, "", False, ""
    check, test = context.noise.judge(signature, found.leaf_errors)
    if check == noise.PENDING:
        return found, test, mismatch, ""  # (a match or a close before the burn-in ends: not judged, nothing held)
    if check == noise.REAL or not check:
        return found, test if mismatch else "", False, ""
    if check == noise.BEYOND and mismatch:
        return found, test, False, noise.BEYOND  # (an exceedance: a mismatch, counted, never called noise)
    if mismatch:
        return within_noise_floor(found, test), test, False, check
    # (a match, or a close within the tolerance: no exceedance, whatever its error against the threshold)
    return found, "", False, noise.WITHIN if check == noise.BEYOND else check


def evidence(context: CallContext, arguments: tuple[tuple, dict], legacy: Run, upstream: Run) -> Evidence:
    """What a repro capture needs: the inputs as upstream received them (``arguments``), both outputs, the module
    state."""
    args, kwargs = arguments
    modules = find_modules((args, kwargs))
    clean = context.target.clean or _as_it_is
    with torch._C.DisableTorchFunction():  # (no subclass sees the detach)
        upstream_value = trees.map_only(torch.Tensor, torch.Tensor.detach, clean(upstream.value))
    try:
        module_state = modules[0].state_dict() if modules else None
    except Exception as exc:  # the user's state_dict: its failure loses the state, never the observation
        failed(context.record, "state_dict", exc)
        module_state = None
    return Evidence(
        args,
        kwargs,
        legacy=legacy.error or clean(legacy.value),
        # (detached: the evidence never keeps upstream's autograd graph alive)
        upstream=upstream.error or upstream_value,
        module_state=module_state,
        legacy_fn=context.legacy,
        upstream_fn=context.target.upstream,
        exact=context.target.exact,
        device=_current_device(),
    )
