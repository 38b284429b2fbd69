"""The Prometheus recording and alerting rules, generated from one table of thresholds.

Run ``python -m dashboards.rules`` to rewrite ``dashboards/prometheus/npu_shadow.rules.yml``; a test
regenerates it and fails when the committed file is stale.

Divergence = comparisons whose outcome is ``mismatch`` or ``error``, over comparisons that were made
(``skipped`` excluded). Where calls are counted by signature (coverage-guided sampling over-represents rare
signatures among comparisons), the rate weights each signature by its share of calls, and the bound's sample size
is Kish's effective one, as ``npu-shadow verdict`` computes them; elsewhere it is the plain ratio. Everything is
aggregated by ``job`` and ``target``: the ranks of a job are its instances. Burn-rate windows follow the SRE
workbook, scaled down for training jobs (hours, not months).
"""

from __future__ import annotations

import pathlib
from typing import Any

from dashboards.series import (
    CALLS,
    COMPARED,
    COMPARISONS,
    DIVERGENT,
    HARD_REASONS,
    LEGACY_TIME,
    MISMATCHES,
    SAMPLE_RATE,
    SHADOW_TIME,
    SKIPPED,
)
from shadow.analysis import verdict

#: Every threshold, in one place.
PARAMS: dict[str, Any] = {
    # the divergence rate the rollout tolerates (the error budget); `npu-shadow verdict --max-rate` default
    "max_divergence": verdict.DEFAULT_MAX_RATE,
    # comparisons a window must hold before a ratio alert may fire
    "min_samples": 100,
    "fast_burn": {"factor": verdict.BURN_RATE_FACTORS["fast burn"], "long": "30m", "short": "5m", "for": "1m"},
    "slow_burn": {"factor": verdict.BURN_RATE_FACTORS["slow burn"], "long": "2h", "short": "15m", "for": "5m"},
    "hard_window": "10m",
    # blind: calls * sample rate promised this many comparisons in the window, and none came
    "blind": {"window": "15m", "expected": 20, "for": "10m"},
    "upstream_errors": {"window": "15m", "ratio": 0.5, "for": "5m"},
    # overhead: shadow time over legacy time on sampled calls, and shadow time per second of wall time
    "overhead": {"window": "15m", "ratio": 2.0, "time_fraction": 0.02, "for": "15m"},
    "promotion": {"for": "30m"},
}

WINDOWS = ("5m", "15m", "30m", "1h", "2h", "6h")
Z95 = 1.6448536269514722  # one-sided 95%

BY = "sum by (job, target)"


BY_SIGNATURE = "sum by (job, target, signature)"


def _per_signature(selector: str, window: str | None) -> str:
    return f"{BY_SIGNATURE} ({f'rate({selector}[{window}])' if window else selector})"


def _weighted(window: str | None) -> tuple[str, str]:
    """PromQL for (the divergence rate with each signature weighted by its share of calls, Kish's effective sample
    size) over the signatures compared, where calls are counted by signature (see the verdict)."""
    compared = _per_signature(f"{COMPARISONS}{{{COMPARED}}}", window)
    divergent = _per_signature(f"{COMPARISONS}{{{DIVERGENT}}}", window)
    calls = _per_signature(f'{CALLS}{{signature!=""}}', window)
    seen = f"({compared} > 0)"
    share = f"({calls} and on (job, target, signature) {seen})"
    rate = f"{BY} ((({divergent} or {compared} * 0) / {seen}) * on (job, target, signature) {calls}) / {BY} ({share})"
    effective = f"{BY} ({share}) ^ 2 / {BY} ({calls} ^ 2 / on (job, target, signature) {seen})"
    return rate, effective


