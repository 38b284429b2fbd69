"""The Prometheus recording and alerting rules, generated from one table of thresholds.

Run ``python -m dashboards.rules`` to rewrite ``dashboards/prometheus/npu_shadow.rules.yml``; a test
regenerates it and fails when the committed file is stale.

Divergence = comparisons whose outcome is ``mismatch`` or ``error``, over comparisons that were made
(``skipped`` excluded). Where calls are counted by signature (coverage-guided sampling over-represents rare
signatures among comparisons), the rate weights each signature by its share of calls, and the sample size the
alerts' gates read is Kish's effective one; elsewhere it is the plain ratio. Everything is aggregated by ``job``,
``target`` and ``primary``: the ranks of a job are its instances, and the phases (legacy's result returned, or
upstream's in a canary) are never pooled, as ``npu-shadow verdict`` keeps them apart. Burn-rate windows follow the
SRE workbook, scaled down for training jobs (hours, not months).

``NpuShadowPromotionEvidence`` cannot compute the verdict's bound (a convex program) in PromQL; it uses closed
forms that are never below it (see :func:`promotion_upper` and the promtool cases decided by the verdict on the
same counts). With no divergence in a phase, the verdict's zero-divergence upper bound is at most
``(log(1/alpha) - log(w) + log(1 + N / b)) / min_s(n_s / W_s)`` (since -log(1 - p) >= p; N comparisons, n_s of
signature s whose share of calls is W_s, b and w the mixture's prior and shared-rate weight). With divergences,
the verdict's region ``sum_s n_s KL(q_s || p_s) <= B`` (q_s = k_s / n_s, B = log(1/alpha) - log(1 - w) plus each
signature's regret envelope) holds every p with ``U - Q <= sqrt(2 B U / m)`` (KL(q || p) >= (p - q)^2 / 2p and
Cauchy-Schwarz; Q = sum_s W_s q_s, m = min_s n_s / W_s), so ``U <= Q + B/m + sqrt(2 Q B / m + (B / m)^2)``; each
regret is bounded by ``log((n + b + 1) / b) + k (1 + log((n + b + 1) / n)) + (n - k) log(1 - k / n)``
(Gamma(k + 1) >= (k / e)^k; increasing in k, so it bounds the envelope too).
"""

from __future__ import annotations

import math
import pathlib
import re
from typing import Any

from dashboards.series import (
    BACKWARD_RUNS,
    CALLS,
    CLUSTERS,
    COMPARED,
    COMPARISONS,
    DIVERGENT,
    HARD_REASONS,
    LEGACY_TIME,
    MISMATCHES,
    NOISE_CHECKS,
    PRIMARY_TIME,
    RESETS,
    ROLLBACKS,
    SAMPLE_RATE,
    SHADOW_TIME,
    SKIPPED,
)
from shadow.analysis import bounds, decisions, verdict
from shadow.analysis.sources import promql
from shadow.core.model.observation import DIVERGENT_OUTCOMES, NONRESPONSE_REASONS

#: Every threshold, in one place.
PARAMS: dict[str, Any] = {
    # the divergence rate the rollout tolerates (the error budget); `npu-shadow verdict --max-rate` default
    "max_divergence": decisions.DEFAULT_MAX_RATE,
    # comparisons a window must hold before a ratio alert may fire
    "min_samples": 100,
    "fast_burn": {"factor": verdict.BURN_RATE_FACTORS["fast burn"], "long": "30m", "short": "5m", "for": "1m"},
    "slow_burn": {"factor": verdict.BURN_RATE_FACTORS["slow burn"], "long": "2h", "short": "15m", "for": "5m"},
    # an hour over 3x however clean the hours before it (the promotion verdict's recent window is an hour too)
    "sustained_burn": {
        "factor": verdict.BURN_RATE_FACTORS["sustained burn"],
        "long": "1h",
        "short": "5m",
        "for": "5m",
    },
    "hard_window": "10m",
    # blind: calls * sample rate promised this many comparisons in the window, and none came
    "blind": {"window": "15m", "expected": 20, "for": "10m"},
    "upstream_errors": {"window": "15m", "ratio": 0.5, "for": "5m"},
    # overhead: shadow time over legacy time on sampled calls, and shadow time per second of wall time
    "overhead": {"window": "15m", "ratio": 2.0, "time_fraction": 0.02, "for": "15m"},
    "promotion": {"for": "30m"},
}

