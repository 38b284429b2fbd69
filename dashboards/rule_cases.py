"""Unit tests of the rules for ``promtool test rules``: every alert firing, and not firing below its
threshold, with too few samples and at no traffic (where ratios divide zero by zero).

Run ``python -m dashboards.rule_cases`` to rewrite ``dashboards/prometheus/npu_shadow.rules_test.yml``.
The cases are written here rather than in YAML so that the expected annotations are rendered from the
rules themselves; the firing conditions are spelled out below, by hand.
"""

from __future__ import annotations

import math
import pathlib
import re
from typing import Any

from dashboards import rules
from shadow.analysis import verdict

JOB, TARGET = "train", "tensor_type"
TEST_PATH = pathlib.Path(__file__).parent / "prometheus" / "npu_shadow.rules_test.yml"
#: The cases read after a hundred minutes or more (the promotion evidence, the sustained burn, no traffic), in a file
#: of their own evaluated every COARSE_STEP: their rules' windows read the input's one-minute samples whatever the
#: step, and an alert's ``for`` holds at it; at a minute's step promtool took four times as long for the same
#: assertions.
COARSE_TEST_PATH = TEST_PATH.with_name("npu_shadow.rules_coarse_test.yml")
COARSE_STEP = "5m"
COARSE_FROM_MINUTES = 100


def series(metric: str, values: str, **labels: str) -> dict[str, str]:
    labels = {"job": JOB, "instance": "rank0", "target": TARGET, **labels}
    rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{rendered}}}", "values": values}


def comparisons(outcome: str, values: str) -> dict[str, str]:
    return series("npu_shadow_comparisons_total", values, outcome=outcome, signature="dtype/npu/blocking")


def _alerts_by_name() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules.rule_groups()["groups"][1]["rules"]}


def expected(alertname: str, **labels: str) -> dict[str, Any]:
    """An alert as promtool must see it: our labels plus the rule's, annotations rendered."""
    rule = _alerts_by_name()[alertname]
    labels = {"job": JOB, "target": TARGET, **labels}

    def render(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)

    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {key: render(value) for key, value in rule["annotations"].items()},
    }


def case(name: str, input_series: list[dict], alerts: list[tuple[str, str, list[dict]]], exprs=()) -> dict:
    test: dict[str, Any] = {"name": name, "interval": "1m", "input_series": input_series}
    test["alert_rule_test"] = [
        {"eval_time": at, "alertname": alertname, "exp_alerts": exp} for at, alertname, exp in alerts
    ]
    if exprs:
        test["promql_expr_test"] = list(exprs)
    return test


