"""The Grafana dashboard, built with Grafana's own typed builder (grafana-foundation-sdk).

Run ``python -m dashboards.grafana_dashboard`` to rewrite ``dashboards/grafana/npu-shadow.json``; a test
regenerates it and fails when the committed file is stale. Panels read the raw ``npu_shadow_*`` metrics
and the recording rules of ``dashboards/prometheus/npu_shadow.rules.yml``.
"""

from __future__ import annotations

import pathlib

from grafana_foundation_sdk.builders import common, heatmap, stat, table, timeseries
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from dashboards.series import (
    ABS_ERROR,
    ARM_FIRST_BATCH,
    ARM_FIRST_BATCHES,
    ARM_ITERATORS,
    BACKWARD_RUNS,
    CALLS,
    COMPARED,
    COMPARISONS,
    DRILL_ACTIVE,
    EXPORT_ERRORS,
    LEGACY_TIME,
    MISMATCHES,
    NOISE_FLOOR,
    PATCH_CALLS,
    PRIMARY,
    PRIMARY_TIME,
    REL_ERROR,
    ROLLBACKS,
    SAMPLE_RATE,
    SHADOW_TIME,
    SHARED,
    SKIPPED,
    TRUTH_RUNS,
)
from shadow.analysis.sources import promql

DASHBOARD_PATH = pathlib.Path(__file__).parent / "grafana" / "npu-shadow.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job", run=~"$run", target=~"$target"'


def query(expr: str, legend: str, ref: str = "A") -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def series_panel(title: str, description: str, unit: str, *queries: Dataquery, stacked: bool = False):
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(8)
        .span(12)
        .legend(common.VizLegendOptions().show_legend(True).display_mode("list").placement("bottom"))
    )
    if stacked:
        panel = panel.stacking(common.StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30)
    for q in queries:
        panel = panel.with_target(q)
    return panel


def stat_panel(title: str, description: str, expr: str, unit: str = "short", legend: str = "{{target}}"):
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(4)
        .span(6)
        .with_target(query(expr, legend))
    )


def counted(series: str) -> str:
    """PromQL: the panels' count of ``series`` (selected by the dashboard's variables) in each interval, a series
    that appeared in it counted from zero (:mod:`shadow.analysis.sources.promql`): a job's series appear at their
    first event, and a per-second ``rate()`` would show a first mismatch as nothing."""
    return promql.increase(f"{series}{{{SEL}}}", "$__rate_interval")