WINDOWS = ("5m", "15m", "30m", "1h", "2h", "6h")
#: The verdict's recent windows (``verdict.recent_windows`` of its default ``--recent``), as rule windows.
RECENT_WINDOWS = tuple(f"{round(seconds / 60)}m" if seconds < 3600 else f"{round(seconds / 3600)}h"
                       for seconds in verdict.recent_windows(decisions.RECENT_SECONDS))  # fmt: skip
Z95 = 1.6448536269514722  # one-sided 95%

PHASE = "job, run, target, primary"
COMPARED_SERIES = f"{COMPARISONS}{{{COMPARED}}}"
DIVERGENT_SERIES = f"{COMPARISONS}{{{DIVERGENT}}}"
BY = f"sum by ({PHASE})"
BY_SIGNATURE = f"sum by ({PHASE}, signature)"
ON_SIGNATURE = f"on ({PHASE}, signature)"


def _per_signature(selector: str, window: str | None, over: str = "rate") -> str:
    counted = getattr(promql, over)(selector, window) if window else selector
    return f"{BY_SIGNATURE} ({counted})"


def _weighted(window: str | None, over: str = "rate") -> tuple[str, str]:
    """PromQL for (the divergence rate with each signature weighted by its share of calls, Kish's effective sample
    size) over the signatures compared, where calls are counted by signature (see the verdict), per phase."""
    compared = _per_signature(f"{COMPARISONS}{{{COMPARED}}}", window, over)
    divergent = _per_signature(f"{COMPARISONS}{{{DIVERGENT}}}", window, over)
    calls = _per_signature(f'{CALLS}{{signature!=""}}', window, over)
    seen = f"({compared} > 0)"
    share = f"({calls} and {ON_SIGNATURE} {seen})"
    rate = f"{BY} ((({divergent} or {compared} * 0) / {seen}) * {ON_SIGNATURE} {calls}) / {BY} ({share})"
    effective = f"{BY} ({share}) ^ 2 / {BY} ({calls} ^ 2 / {ON_SIGNATURE} {seen})"
    return rate, effective