def cases() -> list[dict]:
    quiet = [
        comparisons(o, "0x120") for o in ("match", "close", "mismatch", "error", "skipped")
    ]  # series that never move: no traffic
    return [
        case(
            "hard mismatch fires at once; a value mismatch is not hard",
            [
                series("npu_shadow_mismatches_total", "0 0 0 1 1 1 1", reason="dtype"),
                series("npu_shadow_mismatches_total", "0 0 0 5 9 12 20", reason="value"),
            ],
            [
                ("2m", "NpuShadowHardMismatch", []),
                ("4m", "NpuShadowHardMismatch", [expected("NpuShadowHardMismatch", reason="dtype")]),
            ],
        ),
        case(
            "series appear at their first event: a hard mismatch first scraped at 1 pages once, a burst of 600 "
            "mismatches first scraped at once burns fast, a reset first scraped at 1 clears the latch",
            [
                series("npu_shadow_mismatches_total", "_ _ _ 1x30", reason="dtype"),
                comparisons("match", "0+1000x60"),
                series(
                    "npu_shadow_comparisons_total", "_x30 600x30", outcome="mismatch", signature="dtype/npu/blocking"
                ),
                series("npu_shadow_rollbacks_total", "0 0 1x30", job="latched", source="http"),
                series("npu_shadow_resets_total", "_x5 1x30", job="latched"),
                series("npu_shadow_calls_total", "0x30", job="fresh", signature="", primary="legacy"),
            ],
            [
                ("4m", "NpuShadowHardMismatch", [expected("NpuShadowHardMismatch", reason="dtype")]),
                ("20m", "NpuShadowHardMismatch", []),
                ("33m", "NpuShadowDivergenceFastBurn", [expected("NpuShadowDivergenceFastBurn")]),
            ],
            [
                {
                    "expr": f'{rules.ROLLED_BACK}{{job="latched"}}',
                    "eval_time": "4m",
                    "exp_samples": [
                        {"labels": f'{rules.ROLLED_BACK}{{job="latched",run="",target="{TARGET}"}}', "value": 1}
                    ],
                },
                {"expr": f'{rules.ROLLED_BACK}{{job="latched"}}', "eval_time": "9m", "exp_samples": []},
                # (a target installed and not yet compared: its totals are 0, not absent)
                *(
                    {
                        "expr": f'{record}{{job="fresh"}}',
                        "eval_time": "4m",
                        "exp_samples": [
                            {"labels": f'{record}{{job="fresh",primary="legacy",target="{TARGET}"}}', "value": 0}
                        ],
                    }
                    for record in ("npu_shadow:comparisons:total", "npu_shadow:divergent:total")
                ),
            ],
        ),
        case(
            "fast burn: 5% divergence fires, 1% does not, 50% of too few samples does not",
            [
                comparisons("match", "0+1000x60"),
                comparisons("mismatch", "0+50x60"),
                series("npu_shadow_comparisons_total", "0+1000x60", job="low", outcome="match", signature="x"),
                series("npu_shadow_comparisons_total", "0+10x60", job="low", outcome="mismatch", signature="x"),
                series("npu_shadow_comparisons_total", "0+1x60", job="few", outcome="match", signature="x"),
                series("npu_shadow_comparisons_total", "0+1x60", job="few", outcome="error", signature="x"),
            ],
            [
                ("40m", "NpuShadowDivergenceFastBurn", [expected("NpuShadowDivergenceFastBurn")]),
                (
                    "40m",
                    "NpuShadowDivergenceSlowBurn",
                    [expected("NpuShadowDivergenceSlowBurn"), expected("NpuShadowDivergenceSlowBurn", job="low")],
                ),
            ],
        ),
        case(
            "ten clean hours then an hour at 5x the max rate: the sustained burn fires, the faster ones do not",
            [
                comparisons("match", "0+1000x660"),
                comparisons("mismatch", "0x600 0+5x60"),
            ],
            [
                ("590m", "NpuShadowDivergenceSustained", []),
                ("665m", "NpuShadowDivergenceSustained", [expected("NpuShadowDivergenceSustained")]),
                ("665m", "NpuShadowDivergenceFastBurn", []),
                ("665m", "NpuShadowDivergenceSlowBurn", []),
            ],
        ),
        case(
            "no traffic: ratios are 0/0 and nothing fires",
            [*quiet, series("npu_shadow_calls_total", "0x120"), series("npu_shadow_sample_rate", "0.01x120")],
            [(at, alertname, []) for at in ("30m", "119m") for alertname in _alerts_by_name()],
        ),
        case(
            "blind: sampled calls but no comparisons; not when comparisons come (in new series too) or the rate is 0",
            [
                series("npu_shadow_calls_total", "0+1000x60"),
                series("npu_shadow_sample_rate", "0.1x60"),
                comparisons("match", "0x60"),
                series("npu_shadow_calls_total", "0+1000x60", job="fine"),
                series("npu_shadow_sample_rate", "0.1x60", job="fine"),
                series("npu_shadow_comparisons_total", "0+100x60", job="fine", outcome="match", signature="x"),
                series("npu_shadow_calls_total", "0+1000x60", job="off"),
                series("npu_shadow_sample_rate", "0x60", job="off"),
                # comparisons that arrive only in new signature series, each first scraped at its final value
                series("npu_shadow_calls_total", "0+1000x60", job="new_series"),
                series("npu_shadow_sample_rate", "0.1x60", job="new_series"),
                series("npu_shadow_comparisons_total", "_x20 5x40", job="new_series", outcome="match", signature="a"),
                series("npu_shadow_comparisons_total", "_x24 3x36", job="new_series", outcome="match", signature="b"),
            ],
            [
                ("5m", "NpuShadowBlind", []),
                ("30m", "NpuShadowBlind", [expected("NpuShadowBlind")]),
            ],
        ),
        case(
            "upstream errors: 90% errors fire, 10% do not",
            [
                comparisons("error", "0+100x60"),
                comparisons("match", "0+10x60"),
                series("npu_shadow_comparisons_total", "0+10x60", job="some", outcome="error", signature="x"),
                series("npu_shadow_comparisons_total", "0+90x60", job="some", outcome="match", signature="x"),
            ],
            [("30m", "NpuShadowUpstreamErrors", [expected("NpuShadowUpstreamErrors")])],
        ),
        case(
            "overhead: 6x the primary's time and 10% of wall time fires; 6x but 1% does not (an older job's "
            "legacy-named series read alike)",
            [
                series("npu_shadow_shadow_seconds_total", "0+6x60"),
                series("npu_shadow_primary_run_seconds_total", "0+1x60"),
                series("npu_shadow_shadow_seconds_total", "0+0.6x60", job="cheap"),
                series("npu_shadow_legacy_seconds_total", "0+0.1x60", job="cheap"),
            ],
            [
                ("10m", "NpuShadowOverhead", []),
                ("40m", "NpuShadowOverhead", [expected("NpuShadowOverhead")]),
            ],
        ),
        case(
            "recording rules: totals, ratio and its Wilson bound",
            [comparisons("match", "0+3x10"), comparisons("mismatch", "0+1x10"), comparisons("skipped", "0+7x10")],
            [],
            exprs=[
                {
                    "expr": "npu_shadow:comparisons:total",
                    "eval_time": "10m",
                    "exp_samples": [
                        {"labels": f'npu_shadow:comparisons:total{{job="{JOB}",target="{TARGET}"}}', "value": 40}
                    ],
                },
                {
                    "expr": "npu_shadow:divergence:ratio_total",
                    "eval_time": "10m",
                    "exp_samples": [
                        {"labels": f'npu_shadow:divergence:ratio_total{{job="{JOB}",target="{TARGET}"}}', "value": 0.25}
                    ],
                },
                {
                    "expr": "npu_shadow:divergence:wilson_upper_total",
                    "eval_time": "10m",
                    "exp_samples": [
                        {
                            "labels": f'npu_shadow:divergence:wilson_upper_total{{job="{JOB}",target="{TARGET}"}}',
                            "value": verdict.wilson_upper(10, 40),
                        }
                    ],
                },
            ],
        ),
        guided_case(),
        *(promotion_case(c) for c in PROMOTION_CASES),
    ]


