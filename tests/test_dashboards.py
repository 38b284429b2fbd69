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
from shadow.core.arms import ArmRun

PROMETHEUS_DIR = rules.RULES_PATH.parent
GRAFANA_DIR = grafana_dashboard.DASHBOARD_PATH.parent


def test_generated_files_are_up_to_date():
    assert rules.RULES_PATH.read_text() == rules.render(), "run: python -m dashboards.rules"
    assert rule_cases.TEST_PATH.read_text() == rule_cases.render(), "run: python -m dashboards.rule_cases"
    assert grafana_dashboard.DASHBOARD_PATH.read_text() == grafana_dashboard.render(), (
        "run: python -m dashboards.grafana_dashboard"
    )


def run_promtool(*args, cwd=PROMETHEUS_DIR):
    done = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_promtool_checks_and_unit_tests_the_rules():
    assert "SUCCESS" in run_promtool("check", "rules", rules.RULES_PATH.name)
    assert "SUCCESS" in run_promtool("test", "rules", rule_cases.TEST_PATH.name)


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
        for i in range(12):  # (the noise floor judges a value difference once it has 10 A/A runs)
            ops.op(torch.tensor([float(i)], requires_grad=True))
    exporter.export_arm(ArmRun("dataloader_init", "legacy", 0.0, ((0,),), (0, 1), (0,), (0, 1), 0.1, 0.2, 3, 10.0))
    text = generate_latest(exporter.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_dashboard_and_rules_name_only_real_metrics():
    emitted = scraped_metric_names()
    recorded = {r["record"] for g in rules.rule_groups()["groups"] for r in g["rules"] if "record" in r}
    used = set()
    for expr in grafana_dashboard.expressions(dashboard()) + [
        r["expr"] for g in rules.rule_groups()["groups"] for r in g["rules"]
    ]:
        used |= set(re.findall(r"npu_shadow[a-z_:0-9]*", expr))
    unknown = {name for name in used if name not in emitted and name not in recorded}
    assert not unknown, f"expressions name metrics nobody emits: {sorted(unknown)}"
    assert "npu_shadow_drill_active" in used and "npu_shadow_abs_error_bucket" in used


def _counts_at_eval(spec: dict):
    """A promotion case's series as the verdict would read them at the case's evaluation time."""
    from shadow.analysis.verdict import TargetCounts

    counts = TargetCounts()
    minutes = rule_cases.PROMOTION_EVAL_MINUTES
    for primary, signatures in spec["phases"].items():
        for signature, (calls, compared, divergent) in signatures.items():
            counts.add_calls(signature, calls * minutes, primary)
            counts.add_outcome(signature, "match", (compared - divergent) * minutes, primary)
            counts.add_outcome(signature, "mismatch", divergent * minutes, primary)
            counts.add_reason("value", divergent * minutes, primary)
    for (primary, signature, reason), per_minute in spec.get("skipped", {}).items():
        counts.add_skip(reason, per_minute * minutes, primary, signature)
    for primary, per_minute in spec.get("clusters", {}).items():
        counts.add_clusters(per_minute * minutes, primary)
    for (primary, signature), per_minute in spec.get("backward", {}).items():
        counts.add_backward(signature, "match", per_minute * minutes, primary)
    if spec.get("rollbacks") or spec.get("rolled_back"):
        counts.rollbacks.append("http")  # (a restart's counter reset: the counts over the run still hold it)
    return counts


def test_the_promotion_alert_never_fires_where_the_verdict_would_not():
    """Each promtool case of NpuShadowPromotionEvidence (dashboards/rule_cases.py) decided by the verdict on the
    same counts: where the alert fires, the verdict promotes; the pooled, under-sampled, skipped, never-compared,
    rolled-back and risky cases are not promoted by either."""
    from shadow.analysis import verdict
    from shadow.core.targets import BUILTINS

    for spec in rule_cases.PROMOTION_CASES:
        target = spec.get("target", "op")
        risky = BUILTINS[target]().risky_signatures if target in BUILTINS else ()
        decision = verdict.decide(target, _counts_at_eval(spec), verdict.DEFAULT_MAX_RATE, risky)
        assert (decision.decision == verdict.PROMOTE) == bool(spec.get("fires")), (spec["name"], decision.why)


def test_the_promotion_rules_bound_is_never_below_the_verdicts():
    """The rule's closed form (log(1/alpha) - log(w) + log(1 + N/b)) / min_s(n_s / W_s) against the verdict's bound
    of a phase with no divergence, over random allocations of comparisons to signatures."""
    import math
    import random

    from shadow.analysis import bounds
    from shadow.analysis.verdict import TargetCounts, decide

    rng = random.Random(14)
    prior = bounds.Prior.for_max_rate(0.001)
    for _ in range(200):
        counts = TargetCounts()
        strata = {f"s{i}": (rng.randint(1, 10**6), rng.randint(1, 50_000)) for i in range(rng.randint(1, 6))}
        for signature, (calls, compared) in strata.items():
            counts.add_calls(signature, calls)
            counts.add_outcome(signature, "match", compared)
        total_calls = sum(c for c, _ in strata.values())
        n = sum(m for _, m in strata.values())
        least = min(m / (c / total_calls) for c, m in strata.values())
        budget = math.log(1 / bounds.ALPHA) - math.log(bounds.SHARED_RATE_WEIGHT) + math.log1p(n / prior.b)
        assert budget / least >= decide("op", counts, 0.001).upper * (1 - 1e-9)
        clusters = rng.randint(1, n)  # (the comparisons in C clusters: the rule divides by min(least, C))
        counts.add_clusters(clusters)
        assert budget / min(least, clusters) >= decide("op", counts, 0.001).upper * (1 - 1e-9)
