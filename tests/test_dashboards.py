"""Rules, rule tests and the dashboard: generated files up to date, promtool passes, and every
expression parses and names only metrics the exporter really emits or the rules record."""

import json
import re
import subprocess
import types

import faults
import pytest
import torch
import yaml
from metrics_helpers import promtool
from prometheus_client import CollectorRegistry, generate_latest

import shadow
from dashboards import grafana_dashboard, rule_cases, rules
from exporters import PrometheusExporter
from shadow.core.model import contract
from shadow.core.model.observation import Observation

PROMETHEUS_DIR = rules.RULES_PATH.parent
GRAFANA_DIR = grafana_dashboard.DASHBOARD_PATH.parent


def test_generated_files_are_up_to_date():
    assert rules.RULES_PATH.read_text() == rules.render(), "run: python -m dashboards.rules"
    assert rule_cases.TEST_PATH.read_text() == rule_cases.render(), "run: python -m dashboards.rule_cases"
    assert rule_cases.COARSE_TEST_PATH.read_text() == rule_cases.render(coarse=True), (
        "run: python -m dashboards.rule_cases"
    )
    assert grafana_dashboard.DASHBOARD_PATH.read_text() == grafana_dashboard.render(), (
        "run: python -m dashboards.grafana_dashboard"
    )


def run_promtool(*args, cwd=PROMETHEUS_DIR):
    # (a guard, not a measure: the unit tests take about a minute on 2 idle cores, minutes on a busy machine)
    done = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cases", [rule_cases.TEST_PATH, rule_cases.COARSE_TEST_PATH], ids=lambda path: path.stem)
def test_promtool_checks_and_unit_tests_the_rules(cases):
    assert "SUCCESS" in run_promtool("check", "rules", rules.RULES_PATH.name)
    tested = run_promtool("test", "rules", cases.name)
    assert "SUCCESS" in tested and "FAILED" not in tested


def test_every_case_is_in_one_promtool_file():
    """The cases split between the file evaluated every minute and the coarse one, none left out, none twice."""
    import yaml

    names = [t["name"] for path in (rule_cases.TEST_PATH, rule_cases.COARSE_TEST_PATH)
             for t in yaml.safe_load(path.read_text())["tests"]]  # fmt: skip
    assert sorted(names) == sorted(t["name"] for t in rule_cases.cases()) and len(set(names)) == len(names)
    coarse = yaml.safe_load(rule_cases.COARSE_TEST_PATH.read_text())
    assert coarse["evaluation_interval"] == "5m" and any(t["name"].startswith("promotion") for t in coarse["tests"])