def build() -> Dashboard:
    """The dashboard builder."""
    return (
        Dashboard("npu-shadow: legacy vs upstream")
        .uid("npu-shadow")
        .description("Divergence between torch_npu's legacy patches and upstream PyTorch, from npu-shadow.")
        .tags(["npu-shadow", "torch_npu"])
        .refresh("30s")
        .time("now-6h", "now")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("job")
            .label("Job")
            .datasource(DATASOURCE)
            .query(f"label_values({CALLS}, job)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_variable(
            QueryVariable("run")
            .label("Run")
            .datasource(DATASOURCE)
            .query(f'label_values({CALLS}{{job=~"$job"}}, run)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_variable(
            QueryVariable("target")
            .label("Target")
            .datasource(DATASOURCE)
            .query(f'label_values({CALLS}{{job=~"$job", run=~"$run"}}, target)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        .with_row(Row("Verdict at a glance"))
        .with_panel(
            stat_panel(
                "Comparisons", "Sampled calls compared since the job started.", f"npu_shadow:comparisons:total{{{SEL}}}"
            )
        )
        .with_panel(
            stat_panel(
                "Divergent comparisons",
                "Comparisons whose outcome was mismatch or error.",
                f"npu_shadow:divergent:total{{{SEL}}}",
            )
        )
        .with_panel(
            stat_panel(
                "Promotion bound (anytime-valid)",
                "Per phase (primary: legacy shadowing, upstream in a canary), a conservative 95% upper bound of the "
                "divergence rate (closed forms never below the verdict's), valid however often it is looked at: the "
                "one NpuShadowPromotionEvidence reads (npu-shadow verdict computes the exact one, with clusters).",
                f"npu_shadow:promotion:upper_bound_approx{{{SEL}}}",
                "percentunit",
            )
        )
        .with_panel(
            stat_panel(
                "Fire drill active",
                "1 while a fire drill injects synthetic divergence into the upstream side.",
                f'max by (job, run) ({DRILL_ACTIVE}{{job=~"$job", run=~"$run"}})',
                legend="{{job}} {{run}}",
            )
        )
        .with_panel(
            stat_panel(
                "Side the caller gets",
                "Per job, run and target: 1 for the side whose result the caller gets now (legacy while shadowing, "
                "upstream in a canary until a rollback).",
                f"max by (job, run, target, side) ({PRIMARY}{{{SEL}}}) == 1",
                legend="{{job}} {{run}} {{target}}: {{side}}",
            )
        )
        .with_panel(
            stat_panel(
                "Rollbacks",
                "Rollbacks of a canary per job, run and target, by who threw the switch (http, file, api).",
                f"sum by (job, run, target, source) ({ROLLBACKS}{{{SEL}}}) > 0",
                legend="{{job}} {{run}} {{target}} by {{source}}",
            )
        )
        .with_row(Row("Divergence"))
        .with_panel(
            series_panel(
                "Divergence rate per target",
                "Divergent over compared comparisons (30m window), and the 95% upper bound since the start.",
                "percentunit",
                query(f"npu_shadow:divergence:ratio_rate30m{{{SEL}}}", "{{job}} {{target}} {{primary}} rate (30m)"),
                query(
                    f"npu_shadow:divergence:wilson_upper_total{{{SEL}}}",
                    "{{job}} {{target}} {{primary}} Wilson 95% upper (one look: display only)",
                    "B",
                ),
            )
        )
        .with_panel(
            series_panel(
                "Noise floor (A/A)",
                "The greatest difference between two legacy runs of the same call, by signature (abs, rel): the "
                "target's own nondeterminism. A legacy-vs-upstream value difference is outcome noise only within "
                "twice a robust floor of these and while a rank test finds it no larger.",
                "none",
                query(
                    f"max by (target, signature, measure) ({NOISE_FLOOR}{{{SEL}}})",
                    "{{target}} {{signature}} {{measure}}",
                ),
            )
        )
        .with_panel(
            series_panel(
                "Comparisons by outcome",
                "Compared calls in each interval by outcome: match (bitwise), close (within tolerance), noise (within "
                "the noise floor), mismatch, error (skipped calls are in Skipped by reason).",
                "short",
                query(f"sum by (outcome) ({counted(COMPARISONS)})", "{{outcome}}"),
                stacked=True,
            )
        )
        .with_panel(
            series_panel(
                "Mismatches by reason",
                "Reasons found in divergent comparisons (one comparison can have several).",
                "short",
                query(
                    f"sum by (target, reason) ({counted(MISMATCHES)})",
                    "{{target}} {{reason}}",
                ),
                stacked=True,
            )
        )
        .with_panel(
            series_panel(
                "Skipped by reason",
                "Sampled calls not compared (oom, compiling, mode, budget, comparator), and observations an exporter "
                "failed to export.",
                "short",
                query(f"sum by (target, reason) ({counted(SKIPPED)})", "{{target}} {{reason}}"),
                query(f"sum by (target) ({counted(EXPORT_ERRORS)})", "{{target}} export errors", "B"),
                stacked=True,
            )
        )
        .with_panel(
            series_panel(
                "Shared divergences (both unlike a single device)",
                "Comparisons where legacy and upstream agree but both depart from replica 0 run alone on its device "
                "(the single-device oracle), by reason: removing the patch changes nothing there; an upstream issue "
                "to file, not a reason to keep the patch.",
                "short",
                query(
                    f"sum by (target, reason) ({counted(SHARED)})",
                    "{{target}} {{reason}}",
                ),
                stacked=True,
            )
        )
        .with_panel(
            series_panel(
                "Beyond forward: side nearer float64, gradients compared",
                "Float64 CPU truth runs of calls whose two sides differ in value, by the side nearer the truth "
                "(upstream nearer: no regression; legacy nearer: one), and backward comparisons run (their "
                "differences are mismatches with reason grad, in the panel of reasons).",
                "short",
                query(
                    f"sum by (target, nearer) ({counted(TRUTH_RUNS)})",
                    "{{target}} {{nearer}} nearer",
                ),
                query(f"sum by (target) ({counted(BACKWARD_RUNS)})", "{{target}} backward compared", "B"),
            )
        )
        .with_row(Row("Error sizes"))
        .with_panel(
            heatmap.Panel()
            .title("Absolute error distribution")
            .description("Greatest absolute error per comparison (buckets every second decade, 1e-8 .. 1).")
            .datasource(DATASOURCE)
            .height(8)
            .span(12)
            .with_target(query(f"sum by (le) ({counted(ABS_ERROR)})", "{{le}}").format("heatmap"))
        )
        .with_panel(
            heatmap.Panel()
            .title("Relative error distribution")
            .description("Greatest relative error per comparison (buckets every second decade, 1e-8 .. 1).")
            .datasource(DATASOURCE)
            .height(8)
            .span(12)
            .with_target(query(f"sum by (le) ({counted(REL_ERROR)})", "{{le}}").format("heatmap"))
        )
        .with_row(Row("Coverage and cost"))
        .with_panel(
            table.Panel()
            .title("Coverage by signature")
            .description("Comparisons per call signature: which code paths were compared (risky ones need evidence).")
            .datasource(DATASOURCE)
            .height(8)
            .span(12)
            .with_target(
                query(f"sum by (target, signature) ({COMPARISONS}{{{SEL}, {COMPARED}}})", "{{signature}}")
                .instant()
                .format("table")
            )
        )
        .with_panel(
            table.Panel()
            .title("Patch board")
            .description(
                "The release's function patches the jobs call, the most called first (the jobs' patch calls, counted "
                "under npu-shadow run --legacy-from RELEASE). What gives evidence about each, and that "
                "evidence's decision: npu-shadow census RELEASE --prometheus URL, from the same store."
            )
            .datasource(DATASOURCE)
            .height(8)
            .span(12)
            .with_target(
                query(f'sort_desc(sum by (patch) ({PATCH_CALLS}{{job=~"$job", run=~"$run"}}))', "{{patch}}")
                .instant()
                .format("table")
            )
        )
        .with_panel(
            series_panel(
                "Calls vs sampled",
                "Calls of the wrapped function and sampled calls, in each interval.",
                "short",
                query(f"sum by (target) ({counted(CALLS)})", "{{target}} calls"),
                query(
                    f"sum by (target) ({counted(COMPARISONS)} or {counted(SKIPPED)})",
                    "{{target}} sampled",
                    "B",
                ),
            )
        )
        .with_panel(
            series_panel(
                "Shadow overhead",
                "Shadow side seconds (the shadow run + comparison) per second of the primary's own runs on sampled "
                "calls, and shadow seconds in each interval.",
                "short",
                query(
                    f"sum by (target) ({counted(SHADOW_TIME)}) / "
                    f"sum by (target) ({counted(PRIMARY_TIME)} or {counted(LEGACY_TIME)})",
                    "{{target}} shadow / primary",
                ),
                query(
                    f"sum by (target) ({counted(SHADOW_TIME)})",
                    "{{target}} shadow s",
                    "B",
                ),
            )
        )
        .with_panel(
            series_panel(
                "Canary A/B: DataLoader iterators",
                "Iterators each arm built (dataloader_init: legacy's or upstream's __init__, never both), by whether "
                "their workers were bound to fewer cores than the process had; and each arm's mean time to the first "
                "batch. The verdict's line has the ratios with intervals (from journals).",
                "short",
                query(f"sum by (target, arm, workers) ({ARM_ITERATORS}{{{SEL}}})", "{{arm}} workers {{workers}}"),
                query(
                    f"sum by (target, arm) ({ARM_FIRST_BATCH}{{{SEL}}}) / sum by (target, arm) "
                    f"({ARM_FIRST_BATCHES}{{{SEL}}})",
                    "{{arm}} mean s to first batch",
                    "B",
                ),
            )
        )
        .with_panel(
            series_panel(
                "Sample rate",
                "The configured fraction of calls shadowed, per target.",
                "percentunit",
                query(f"max by (target) ({SAMPLE_RATE}{{{SEL}}})", "{{target}}"),
            )
        )
    )


def render() -> str:
    import json

    dashboard = json.loads(JSONEncoder(sort_keys=True).encode(build().build()))
    for number, panel in enumerate(dashboard["panels"], start=1):  # (every panel its own id: links name panels by it)
        panel["id"] = number
    return json.dumps(dashboard, sort_keys=True, indent=2) + "\n"


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression in a dashboard's panels and variables."""
    found = [t["expr"] for p in dashboard.get("panels", []) for t in p.get("targets", []) if t.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        q = variable.get("query")
        if isinstance(q, str) and q.startswith("label_values("):
            inner = q[len("label_values(") : -1].rsplit(",", 1)[0]
            found.append(inner)
    return found


if __name__ == "__main__":
    DASHBOARD_PATH.write_text(render())
    print(f"wrote {DASHBOARD_PATH}")
