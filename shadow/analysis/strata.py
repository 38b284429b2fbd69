"""A phase's evidence as the strata its bounds are computed on (:mod:`shadow.analysis.bounds`): each signature
weighted by its share of the phase's calls (one stratum where calls are not counted by signature), the sampled calls
never compared (non-response: skips tied to the call) a free stratum of their share, and a stratum with more
comparisons than the phase's clusters counted as that many comparisons at its own rate (docs/operations.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from shadow.analysis.bounds import Stratum
from shadow.analysis.evidence import PhaseCounts
from shadow.core.model.observation import COMPARED_OUTCOMES, DIVERGENT_OUTCOMES, RANDOM_SKIP_REASONS


def of(
    phase: PhaseCounts, cap: float | None
) -> tuple[list[Stratum], list[Stratum], dict[str, float], bool, dict[str, tuple[float, float]]]:
    """(strata for the lower bound, strata for the upper bound, uncovered share by reason, weighted, each
    signature's own (divergences, comparisons) after clustering): each
    signature weighted by its share of the phase's calls (one stratum where calls are not known by signature),
    its non-response (skips tied to the call) a free stratum of its own; where the phase's comparisons fall in
    ``cap`` clusters, a stratum with more comparisons counts as ``cap`` comparisons at its own rate."""
    compared = phase.by_signature(COMPARED_OUTCOMES)
    divergent = phase.by_signature(DIVERGENT_OUTCOMES)
    nonresponse = _nonresponse(phase)
    unmatched = dict(phase.unmatched)
    by_signature = any(s for s in phase.calls if phase.calls[s] > 0)
    if not by_signature:  # one stratum: uniform sampling weights every comparison alike
        merge = [compared, divergent, unmatched]
        compared, divergent, unmatched = ({"": sum(m.values())} for m in merge)
        nonresponse = {"": _merged(nonresponse.values())}
        calls = {"": max(sum(phase.calls.values()), 1.0)}
    else:
        calls = dict(phase.calls)
        loose = nonresponse.pop("", None)
        for signature in set(compared) | set(nonresponse) | set(unmatched):
            seen = compared.get(signature, 0) + sum(nonresponse.get(signature, {}).values())
            calls[signature] = max(calls.get(signature, 0), seen + unmatched.get(signature, 0))
    total = sum(calls.values())
    lower: list[Stratum] = []
    upper: list[Stratum] = []
    uncovered: dict[str, float] = {}
    own: dict[str, tuple[float, float]] = {}
    for signature, count in calls.items():
        if count <= 0:
            continue
        weight = count / total
        n, k = compared.get(signature, 0), divergent.get(signature, 0)
        skipped = nonresponse.get(signature, {})
        extra = unmatched.get(signature, 0)
        sampled = n + sum(skipped.values()) + extra
        if sampled <= 0:
            upper.append(Stratum(weight, 0, 0))
            lower.append(Stratum(weight, 0, 0))
            uncovered["never sampled"] = uncovered.get("never sampled", 0) + weight
            continue
        for reason, value in skipped.items():
            uncovered[reason] = uncovered.get(reason, 0) + weight * value / sampled
        free = weight * sum(skipped.values()) / sampled
        if free:
            upper.append(Stratum(free, 0, 0))
            lower.append(Stratum(free, 0, 0))
        scale = (n + extra) / cap if cap is not None and n + extra > cap else 1.0
        upper.append(Stratum(weight * (n + extra) / sampled, (k + extra) / scale, (n + extra) / scale))
        lower.append(Stratum(weight * (n + extra) / sampled, k / scale, (n + extra) / scale))
        own[signature] = (k / scale, (n + extra) / scale)
    if by_signature and loose:  # (skips whose signature is not known: their share of all sampled calls)
        sampled = sum(compared.values()) + sum(_merged(nonresponse.values()).values()) + sum(loose.values())
        lower, upper = _with_loose(lower, uncovered, loose, sampled), _with_loose(upper, {}, loose, sampled)
    return lower, upper, uncovered, by_signature, own


def _nonresponse(phase: PhaseCounts) -> dict[str, dict[str, float]]:
    """A phase's skips tied to the call (non-response), by signature and reason: every skip but the budget's, one
    for a reason this version does not know included (a call never compared is never agreement)."""
    found: dict[str, dict[str, float]] = {}
    for (signature, reason), value in phase.skipped.items():
        if reason not in RANDOM_SKIP_REASONS and value > 0:
            by_reason = found.setdefault(signature, {})
            by_reason[reason] = by_reason.get(reason, 0) + value
    return found


def _with_loose(
    strata: list[Stratum], uncovered: dict[str, float], loose: Mapping[str, float], sampled: float
) -> list[Stratum]:
    """``strata`` with the skips whose signature is not known as a free stratum of their share of the sampled
    calls (the others scaled to the rest); their share added to ``uncovered`` by reason."""
    share = sum(loose.values()) / sampled
    for reason, value in loose.items():
        uncovered[reason] = uncovered.get(reason, 0) + value / sampled
    return [dataclasses.replace(s, weight=s.weight * (1 - share)) for s in strata] + [Stratum(share, 0, 0)]


def _merged(maps: Iterable[Mapping[str, float]]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for each in maps:
        for key, value in each.items():
            merged[key] = merged.get(key, 0) + value
    return merged