def test_every_alert_has_severity_action_and_a_runbook():
    alerts = [r for g in rules.rule_groups()["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} == {
        "NpuShadowDivergenceFastBurn",
        "NpuShadowDivergenceSlowBurn",
        "NpuShadowDivergenceSustained",
        "NpuShadowHardMismatch",
        "NpuShadowBlind",
        "NpuShadowUpstreamErrors",
        "NpuShadowOverhead",
        "NpuShadowPromotionEvidence",
    }
    for alert in alerts:
        assert alert["labels"]["severity"] in {"page", "ticket", "info"}
        assert alert["labels"]["action"] in {"rollback", "investigate", "promote"}
        assert len(alert["annotations"]["runbook"]) > 40


def dashboard():
    return json.loads(grafana_dashboard.DASHBOARD_PATH.read_text())


def concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced, as Grafana would send it."""
    return (
        expr.replace("$__rate_interval", "5m")
        .replace("$__range", "1h")
        .replace('"$job"', '".*"')
        .replace('"$target"', '".*"')
    )


def test_dashboard_is_importable_with_its_variables():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == variables["target"]["type"] == "query"
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]
    titles = {p["title"] for p in board["panels"]}
    for wanted in (
        "Divergence rate per target",
        "Comparisons by outcome",
        "Mismatches by reason",
        "Absolute error distribution",
        "Relative error distribution",
        "Coverage by signature",
        "Shadow overhead",
        "Calls vs sampled",
        "Skipped by reason",
        "Fire drill active",
    ):
        assert wanted in titles


@pytest.mark.slow
def test_every_dashboard_expression_parses(tmp_path):
    expressions = grafana_dashboard.expressions(dashboard())
    assert len(expressions) >= 15
    groups = {
        "groups": [
            {
                "name": "dashboard_expressions",
                "rules": [{"record": f"dashboard:expr{i}", "expr": concrete(e)} for i, e in enumerate(expressions)],
            }
        ]
    }
    path = tmp_path / "dashboard_exprs.yml"
    path.write_text(yaml.safe_dump(groups))
    assert "SUCCESS" in run_promtool("check", "rules", str(path))


def scraped_metric_names():
    exporter = PrometheusExporter(registry=CollectorRegistry())
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install(
        [shadow.Target("op", ops, "op", faults.scale_wrong)],
        sample_rate=1.0,
        exporters=[exporter],
        aa_rate=1.0,
        backward_rate=1.0,
        truth_rate=1.0,
    ):
        for i in range(12):  # (legacy repeats itself: a difference is real once it did so 10 times)
            ops.op(torch.tensor([float(i)], requires_grad=True))
    # (a call judged against a noisy target's thresholds, as one is once its burn-in's 200 A/A runs are made)
    exporter.record(contract.observation_samples(Observation("op", "noise", noise_check="within", aa_check="within")))
    exporter.record(contract.arm_samples("dataloader_init", "legacy", True, 0.2))
    # (what a healthy job does not do: each series appears at its first event)
    exporter.record(contract.observation_samples(Observation("op", "match", shared_divergence="value")))
    exporter.record(contract.skip_samples("op", "budget", 1, "legacy"))
    exporter.record(contract.export_error_samples("op"))
    exporter.record(contract.rollback_samples("op", "api") + contract.reset_samples("op"))
    exporter.record(contract.patch_call_samples("torch.load", 1))
    text = generate_latest(exporter.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_dashboard_and_rules_name_only_real_metrics():
    """Every series an expression names is one the exporter emits, a recorded one, or a name series written before
    a rename still carry (read beside the new one)."""
    emitted = scraped_metric_names() | {contract.LEGACY_TIME_SERIES}
    recorded = {r["record"] for g in rules.rule_groups()["groups"] for r in g["rules"] if "record" in r}
    used = set()
    for expr in grafana_dashboard.expressions(dashboard()) + [
        r["expr"] for g in rules.rule_groups()["groups"] for r in g["rules"]
    ]:
        used |= set(re.findall(r"npu_shadow[a-z_:0-9]*", expr))
    unknown = {name for name in used if name not in emitted and name not in recorded}
    assert not unknown, f"expressions name metrics nobody emits: {sorted(unknown)}"
    assert "npu_shadow_drill_active" in used and "npu_shadow_abs_error_bucket" in used


def _counts_at_eval(spec: dict, minutes: int = rule_cases.PROMOTION_EVAL_MINUTES):
    """A promotion case's series as the verdict would read them at the case's evaluation time (over its last
    ``minutes``, for a recent window: the series grow by the minute, a burst in the minutes just before it)."""
    from shadow.analysis.evidence import TargetCounts

    counts = TargetCounts()
    for primary, signatures in spec["phases"].items():
        for signature, (calls, compared, divergent) in signatures.items():
            counts.add_calls(signature, calls * minutes, primary)
            counts.add_outcome(signature, "match", (compared - divergent) * minutes, primary)
            counts.add_outcome(signature, "mismatch", divergent * minutes, primary)
            counts.add_reason("value", divergent * minutes, primary)
    for (primary, signature), (burst, per_minute) in spec.get("burst", {}).items():
        counts.add_outcome(signature, "mismatch", per_minute * min(burst, minutes), primary)
        counts.add_reason("value", per_minute * min(burst, minutes), primary)
    for (primary, signature, reason), per_minute in spec.get("skipped", {}).items():
        counts.add_skip(reason, per_minute * minutes, primary, signature)
    for primary, per_minute in spec.get("clusters", {}).items():
        counts.add_clusters(per_minute * minutes, primary)
    mismatched = spec.get("backward_mismatch", {})
    for (primary, signature), per_minute in spec.get("backward", {}).items():
        differing = mismatched.get((primary, signature), 0)
        counts.add_backward(signature, "match", (per_minute - differing) * minutes, primary)
        counts.add_backward(signature, "mismatch", differing * minutes, primary)
    for (primary, reason), per_minute in spec.get("hard", {}).items():
        counts.add_reason(reason, per_minute * minutes, primary)
    for (primary, evidence, pair, check), per_minute in spec.get("noise", {}).items():
        counts.add_noise(evidence, pair, check, per_minute * minutes, primary)
    if spec.get("rollbacks") or spec.get("rolled_back"):
        counts.rollbacks.append("http")  # (a restart's counter reset: the counts over the run still hold it)
    return counts


def test_the_promotion_alert_decides_as_the_verdict_does_on_the_same_counts():
    """Each promtool case of NpuShadowPromotionEvidence (dashboards/rule_cases.py) decided by the verdict on the
    same counts: the alert fires where the verdict promotes (clean, or a few value divergences in ample evidence)
    and nowhere else (pooled, under-sampled, skipped, never compared, rolled back, risky, a hard mismatch, a
    signature diverging on every call, too few clusters or gradient comparisons for the divergences seen)."""
    from shadow.analysis import decisions, verdict
    from shadow.core.model.targets import BUILTINS

    for spec in rule_cases.PROMOTION_CASES:
        target = spec.get("target", "op")
        risky = BUILTINS[target]().risky_signatures if target in BUILTINS else ()
        windows = {
            verdict.recent_slice(seconds): _counts_at_eval(spec, round(seconds / 60))
            for seconds in verdict.recent_windows(decisions.RECENT_SECONDS)
        }
        decision = verdict.decide(target, _counts_at_eval(spec), decisions.DEFAULT_MAX_RATE, risky, slices=windows)
        assert (decision.decision == verdict.PROMOTE) == bool(spec.get("fires")), (spec["name"], decision.why)
        if spec.get("burst"):  # (the case is the recent windows': the whole history alone would promote)
            alone = verdict.decide(target, _counts_at_eval(spec), decisions.DEFAULT_MAX_RATE, risky)
            assert alone.decision == verdict.PROMOTE and decision.slices[0].decision == verdict.PROMOTE, alone.why


def test_the_promotion_rules_bound_is_never_below_the_verdicts():
    """The rules' closed forms (rules.promotion_upper: zero-divergence, and with divergences) against the verdict's
    upper bound of the same phase, over random allocations of comparisons and divergences to signatures and
    clusters; and the regret bound against the verdict's regret envelope."""
    import random

    from shadow.analysis import bounds
    from shadow.analysis.evidence import TargetCounts
    from shadow.analysis.verdict import decide

    max_rate = rules.PARAMS["max_divergence"]
    prior = bounds.Prior.for_max_rate(max_rate)
    rng = random.Random(14)
    for trial in range(300):
        counts = TargetCounts()
        strata = {}
        for i in range(rng.randint(1, 6)):
            compared = rng.randint(1, 50_000)
            divergent = 0 if trial % 2 else min(compared, rng.choice([0, 0, 1, 2, 5, 20, rng.randint(0, compared)]))
            strata[f"s{i}"] = (rng.randint(compared, 10**6), compared, divergent)
        for signature, (calls, compared, divergent) in strata.items():
            counts.add_calls(signature, calls)
            counts.add_outcome(signature, "match", compared - divergent)
            counts.add_outcome(signature, "mismatch", divergent)
            counts.add_reason("value", divergent)
        total = sum(c for c, _, _ in strata.values())
        shares = [(c / total, k, n) for c, n, k in strata.values()]
        assert rules.promotion_upper(shares) >= decide("op", counts, max_rate).upper * (1 - 1e-9), strata
        clusters = rng.randint(1, sum(n for _, n, _ in strata.values()))
        counts.add_clusters(clusters)
        assert rules.promotion_upper(shares, clusters) >= decide("op", counts, max_rate).upper * (1 - 1e-9), strata
    for _ in range(500):
        n = rng.choice([1.0, 3.5, 100.0, 1e4, 1e6]) * rng.uniform(0.5, 2)
        k = rng.choice([0.0, 0.4, 1.0, 3.0, n / 2, n]) * rng.uniform(0.1, 1)
        assert rules.promotion_upper([(1.0, k, n)]) >= bounds.upper_bound(k, n, prior) * (1 - 1e-9), (k, n)
