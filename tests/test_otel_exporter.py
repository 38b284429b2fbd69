"""The OpenTelemetry path: instruments, units and attributes, and the same names through the SDK's
Prometheus translation as the direct Prometheus path."""

import types

import faults
import pytest
import torch
from metrics_helpers import samples
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

import shadow
from exporters import OTelExporter, PrometheusExporter
from shadow.core.calls.record.record import Publisher
from shadow.core.model import contract
from shadow.core.model.observation import Observation


def run_workload(exporters):
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install(
        [shadow.Target("op", ops, "op", faults.scale_wrong)],
        sample_rate=1.0,
        exporters=exporters,
        aa_rate=1.0,  # (every call: the noise floor can judge a value difference from the tenth call on)
        seed=1,
        backward_rate=1.0,
        truth_rate=1.0,
    ) as m:
        for i in range(12):
            ops.op(torch.tensor([float(i % 4)], requires_grad=True))
        ops.op(torch.tensor([1.0]))  # (no output requires grad: a backward comparison skipped, reason no_grad)
        torch.npu.reset_peak_memory_stats(0)  # (on a device, from a peak of its own: the shadow side raises it)
        ops.op(torch.ones(1 << 16, device="npu:0"))
    return m.stats()["op"]


def test_every_instrument_with_its_unit_and_attributes():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    exporter = OTelExporter(meter_provider=provider)
    stats = run_workload([exporter])
    exporter.record(contract.arm_samples("dataloader_init", "legacy", True, 0.2))
    # (a fire drill's comparison, of another target: the drill's own counters)
    exporter.record(contract.observation_samples(Observation("drilled", "error", reasons=("exception",), drill=True)))
    exporter.record(contract.patch_call_samples("torch.serialization._save", 3))  # (a release's patch the job called)
    # (a call of a noisy target's, judged against its noise thresholds: within them, its A/A run beyond)
    exporter.record(
        contract.observation_samples(Observation("noisy", "noise", noise_check="within", aa_check="beyond"))
    )
    # (what no workload of a healthy job does: each series appears at its first event)
    exporter.record(contract.observation_samples(Observation("shared", "match", shared_divergence="value")))
    exporter.record(contract.skip_samples("op", "budget", 2, "legacy"))
    exporter.record(contract.export_error_samples("op"))
    exporter.record(contract.rollback_samples("op", "api") + contract.reset_samples("op"))
    data = reader.get_metrics_data()
    (scope_metrics,) = data.resource_metrics[0].scope_metrics
    assert scope_metrics.scope.name == "npu_shadow"
    assert scope_metrics.scope.version == shadow.__version__
    assert dict(scope_metrics.scope.attributes) == contract.versions()
    by_name = {m.name: m for m in scope_metrics.metrics}
    assert set(by_name) == {m.otel_name for m in contract.ALL}
    for metric in contract.ALL:
        assert by_name[metric.otel_name].unit == metric.unit, metric.otel_name
        for point in by_name[metric.otel_name].data.data_points:
            assert set(point.attributes) == {contract.RUN_LABEL, *metric.labels}, metric.otel_name

    def value(name, **attributes):
        return sum(
            p.value if hasattr(p, "value") else p.count
            for p in by_name[name].data.data_points
            if attributes.items() <= dict(p.attributes).items()
        )

    assert value("npu_shadow.calls", target="op") == stats.calls == 14
    assert value("npu_shadow.arm_iterators", arm="legacy", workers="bound") == 1
    assert value("npu_shadow.arm_first_batch", arm="legacy") == 0.2
    assert value("npu_shadow.backward_skips", reason="no_grad") == stats.backward_skips["no_grad"] >= 1
    assert value("npu_shadow.comparisons", target="op", outcome="match") == stats.match
    assert value("npu_shadow.comparisons", outcome="mismatch") == stats.mismatch
    assert value("npu_shadow.mismatches", reason="value") == stats.mismatch
    assert value("npu_shadow.skipped", reason="budget") == 2
    assert not [p for p in by_name["npu_shadow.skipped"].data.data_points if p.attributes["reason"] == "oom"]
    assert value("npu_shadow.abs_error", target="op") == stats.compared == 14
    assert value("npu_shadow.shadow_peak_added", target="op") == stats.shadow_peak_bytes >= 1 << 18
    assert value("npu_shadow.sample_rate", target="op") == 1.0
    assert value("npu_shadow.patch_calls", patch="torch.serialization._save") == 3
    assert value("npu_shadow.drilled", target="drilled", outcome="error") == 1
    assert value("npu_shadow.noise_checks", target="noisy", evidence="forward", pair="ab", check="within") == 1
    assert value("npu_shadow.noise_checks", target="noisy", evidence="forward", pair="aa", check="beyond") == 1
    assert value("npu_shadow.drilled_reasons", target="drilled", reason="exception") == 1
    assert value("npu_shadow.backward_runs", target="op") == stats.backward_runs == stats.match - 2  # (no_grad: two)
    assert value("npu_shadow.truth_runs", target="op") == sum(stats.truth_runs.values()) == stats.mismatch
    boundaries = by_name["npu_shadow.abs_error"].data.data_points[0].explicit_bounds
    assert tuple(boundaries) == contract.ERROR_BUCKETS