def _recording_rules() -> list[dict[str, str]]:
    weighted_rate, weighted_effective = _weighted(None)
    rules = [
        {
            # (an installed target's calls exist from its start, its comparisons from the first: 0 until then)
            "record": "npu_shadow:comparisons:total",
            "expr": f"{BY} ({COMPARED_SERIES}) or {BY} ({CALLS}) * 0",
        },
        {
            "record": "npu_shadow:divergent:total",
            "expr": f"{BY} ({DIVERGENT_SERIES}) or npu_shadow:comparisons:total * 0",
        },
        {
            "record": "npu_shadow:divergence:ratio_total",
            # (no comparison yet: no ratio, never a 0/0 that one store keeps as NaN and another drops)
            "expr": f"({weighted_rate}) or npu_shadow:divergent:total / (npu_shadow:comparisons:total > 0)",
        },
        {
            "record": "npu_shadow:comparisons:effective_total",
            "expr": f"({weighted_effective}) or npu_shadow:comparisons:total",
        },
        {"record": "npu_shadow:calls:total", "expr": f"{BY} ({CALLS})"},
    ]
    for window in WINDOWS:
        rules += [
            {
                "record": f"npu_shadow:comparisons:rate{window}",
                "expr": f"{BY} ({promql.rate(COMPARED_SERIES, window)})",
            },
            {
                "record": f"npu_shadow:divergent:rate{window}",
                "expr": f"{BY} ({promql.rate(DIVERGENT_SERIES, window)}) or npu_shadow:comparisons:rate{window} * 0",
            },
            {
                "record": f"npu_shadow:divergence:ratio_rate{window}",
                "expr": f"({_weighted(window)[0]}) "
                f"or npu_shadow:divergent:rate{window} / npu_shadow:comparisons:rate{window}",
            },
            {
                "record": f"npu_shadow:comparisons:increase{window}",
                "expr": f"{BY} ({promql.increase(COMPARED_SERIES, window)})",
            },
            {
                "record": f"npu_shadow:comparisons:effective_increase{window}",
                "expr": f"({_weighted(window, 'increase')[1]}) or npu_shadow:comparisons:increase{window}",
            },
        ]
    rules += [
        {
            "record": "npu_shadow:divergence:wilson_upper_total",
            "expr": _wilson_upper("npu_shadow:divergence:ratio_total", "npu_shadow:comparisons:effective_total"),
        },
        {
            "record": "npu_shadow:overhead:ratio_rate15m",
            "expr": f"sum by (job, run, target) ({promql.rate(SHADOW_TIME, '15m')}) / sum by (job, run, target) "
            f"({promql.rate(PRIMARY_TIME, '15m')} or {promql.rate(LEGACY_TIME, '15m')})",
        },
        *_stratum_rules(),
        {"record": "npu_shadow:promotion:upper_bound_approx", "expr": promotion_bound()},
        {"record": "npu_shadow:promotion:gradient_upper_bound_approx", "expr": gradient_promotion_bound()},
        {"record": ROLLED_BACK, "expr": rolled_back_latch()},
    ]
    return rules


def promotion_bound() -> str:
    """PromQL for a bound of a phase's divergence rate at least the verdict's upper bound (module docstring),
    whatever the allocation of comparisons to signatures and clusters: the zero-divergence form where the phase's
    forward evidence has no divergence, the form with divergences otherwise."""
    prior = bounds.Prior.for_max_rate(PARAMS["max_divergence"])
    budget = math.log(1 / bounds.ALPHA) - math.log(bounds.SHARED_RATE_WEIGHT)
    compared = _per_signature(f"{COMPARISONS}{{{COMPARED}}}", None)
    calls = _per_signature(f'{CALLS}{{signature!=""}}', None)
    share = f"({calls} / on ({PHASE}) group_left {BY} ({calls}))"
    # n_s / W_s over the signatures with calls (a signature with calls and no comparison: 0); one stratum: N
    per_share = f"min by ({PHASE}) ((({compared} or {calls} * 0) / {ON_SIGNATURE} ({share} > 0)))"
    least = f"({per_share} or npu_shadow:comparisons:total)"
    # the verdict counts a phase's comparisons in its C clusters (a stratum of more than C counts as C): since
    # min_s(min(n_s, C) / W_s) >= min(min_s(n_s / W_s), C), dividing by the smaller of the two keeps the bound above it
    clusters = f"{BY} ({CLUSTERS})"
    clustered = f"(({least} <= {clusters}) or {clusters} or {least})"
    clean = f"({budget!r} + ln(1 + npu_shadow:comparisons:total / {prior.b!r})) / {clustered}"
    diverged = f"{BY} ({STRATUM_DIVERGENT}) > 0"
    return f"({clean} unless on ({PHASE}) ({diverged})) or {_with_divergences(_forward_strata())}"


#: Per-stratum series of a phase's forward evidence (one stratum per signature where calls are counted by
#: signature, the whole phase otherwise): comparisons, divergences (a gradient mismatch is the gradients'
#: evidence, as the verdict counts it), share of the phase's calls, and comparisons capped at the phase's clusters.
STRATUM_COMPARED = "npu_shadow:promotion:stratum_compared"
STRATUM_DIVERGENT = "npu_shadow:promotion:stratum_divergent"
STRATUM_SHARE = "npu_shadow:promotion:stratum_share"
STRATUM_CAPPED = "npu_shadow:promotion:stratum_capped"