def guided_case() -> dict:
    """Coverage-guided sampling: calls by signature weight the rate (as the verdict weights it), and the gates'
    sample size is Kish's effective one. A rare signature (0.1% of calls) compared 10 times with 5 divergences,
    a common one compared 100 times with none: the rate is 0.1% x 50%, not 5/110."""
    rare, common = {"signature": "rare"}, {"signature": "common"}
    calls, compared = {"common": 9990.0, "rare": 10.0}, {"common": 100.0, "rare": 10.0}
    rate = calls["rare"] / sum(calls.values()) * 5.0 / compared["rare"]
    effective = sum(calls.values()) ** 2 / sum(calls[s] ** 2 / compared[s] for s in calls)  # Kish
    labels = f'{{job="{JOB}",target="{TARGET}"}}'

    def expect(record: str, value: float) -> dict:
        return {"expr": record, "eval_time": "10m", "exp_samples": [{"labels": record + labels, "value": value}]}

    return case(
        "weighted by each signature's share of calls where calls are counted by signature",
        [
            series("npu_shadow_calls_total", "0+999x10", **common),
            series("npu_shadow_calls_total", "0+1x10", **rare),
            series("npu_shadow_comparisons_total", "0+10x10", outcome="match", **common),
            series("npu_shadow_comparisons_total", "0+0.5x10", outcome="match", **rare),
            series("npu_shadow_comparisons_total", "0+0.5x10", outcome="mismatch", **rare),
        ],
        [],
        exprs=[
            expect("npu_shadow:divergence:ratio_total", rate),
            expect("npu_shadow:comparisons:effective_total", effective),
            expect("npu_shadow:divergence:wilson_upper_total", verdict.wilson_upper(rate * effective, effective)),
            expect("npu_shadow:divergence:ratio_rate5m", rate),
        ],
    )