def metric_names(text):
    names = set()
    for sample_name, _ in samples(text):
        if sample_name.endswith("_created"):
            continue  # prometheus-client's creation timestamps, not metrics of their own
        for suffix in ("_bucket", "_count", "_sum"):
            if sample_name.endswith(suffix) and not sample_name.endswith("_total"):
                sample_name = sample_name[: -len(suffix)]
        names.add(sample_name)
    return {n for n in names if n.startswith("npu_shadow")}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_prometheus_translation_yields_the_direct_names():
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    direct = PrometheusExporter(registry=CollectorRegistry())
    run_workload([OTelExporter(meter_provider=provider), direct])
    translated = metric_names(generate_latest(registry).decode())
    native = metric_names(generate_latest(direct.registry).decode())
    native.discard("npu_shadow_build_info")  # OTel carries versions on the meter instead
    assert translated == native
    assert "npu_shadow_shadow_duration_seconds" in translated and "npu_shadow_primary_run_seconds_total" in translated
    provider.shutdown()


def test_histogram_values_that_find_the_queue_full_are_counted_not_lost_silently(monkeypatch):
    """Under slow collection the queue is bounded; every observation it cannot hold is counted."""
    from exporters import otel

    monkeypatch.setattr(otel, "MAX_PENDING", 300)
    reader = InMemoryMetricReader()
    exporter = OTelExporter(meter_provider=MeterProvider(metric_readers=[reader]))
    exporter.record(contract.registered_samples("op", 1.0))
    for _ in range(1000):
        exporter.record(
            contract.observation_samples(Observation("op", "close", numel=4, max_abs_error=1e-6, shadow_seconds=0.001))
        )
    by_name = {m.name: m for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics}
    recorded = sum(p.count for p in by_name["npu_shadow.shadow.duration"].data.data_points)
    export_errors = sum(p.value for p in by_name["npu_shadow.export_errors"].data.data_points)
    assert recorded == 100 and exporter.dropped == 900  # 3 values per observation: 100 fit in 300
    assert export_errors == exporter.dropped
    assert recorded + export_errors == 1000


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_metric_added_in_the_vocabulary_reaches_prometheus_opentelemetry_and_the_journal(monkeypatch, tmp_path):
    """Adding a metric is one Metric and one rule in shadow.core.model.contract: the comparator's time per
    comparison, say. Both exporters then carry it with its value, and the journal line carries the field it is made
    from (the schema is the Observation's fields), read back by the journal reader."""
    from exporters import JsonlExporter
    from shadow.analysis.sources import journal_records
    from shadow.core.model import contract

    compare = contract.Metric("npu_shadow.compare", "s", "counter", ("target",), "The comparator's time.")
    rule = lambda o: [(compare, (o.target,), o.compare_seconds)] if o.outcome != "skipped" else []  # noqa: E731
    monkeypatch.setattr(contract, "ALL", (*contract.ALL, compare))
    monkeypatch.setattr(contract, "OBSERVATION_RULES", [*contract.OBSERVATION_RULES, rule])
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    direct = PrometheusExporter(registry=CollectorRegistry())
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), all_outcomes=True)
    observation = Observation("op", "close", numel=4, compare_seconds=0.125)
    publisher = Publisher([OTelExporter(meter_provider=provider), direct, journal])
    publisher.export_observation("op", observation, failed=print)
    publisher.deliver()
    journal.close()
    for text in (generate_latest(registry).decode(), generate_latest(direct.registry).decode()):
        found = [value for (name, _), value in samples(text).items() if name == "npu_shadow_compare_seconds_total"]
        assert found == [0.125], text
    (line,) = [r for r in journal_records([str(tmp_path / "j.jsonl")]) if "outcome" in r]
    assert line["compare_seconds"] == 0.125