def _by_stratum(selector: str) -> str:
    signed = f'{BY} ({CALLS}{{signature!=""}}) > 0'
    return (
        f"({BY_SIGNATURE} ({selector}) and on ({PHASE}) ({signed}) or {BY} ({selector}) unless on ({PHASE}) ({signed}))"
    )


def _capped(n: str) -> str:
    """PromQL: ``n`` (per stratum) at most the phase's clusters, where they are counted."""
    clusters = f"({BY} ({CLUSTERS}) > 0)"
    return (
        f"(({n} <= on ({PHASE}) group_left () {clusters}) or ({n} * 0 + on ({PHASE}) group_left () {clusters}) or {n})"
    )


def _stratum_rules() -> list[dict[str, str]]:
    calls = _per_signature(f'{CALLS}{{signature!=""}}', None)
    grad_mismatches = _per_signature(f'{BACKWARD_RUNS}{{outcome="mismatch"}}', None)
    divergent = _by_stratum(f"{COMPARISONS}{{{DIVERGENT}}}")
    forward = f"clamp_min({divergent} - on ({PHASE}, signature) ({grad_mismatches} or {divergent} * 0), 0)"
    signed = f"{BY} ({calls}) > 0"
    return [
        {"record": STRATUM_COMPARED, "expr": _by_stratum(f"{COMPARISONS}{{{COMPARED}}}")},
        {"record": STRATUM_DIVERGENT, "expr": f"({forward} or {divergent}) or {STRATUM_COMPARED} * 0"},
        {
            "record": STRATUM_SHARE,
            "expr": f"{calls} / on ({PHASE}) group_left {BY} ({calls}) "
            f"or ({STRATUM_COMPARED} * 0 + 1 unless on ({PHASE}) ({signed}))",
        },
        {"record": STRATUM_CAPPED, "expr": _capped(STRATUM_COMPARED)},
    ]


def _forward_strata() -> tuple[str, str, str, str, str]:
    """(n, k, capped n, share, the vector's grouping) of the forward strata, as recorded."""
    return STRATUM_COMPARED, STRATUM_DIVERGENT, STRATUM_CAPPED, STRATUM_SHARE, f"{PHASE}, signature"


def _regret(n: str, k: str) -> str:
    """PromQL of the regret bound ``log((n + b + 1) / b) + k (1 + log((n + b + 1) / n)) + (n - k) log(1 - k / n)``
    (module docstring), element-wise."""
    b = bounds.Prior.for_max_rate(PARAMS["max_divergence"]).b
    rest = f"clamp_min(1 - {k} / {n}, 1e-300)"  # (k = n: (n - k) log(...) is 0)
    return f"(ln(({n} + {b + 1!r}) / {b!r}) + {k} * (1 + ln(({n} + {b + 1!r}) / {n})) + ({n} - {k}) * ln({rest}))"


def _with_divergences(strata: tuple[str, str, str, str, str]) -> str:
    """PromQL of ``Q + B/m + sqrt(2 Q B / m + (B / m)^2)`` over the strata (module docstring)."""
    n, k, capped, share, grouping = strata
    on = f"on ({grouping})"
    q = f"{BY} ({k} / {n} * {on} {share})"
    effective_k = f"({k} * {capped} / {n})"
    base = math.log(1 / bounds.ALPHA) - math.log1p(-bounds.SHARED_RATE_WEIGHT)
    budget = f"({base!r} + {BY} ({_regret(capped, effective_k)}))"
    m = f"min by ({PHASE}) ({capped} / {on} {share})"
    per = f"({budget} / {m})"
    return f"({q} + {per} + sqrt(2 * {q} * {per} + {per} ^ 2))"