def _last_minute(test: dict) -> int:
    """The minute of a case's last evaluation."""
    checks = test.get("alert_rule_test", []) + test.get("promql_expr_test", [])
    return max(int(check["eval_time"].removesuffix("m")) for check in checks)


def render(coarse: bool = False) -> str:
    """The promtool test file of the cases evaluated every minute, or (``coarse``) of those read after
    :data:`COARSE_FROM_MINUTES` or more, evaluated every :data:`COARSE_STEP`."""
    import yaml

    chosen = [test for test in cases() if (_last_minute(test) >= COARSE_FROM_MINUTES) == coarse]
    step = COARSE_STEP if coarse else "1m"
    content = {"rule_files": [rules.RULES_PATH.name], "evaluation_interval": step, "tests": chosen}
    header = "# Generated by `python -m dashboards.rule_cases` (cases in dashboards/rule_cases.py). Do not edit.\n"
    return header + yaml.safe_dump(content, sort_keys=False, width=1000)


#: NpuShadowPromotionEvidence against the verdict: per case, the per-minute growth of each series of one job by
#: phase and signature (calls, comparisons, divergent comparisons), extra series, and whether the alert fires at
#: EVAL; tests/test_dashboards.py decides the same counts with the verdict and checks that the alert never fires
#: where the verdict would not promote (and that it does fire where the verdict promotes with room to spare).
PROMOTION_EVAL_MINUTES = 100
CLEAN = {"a": (900, 90, 0), "b": (100, 10, 0)}  # calls in proportion: 10,000 comparisons at EVAL
PROMOTION_CASES = [
    {
        "name": "clean, compared in proportion to calls: fires",
        "phases": {"legacy": CLEAN},
        "fires": True,
        "bound": True,
    },
    {"name": "an under-sampled signature", "phases": {"legacy": {"a": (950, 95, 0), "b": (50, 0.3, 0)}}},
    {"name": "a signature with calls never compared", "phases": {"legacy": {**CLEAN, "c": (10, 0, 0)}}},
    {
        "name": "calls skipped out of memory",
        "phases": {"legacy": CLEAN},
        "skipped": {("legacy", "a", "oom"): 0.1},
    },
    {
        "name": "a canary phase that diverged, pooled away by a clean shadowing phase",
        "phases": {"legacy": CLEAN, "upstream": {"a": (90, 9, 0.01)}},
    },
    {"name": "rolled back", "phases": {"legacy": CLEAN}, "rollbacks": 0.01},
    {
        "name": "rolled back, then the process restarted (its rollback counter back at zero)",
        "phases": {"legacy": CLEAN},
        "raw": [("npu_shadow_rollbacks_total", "0 1x29 0x90", {"source": "http"})],
        "rolled_back": True,
    },
    {
        "name": "rolled back, then reset by a person: fires",
        "phases": {"legacy": CLEAN},
        "raw": [
            ("npu_shadow_rollbacks_total", "0 1x119", {"source": "http"}),
            ("npu_shadow_resets_total", "0x20 1x99", {}),
        ],
        "fires": True,
    },
    {
        "name": "clean but in few clusters (one process, correlated)",
        "phases": {"legacy": CLEAN},
        "clusters": {"legacy": 1},
    },
    {
        "name": "clean, each comparison its own cluster: fires",
        "phases": {"legacy": CLEAN},
        "clusters": {"legacy": 100},
        "fires": True,
    },
    {
        "name": "tensor_type whose job never took its risky signatures (not exercised): fires",
        "target": "tensor_type",
        "phases": {"legacy": {"dtype/cpu/blocking": (1000, 100, 0)}},
        "fires": True,
    },
    {
        "name": "clean, gradients compared on a twentieth of the comparisons: too few to bound alone",
        "phases": {"legacy": CLEAN},
        "backward": {("legacy", "a"): 5},
    },
    {
        "name": "clean, every comparison's gradients compared too: fires",
        "phases": {"legacy": CLEAN},
        "backward": {("legacy", "a"): 90, ("legacy", "b"): 10},
        "fires": True,
    },
    {
        "name": "tensor_type whose job took two risky signatures of one pattern, one of them compared too rarely",
        "target": "tensor_type",
        "phases": {
            "legacy": {
                "dtype/cpu/blocking": (10_000, 100, 0),
                "npu_name/noncurrent/blocking": (10, 1, 0),
                "npu_name/noncurrent/nonblocking": (1, 0.2, 0),
            }
        },
    },
    {
        "name": "tensor_type whose job took two risky signatures of one pattern, each compared enough: fires",
        "target": "tensor_type",
        "phases": {
            "legacy": {
                "dtype/cpu/blocking": (10_000, 100, 0),
                "npu_name/noncurrent/blocking": (10, 1, 0),
                "npu_name/noncurrent/nonblocking": (1, 0.6, 0),  # (30 by 50m: the alert holds its 30m)
            }
        },
        "fires": True,
    },
    {
        "name": "a few value divergences in ample evidence: fires",
        "phases": {"legacy": {"a": (9000, 900, 0.03), "b": (1000, 100, 0)}},
        "fires": True,
        "bound": True,
    },
    {
        "name": "a few value divergences in too little evidence",
        "phases": {"legacy": {"a": (900, 90, 0.03), "b": (100, 10, 0)}},
    },
    {
        "name": "a few value divergences in ample evidence, but in few clusters",
        "phases": {"legacy": {"a": (9000, 900, 0.03), "b": (1000, 100, 0)}},
        "clusters": {"legacy": 50},
        "bound": True,
    },
    {
        "name": "a few divergences in ample evidence, one of them a hard mismatch",
        "phases": {"legacy": {"a": (9000, 900, 0.03), "b": (1000, 100, 0)}},
        "hard": {("legacy", "dtype"): 0.01},
    },
    {
        "name": "a rare signature that diverges on every call it was compared on",
        "phases": {"legacy": {"a": (9000, 900, 0), "b": (1000, 100, 0), "c": (0.5, 0.5, 0.5)}},
    },
    {
        "name": "every comparison's gradients compared, a few differing in ample evidence: fires",
        "phases": {"legacy": {"a": (9000, 900, 0.03), "b": (1000, 100, 0)}},
        "backward": {("legacy", "a"): 900, ("legacy", "b"): 100},
        "backward_mismatch": {("legacy", "a"): 0.03},
        "fires": True,
    },
    {
        "name": "a twentieth of the comparisons' gradients compared, a few differing",
        "phases": {"legacy": {"a": (9000, 900, 0.03), "b": (1000, 100, 0)}},
        "backward": {("legacy", "a"): 45, ("legacy", "b"): 5},
        "backward_mismatch": {("legacy", "a"): 0.03},
    },
    {
        "name": "ample clean evidence, then ten minutes at 5x the max rate (0.83x of it over the last hour)",
        "phases": {"legacy": {"a": (90_000, 9_000, 0), "b": (10_000, 1_000, 0)}},
        "burst": {("legacy", "a"): (10, 50)},
    },
    {
        "name": "clean, but judged against a device's noise thresholds: the verdict alone decides",
        "phases": {"legacy": CLEAN},
        "noise": {("legacy", "forward", "aa", "within"): 5, ("legacy", "forward", "ab", "within"): 100},
    },
    {
        "name": "tensor_type whose job took a risky signature, compared too rarely",
        "target": "tensor_type",
        "phases": {"legacy": {"dtype/cpu/blocking": (1000, 100, 0), "npu_name/noncurrent/blocking": (1, 0.1, 0)}},
    },
]