def _recording_rules() -> list[dict[str, str]]:
    weighted_rate, weighted_effective = _weighted(None)
    rules = [
        {"record": "npu_shadow:comparisons:total", "expr": f"{BY} ({COMPARISONS}{{{COMPARED}}})"},
        {"record": "npu_shadow:divergent:total", "expr": f"{BY} ({COMPARISONS}{{{DIVERGENT}}})"},
        {
            "record": "npu_shadow:divergence:ratio_total",
            "expr": f"({weighted_rate}) or npu_shadow:divergent:total / npu_shadow:comparisons:total",
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
                "expr": f"{BY} (rate({COMPARISONS}{{{COMPARED}}}[{window}]))",
            },
            {
                "record": f"npu_shadow:divergent:rate{window}",
                "expr": f"{BY} (rate({COMPARISONS}{{{DIVERGENT}}}[{window}]))",
            },
            {
                "record": f"npu_shadow:divergence:ratio_rate{window}",
                "expr": f"({_weighted(window)[0]}) "
                f"or npu_shadow:divergent:rate{window} / npu_shadow:comparisons:rate{window}",
            },
            {
                "record": f"npu_shadow:comparisons:increase{window}",
                "expr": f"{BY} (increase({COMPARISONS}{{{COMPARED}}}[{window}]))",
            },
        ]
    rules += [
        {
            "record": "npu_shadow:divergence:wilson_upper_total",
            "expr": _wilson_upper("npu_shadow:divergence:ratio_total", "npu_shadow:comparisons:effective_total"),
        },
        {
            "record": "npu_shadow:overhead:ratio_rate15m",
            "expr": f"{BY} (rate({SHADOW_TIME}[15m])) / {BY} (rate({LEGACY_TIME}[15m]))",
        },
    ]
    return rules


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
        f" and npu_shadow:comparisons:increase{long_w} >= {PARAMS['min_samples']}"
    )
    summary = (
        f"{{{{ $labels.target }}}} in {{{{ $labels.job }}}} diverges at {params['factor']:g}x the budget of "
        f"{PARAMS['max_divergence']:g} ({long_w} and {short_w} windows)"
    )
    return _alert(name, expr, severity, action, summary, runbook, params["for"])


def _alerting_rules() -> list[dict]:
    hard = "|".join(HARD_REASONS)
    blind, errors, overhead = PARAMS["blind"], PARAMS["upstream_errors"], PARAMS["overhead"]
    needed = verdict.comparisons_needed(PARAMS["max_divergence"])  # with zero divergences: about 3 / max
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
        _alert(
            "NpuShadowHardMismatch",
            f'sum by (job, target, reason) (increase({MISMATCHES}{{reason=~"{hard}"}}[{PARAMS["hard_window"]}])) > 0',
            "page",
            "rollback",
            "{{ $labels.target }} in {{ $labels.job }}: {{ $labels.reason }} mismatch between legacy and upstream",
            "A difference in kind (dtype, shape, NaN/inf, structure, device or an exception) that no tolerance "
            "explains. Keep the patch; the journal's detail and the capture show the call.",
            None,
        ),
        _alert(
            "NpuShadowBlind",
            f"{BY} (increase({CALLS}[{blind['window']}])) * on (job, target) "
            f"max by (job, target) ({SAMPLE_RATE}) >= {blind['expected']} "
            # Raw series, not the recording rules: a recorded total can lag the calls scraped with it by one
            # evaluation, which made the alert pending for a healthy job whose first comparisons had just arrived.
            f"unless on (job, target) {BY} (increase({COMPARISONS}{{{COMPARED}}}[{blind['window']}])) > 0 "
            # increase() cannot see a series whose first sample is already non-zero (a new signature): the
            # summed total's growth over the window, a series absent then counted as 0, sees it
            f"unless on (job, target) ({BY} ({COMPARISONS}{{{COMPARED}}}) - ({BY} ({COMPARISONS}{{{COMPARED}}} "
            f"offset {blind['window']}) or {BY} ({COMPARISONS}{{{COMPARED}}}) * 0)) > 0",
            "ticket",
            "investigate",
            "{{ $labels.target }} in {{ $labels.job }} is called and sampled but nothing is compared",
            f"Every sampled call was skipped (see {SKIPPED} by reason: oom, compiling, mode, budget) "
            "or the exporter lost them. No evidence accumulates until this is fixed.",
            blind["for"],
        ),
        _alert(
            "NpuShadowUpstreamErrors",
            f'{BY} (rate({COMPARISONS}{{outcome="error"}}[{errors["window"]}])) '
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
            f"and {BY} (rate({SHADOW_TIME}[{overhead['window']}])) > {overhead['time_fraction']:g}",
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
            f"npu_shadow:comparisons:total >= {needed} and npu_shadow:divergent:total == 0",
            "info",
            "promote",
            f"{{{{ $labels.target }}}} in {{{{ $labels.job }}}}: no divergence in at least {needed} comparisons",
            "Enough evidence that upstream behaves as legacy. Confirm with `npu-shadow verdict` (which also checks "
            "that the risky call signatures were exercised) before removing the patch.",
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