def promotion_upper(strata: list[tuple[float, float, float]], clusters: float | None = None) -> float:
    """The rules' bound of one phase in Python, for tests against the verdict: ``strata`` as (share of calls,
    divergences, comparisons), every one compared, ``clusters`` the phase's where counted."""
    b = bounds.Prior.for_max_rate(PARAMS["max_divergence"]).b
    capped = [(w, k, n, min(n, clusters) if clusters else n) for w, k, n in strata]
    m = min(c / w for w, _, _, c in capped)
    if not any(k for _, k, _, _ in capped):
        budget = math.log(1 / bounds.ALPHA) - math.log(bounds.SHARED_RATE_WEIGHT)
        total = sum(n for _, _, n, _ in capped)
        least = min(n / w for w, _, n, _ in capped)
        return (budget + math.log1p(total / b)) / (min(least, clusters) if clusters else least)
    q = sum(w * k / n for w, k, n, _ in capped)
    regret = 0.0
    for _, k, n, c in capped:
        k = k * c / n
        regret += (
            math.log((c + b + 1) / b) + k * (1 + math.log((c + b + 1) / c)) + (c - k) * math.log(max(1 - k / c, 1e-300))
        )
    per = (math.log(1 / bounds.ALPHA) - math.log1p(-bounds.SHARED_RATE_WEIGHT) + regret) / m
    return q + per + math.sqrt(2 * q * per + per**2)


def gradient_promotion_bound() -> str:
    """PromQL for the same bound over a phase's gradient evidence (the verdict's ``<primary> gradients`` phase: one
    stratum of the B backward comparisons, in at most the phase's C clusters): with no gradient mismatch
    ``(log(1/alpha) - log(w) + log(1 + B / b)) / min(B, C)``, the form with divergences otherwise."""
    prior = bounds.Prior.for_max_rate(PARAMS["max_divergence"])
    budget = math.log(1 / bounds.ALPHA) - math.log(bounds.SHARED_RATE_WEIGHT)
    runs = f"{BY} ({BACKWARD_RUNS})"
    clusters = f"{BY} ({CLUSTERS})"
    clustered = f"(({runs} <= {clusters}) or {clusters} or {runs})"
    mismatched = f'{BY} ({BACKWARD_RUNS}{{outcome=~"{"|".join(DIVERGENT_OUTCOMES)}"}})'
    clean = f"({budget!r} + ln(1 + {runs} / {prior.b!r})) / {clustered}"
    strata = (runs, f"({mismatched} or {runs} * 0)", _capped(runs), f"({runs} * 0 + 1)", PHASE)
    return f"({clean} unless on ({PHASE}) ({mismatched} > 0)) or {_with_divergences(strata)}"


#: A run's targets rolled back and not reset since, kept across process restarts (a counter a restart resets).
ROLLED_BACK = "npu_shadow:rolled_back:latched"


def rolled_back_latch() -> str:
    """PromQL: 1 for each (job, run, target) rolled back and not reset by a person since. Within a process, more
    rollbacks than resets (each reset follows a rollback); across a restart, the rule's own last value, kept until a
    reset is counted (a rule that reads its own series latches: Prometheus keeps it while it evaluates)."""
    by, on = "sum by (job, run, target)", "on (job, run, target)"
    now = f"{by} ({ROLLBACKS}) > {by} ({RESETS}) or {by} ({ROLLBACKS}) > 0 unless {on} {by} ({RESETS})"
    reset = f"{by} ({promql.increase(RESETS, PARAMS['hard_window'])}) > 0"
    return f"group by (job, run, target) (({now}) or ({ROLLED_BACK} unless {on} ({reset})))"


def _fnmatch_regex(pattern: str) -> str:
    """A risky signature's fnmatch pattern as a PromQL (RE2) regex."""
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern).replace("\\", "\\\\")