def promotion_case(spec: dict) -> dict:
    target = spec.get("target", "op")
    minutes = PROMOTION_EVAL_MINUTES + 20
    inputs = []

    def grow(metric: str, per_minute: float, **labels: str) -> None:
        inputs.append(series(metric, f"0+{per_minute!r}x{minutes}", job="promo", target=target, **labels))

    for primary, signatures in spec["phases"].items():
        for signature, (calls, compared, divergent) in signatures.items():
            grow("npu_shadow_calls_total", calls, primary=primary, signature=signature)
            if compared:
                grow("npu_shadow_comparisons_total", compared - divergent, primary=primary, signature=signature,
                     outcome="match")  # fmt: skip
            if divergent:
                grow("npu_shadow_comparisons_total", divergent, primary=primary, signature=signature,
                     outcome="mismatch")  # fmt: skip
    for (primary, signature, reason), per_minute in spec.get("skipped", {}).items():
        grow("npu_shadow_skipped_total", per_minute, primary=primary, signature=signature, reason=reason)
    for primary, per_minute in spec.get("clusters", {}).items():
        grow("npu_shadow_clusters_total", per_minute, primary=primary)
    mismatched = spec.get("backward_mismatch", {})
    for (primary, signature), per_minute in spec.get("backward", {}).items():
        differing = mismatched.get((primary, signature), 0)
        grow("npu_shadow_backward_runs_total", per_minute - differing, primary=primary, signature=signature,
             outcome="match")  # fmt: skip
        if differing:
            grow("npu_shadow_backward_runs_total", differing, primary=primary, signature=signature,
                 outcome="mismatch")  # fmt: skip
    for (primary, reason), per_minute in spec.get("hard", {}).items():
        grow("npu_shadow_mismatches_total", per_minute, primary=primary, reason=reason)
    for (primary, evidence, pair, check), per_minute in spec.get("noise", {}).items():
        grow("npu_shadow_noise_checks_total", per_minute, primary=primary, evidence=evidence, pair=pair, check=check)
    if spec.get("rollbacks"):
        grow("npu_shadow_rollbacks_total", spec["rollbacks"], source="http")
    for (primary, signature), (burst, per_minute) in spec.get("burst", {}).items():  # (the last minutes to EVAL)
        quiet = PROMOTION_EVAL_MINUTES - burst
        values = f"0x{quiet} {per_minute!r}+{per_minute!r}x{minutes - quiet - 1}"
        inputs.append(series("npu_shadow_comparisons_total", values, job="promo", target=target, primary=primary,
                             signature=signature, outcome="mismatch"))  # fmt: skip
        inputs.append(series("npu_shadow_mismatches_total", values, job="promo", target=target, primary=primary,
                             reason="value"))  # fmt: skip
    for metric, values, labels in spec.get("raw", ()):
        inputs.append(series(metric, values, job="promo", target=target, **labels))
    fired = []
    if spec.get("fires"):
        fired = [expected("NpuShadowPromotionEvidence", job="promo", target=target, primary=primary)
                 for primary in spec["phases"]]  # fmt: skip
    exprs = []
    if spec.get("bound"):  # the recorded bound is the Python form's (rules.promotion_upper), which tests check
        ((primary, signatures),) = spec["phases"].items()
        total = sum(calls for calls, _, _ in signatures.values())
        strata = [(calls / total, k * PROMOTION_EVAL_MINUTES, n * PROMOTION_EVAL_MINUTES)
                  for calls, n, k in signatures.values()]  # fmt: skip
        clusters = spec.get("clusters", {}).get(primary)
        value = rules.promotion_upper(strata, clusters * PROMOTION_EVAL_MINUTES if clusters else None)
        labels = f'{{job="promo",primary="{primary}",target="{target}"}}'
        # (in units of 1e-12, rounded: the two evaluate the sums in different orders)
        exprs.append({"expr": "round(npu_shadow:promotion:upper_bound_approx * 1e12)",
                      "eval_time": f"{PROMOTION_EVAL_MINUTES}m",
                      "exp_samples": [{"labels": labels, "value": math.floor(value * 1e12 + 0.5)}]})  # fmt: skip
    return case(
        f"promotion evidence: {spec['name']}",
        inputs,
        [(f"{PROMOTION_EVAL_MINUTES}m", "NpuShadowPromotionEvidence", fired)],
        exprs,
    )


if __name__ == "__main__":
    for path, coarse in ((TEST_PATH, False), (COARSE_TEST_PATH, True)):
        path.write_text(render(coarse))
        print(f"wrote {path}")
