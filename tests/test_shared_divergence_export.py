"""Shared divergences (legacy = upstream, both unlike a single-device run) in every exporter and the verdict."""

import json

import pytest
import torch
from metrics_helpers import samples, scrape, total
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

import shadow
from exporters import JsonlExporter, OTelExporter, PrometheusExporter
from shadow.analysis import verdict
from shadow.analysis.decisions import EXIT_CODES
from shadow.analysis.sources import from_exposition, from_journal
from shadow.core.model.observation import SHARED_DIVERGENCE_REASONS
from shadow.launcher import cli


@pytest.fixture
def shadowed_autocast_steps(legacy_patches, tmp_path):
    """Two DataParallel steps under autocast, one without, shadowed into all three exporters."""
    prometheus = PrometheusExporter(registry=CollectorRegistry(), port=0)
    reader = InMemoryMetricReader()
    otel = OTelExporter(meter_provider=MeterProvider(metric_readers=[reader]))
    journal = JsonlExporter(str(tmp_path / "journal.jsonl"))
    model = nn.Linear(8, 8).to("npu:0")
    dp = nn.DataParallel(model, device_ids=[0, 1])
    try:
        with shadow.install(["parallel_apply"], sample_rate=1.0, exporters=[prometheus, otel, journal], oracle=1.0):
            for step in range(3):
                with torch.autocast("npu", dtype=torch.float16, enabled=step != 1):
                    dp(torch.randn(4, 8, device="npu:0"))
        journal.close()
        yield prometheus, reader, tmp_path / "journal.jsonl"
    finally:
        prometheus.close()


def test_prometheus_counts_them_by_reason_from_zero(shadowed_autocast_steps):
    prometheus, _, _ = shadowed_autocast_steps
    parsed = samples(scrape(prometheus.port))
    for reason in SHARED_DIVERGENCE_REASONS:
        expected = 2 if reason == "dtype" else 0
        assert total(parsed, "npu_shadow_shared_divergences_total", target="parallel_apply", reason=reason) == expected
    assert total(parsed, "npu_shadow_comparisons_total", target="parallel_apply", outcome="match") == 3


def test_opentelemetry_counts_them_too(shadowed_autocast_steps):
    _, reader, _ = shadowed_autocast_steps
    metrics = {m.name: m for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics}
    points = metrics["npu_shadow.shared_divergences"].data.data_points
    by_reason = {dict(p.attributes)["reason"]: p.value for p in points if p.attributes["target"] == "parallel_apply"}
    assert by_reason["dtype"] == 2 and sum(by_reason.values()) == 2


def test_the_journal_keeps_the_matches_that_found_one(shadowed_autocast_steps):
    _, _, path = shadowed_autocast_steps
    lines = [r for r in map(json.loads, path.read_text().splitlines()) if "outcome" in r]
    assert [(line["outcome"], line["shared_divergence"]) for line in lines] == [("match", "dtype")] * 2
    assert "dtype torch.float32 vs torch.float16" in lines[0]["shared_detail"] and lines[0]["oracle_seconds"] > 0
    assert from_journal([str(path)])["parallel_apply"].phase().shared == {"dtype": 2}


def test_the_verdict_reports_them_on_their_own_line_without_changing_the_decision(shadowed_autocast_steps, tmp_path):
    prometheus, _, _ = shadowed_autocast_steps
    exposition = generate_latest(prometheus.registry).decode()
    counts = from_exposition(exposition)
    assert {r: v for r, v in counts["parallel_apply"].phase().shared.items() if v} == {"dtype": 2.0}
    decision = verdict.decide("parallel_apply", counts["parallel_apply"], 0.001)
    counts["parallel_apply"].phase().shared.clear()
    assert verdict.decide("parallel_apply", counts["parallel_apply"], 0.001).decision == decision.decision
    assert decision.shared == {"dtype": 2}

    path = tmp_path / "scrape.prom"
    path.write_text(exposition)
    code = cli.main(["verdict", "--metrics-file", str(path)])
    assert code == EXIT_CODES[decision.decision]


def test_the_verdict_table_names_the_shared_divergence(shadowed_autocast_steps, tmp_path, capsys):
    prometheus, _, _ = shadowed_autocast_steps
    path = tmp_path / "scrape.prom"
    path.write_text(generate_latest(prometheus.registry).decode())
    cli.main(["verdict", "--metrics-file", str(path)])
    out = capsys.readouterr().out
    assert "shared divergence: dtype 2 (legacy and upstream agree, both unlike replica 0 alone" in out
    assert "not a reason to keep the patch" in out