def _risky_uncovered() -> str:
    """PromQL: the (job, run, target) of a built-in target one of whose risky signatures, where the job took it, was
    compared fewer times than the verdict's default --min-per-signature (each signature on its own, as the
    verdict counts them: another matching the same pattern covers none of its calls)."""
    from shadow.core.model.observation import BUILTIN_RISKY

    needed = decisions.DEFAULT_MIN_PER_SIGNATURE
    by, on = "group by (job, run, target)", "on (job, run, target)"
    by_signature, on_signature = "group by (job, run, target, signature)", "on (job, run, target, signature)"
    parts = []
    for name, patterns in sorted(BUILTIN_RISKY.items()):
        for pattern in patterns:
            regex = _fnmatch_regex(pattern)
            selector = f'{COMPARISONS}{{{COMPARED},target="{name}"}}'
            risky = f'{COMPARISONS}{{{COMPARED},target="{name}",signature=~"{regex}"}}'
            # as the verdict: each risky signature the job took blocks until it is compared enough; one it never
            # called is not exercised
            taken = (
                f'{by_signature} ({CALLS}{{target="{name}",signature=~"{regex}"}} > 0) '
                f"or {by_signature} ({risky} > 0) "
                f'or {by_signature} ({SKIPPED}{{target="{name}",signature=~"{regex}"}} > 0)'
            )
            parts.append(
                f"{by} (({taken}) unless {on_signature} sum by (job, run, target, signature) ({risky}) >= {needed})"
            )
            # where calls are not counted by signature, which it took is not known: the pattern's comparisons
            labelled = f'{by} ({CALLS}{{target="{name}",signature!=""}})'
            unlabelled = f'{by} ({CALLS}{{target="{name}"}}) unless {on} {labelled}'
            enough = f"sum by (job, run, target) ({risky}) >= {needed}"
            parts.append(f"({by} ({selector}) and {on} ({unlabelled}) unless {on} {enough})")
    return " or ".join(parts)


def _wilson_upper(p: str, n: str) -> str:
    """One-sided 95% Wilson score upper bound of a proportion, for display (the verdict uses Clopper-Pearson)."""
    z, z2 = repr(Z95), repr(Z95 * Z95)
    return f"({p} + {z2} / (2 * {n}) + {z} * sqrt({p} * (1 - {p}) / {n} + {z2} / (4 * {n} ^ 2))) / (1 + {z2} / {n})"


def _alert(name: str, expr: str, severity: str, action: str, summary: str, runbook: str, for_: str | None) -> dict:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_:
        rule["for"] = for_
    rule["labels"] = {"severity": severity, "action": action}
    rule["annotations"] = {"summary": summary, "runbook": runbook}
    return rule


def _burn(params: dict, name: str, severity: str, action: str, runbook: str) -> dict:
    threshold = params["factor"] * PARAMS["max_divergence"]
    long_w, short_w = params["long"], params["short"]
    expr = (
        f"npu_shadow:divergence:ratio_rate{long_w} > {threshold:g}"
        f" and npu_shadow:divergence:ratio_rate{short_w} > {threshold:g}"
        f" and npu_shadow:comparisons:effective_increase{long_w} >= {PARAMS['min_samples']}"
    )
    summary = (
        f"{{{{ $labels.target }}}} in {{{{ $labels.job }}}} diverges at {params['factor']:g}x the budget of "
        f"{PARAMS['max_divergence']:g} ({long_w} and {short_w} windows)"
    )
    return _alert(name, expr, severity, action, summary, runbook, params["for"])


def _recent_windows_within(max_rate: float, divergent: str) -> str:
    """The promotion alert's clauses that hold it back where a recent window's rate, forward or gradients, is above
    the max rate (a burst of minutes is diluted in an hour: each window sees those of about its length)."""
    clauses = []
    mismatched = f'{BACKWARD_RUNS}{{outcome=~"{divergent}"}}'
    for window in RECENT_WINDOWS:
        clauses.append(f" unless on (job, run, target) (npu_shadow:divergence:ratio_rate{window} > {max_rate!r})")
        clauses.append(
            f" unless on (job, run, target) ({BY} ({promql.increase(mismatched, window)})"
            f" / {BY} ({promql.increase(BACKWARD_RUNS, window)}) > {max_rate!r})"
        )
    return "".join(clauses)


def _alerting_rules() -> list[dict]:
    hard = "|".join(HARD_REASONS)
    hard_mismatches = f'{MISMATCHES}{{reason=~"{hard}"}}'
    errored = f'{COMPARISONS}{{outcome="error"}}'
    blind, errors, overhead = PARAMS["blind"], PARAMS["upstream_errors"], PARAMS["overhead"]
    nonresponse = "|".join(NONRESPONSE_REASONS)
    called = _per_signature(f'{CALLS}{{signature!=""}}', None)
    compared = _per_signature(f"{COMPARISONS}{{{COMPARED}}}", None)
    max_rate, divergent = PARAMS["max_divergence"], "|".join(DIVERGENT_OUTCOMES)
    return [
        _burn(
            PARAMS["fast_burn"],
            "NpuShadowDivergenceFastBurn",
            "page",
            "rollback",
            "Upstream diverges from legacy fast. Keep the torch_npu patch (roll back any removal); read the "
            "journal's mismatch details and replay a capture to find the cause.",
        ),
        _burn(
            PARAMS["slow_burn"],
            "NpuShadowDivergenceSlowBurn",
            "ticket",
            "investigate",
            f"Upstream diverges slowly but steadily. Look at {MISMATCHES} by reason and at the "
            "error histograms; run `npu-shadow verdict` before deciding.",
        ),
        _burn(
            PARAMS["sustained_burn"],
            "NpuShadowDivergenceSustained",
            "ticket",
            "investigate",
            "Upstream has diverged above the budget for the last hour, whatever the history before it (a change "
            "of data, of phase, of a node): the verdict's recent window refuses promotion meanwhile. Read the "
            "journal's mismatches of the last hour and run `npu-shadow verdict`.",
        ),
        _alert(
            "NpuShadowHardMismatch",
            f"sum by (job, run, target, reason) ({promql.increase(hard_mismatches, PARAMS['hard_window'])}) > 0",
            "page",
            "rollback",
            "{{ $labels.target }} in {{ $labels.job }}: {{ $labels.reason }} mismatch between legacy and upstream",
            "A difference in kind (dtype, shape, NaN/inf, structure, device or an exception) that no tolerance "
            "explains. Keep the patch; the journal's detail and the capture show the call.",
            None,
        ),
        _alert(
            "NpuShadowBlind",
            f"{BY} ({promql.increase(CALLS, blind['window'])}) * on (job, run, target) "
            f"max by (job, run, target) ({SAMPLE_RATE}) >= {blind['expected']} "
            # Raw series, not the recording rules: a recorded total can lag the calls scraped with it by one
            # evaluation, which made the alert pending for a healthy job whose first comparisons had just arrived.
            f"unless on (job, run, target) {BY} ({promql.increase(COMPARED_SERIES, blind['window'])}) > 0",
            "ticket",
            "investigate",
            "{{ $labels.target }} in {{ $labels.job }} is called and sampled but nothing is compared",
            f"Every sampled call was skipped (see {SKIPPED} by reason: oom, compiling, mode, budget) "
            "or the exporter lost them. No evidence accumulates until this is fixed.",
            blind["for"],
        ),
        _alert(
            "NpuShadowUpstreamErrors",
            f"{BY} ({promql.rate(errored, errors['window'])}) "
            f"/ npu_shadow:comparisons:rate{errors['window']} > {errors['ratio']:g} "
            f"and npu_shadow:comparisons:increase{errors['window']} >= {PARAMS['min_samples']}",
            "ticket",
            "investigate",
            "upstream {{ $labels.target }} raises where legacy does not, in most comparisons of {{ $labels.job }}",
            "Upstream cannot run here (e.g. parallel_apply without torch.accelerator, torch < 2.10). Check "
            "`npu-shadow doctor`; until fixed this target gives no evidence either way.",
            errors["for"],
        ),
        _alert(
            "NpuShadowOverhead",
            f"npu_shadow:overhead:ratio_rate15m > {overhead['ratio']:g} "
            f"and {BY} ({promql.rate(SHADOW_TIME, overhead['window'])}) > {overhead['time_fraction']:g}",
            "ticket",
            "investigate",
            f"shadowing {{{{ $labels.target }}}} costs over {overhead['ratio']:g}x legacy's time and over "
            f"{overhead['time_fraction']:.0%} of wall time in {{{{ $labels.job }}}}",
            "Lower the sample rate of this target (--sample-rate target=rate); the evidence grows slower but "
            "training is not slowed.",
            overhead["for"],
        ),
        _alert(
            "NpuShadowPromotionEvidence",
            f"npu_shadow:promotion:upper_bound_approx < {max_rate!r}"
            # every phase of the target (forward and gradients) bounded below the max rate
            f" unless on (job, run, target) (npu_shadow:promotion:upper_bound_approx >= {max_rate!r})"
            f" unless on (job, run, target) (npu_shadow:promotion:gradient_upper_bound_approx >= {max_rate!r})"
            # no hard mismatch (a difference in kind: the verdict rolls back on one)
            f' unless on (job, run, target) sum by (job, run, target) ({MISMATCHES}{{reason=~"{hard}"}}) > 0'
            # no signature diverging on most of its calls (the verdict may roll it back on its own)
            f" unless on (job, run, target) ({STRATUM_DIVERGENT} / {STRATUM_COMPARED} > {verdict.SYSTEMATIC_RATE!r})"
            # the rates of the last hour, 15 and 5 minutes within the max rate (the verdict's recent windows)
            f"{_recent_windows_within(max_rate, divergent)}"
            # no call skipped for a reason tied to the call (non-response)
            f' unless on (job, run, target) sum by (job, run, target) ({SKIPPED}{{reason=~"{nonresponse}"}}) > 0'
            # every signature with calls compared
            f" unless on (job, run, target) ({called} > 0 unless {ON_SIGNATURE} {compared} > 0)"
            # never after a rollback (a person's reset and fresh evidence: judge a window after it)
            f" unless on (job, run, target) {ROLLED_BACK}"
            # never under a device's noise: its bound on the excess over legacy's own A/A rate, and the detection
            # limit a promote needs below the max rate too, are the verdict's alone (beyond PromQL)
            f" unless on (job, run, target) sum by (job, run, target) ({NOISE_CHECKS}) > 0"
            # every risky signature of a built-in target compared as often as the verdict asks
            f" unless on (job, run, target) ({_risky_uncovered()})",
            "info",
            "promote",
            f"{{{{ $labels.target }}}} in {{{{ $labels.job }}}} ({{{{ $labels.primary }}}} phase): a conservative "
            f"bound of the divergence rate below {PARAMS['max_divergence']:g}, in every phase and in the last hour",
            "Evidence that upstream behaves as legacy, valid however often it is looked at. Confirm with "
            "`npu-shadow verdict` (which also clusters journals by process) before removing the patch.",
            PARAMS["promotion"]["for"],
        ),
    ]


def rule_groups() -> dict:
    """The rules file's content."""
    return {
        "groups": [
            {"name": "npu_shadow_recording", "rules": _recording_rules()},
            {"name": "npu_shadow_alerts", "rules": _alerting_rules()},
        ]
    }


RULES_PATH = pathlib.Path(__file__).parent / "prometheus" / "npu_shadow.rules.yml"
HEADER = "# Generated by `python -m dashboards.rules` from the thresholds in dashboards/rules.py. Do not edit.\n"


def render() -> str:
    import yaml

    return HEADER + yaml.safe_dump(rule_groups(), sort_keys=False, width=1000)


if __name__ == "__main__":
    RULES_PATH.write_text(render())
    print(f"wrote {RULES_PATH}")
