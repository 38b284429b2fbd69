"""End to end against a real Prometheus: workloads with and without divergence, the rules' values,
the alerts, and the verdict read from the server."""

import contextlib
import dataclasses

import fakes
import faults
import pytest
import torch
from commands import npu_shadow
from prometheus_client import CollectorRegistry
from prometheus_server import prometheus

import shadow
from dashboards import rules
from exporters import PrometheusExporter
from shadow.analysis import verdict
from shadow.core.model import targets as builtin

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def run_workload(server, job, target, calls):
    """Install at zero, let Prometheus see the zeros, then make the calls; return the monitor's stats."""
    monitor = shadow.install([target], sample_rate=1.0, exporters=[EXPORTERS[job]])
    try:
        server.wait_for(
            lambda: server.query(f'npu_shadow_calls_total{{job="{job}"}}'), f"a first scrape of {job}", timeout=60
        )
        calls()
    finally:
        monitor.uninstall()
    return monitor.stats()["tensor_type"]


EXPORTERS = {}


def diverging_calls():
    x = torch.arange(6.0)
    for i in range(300):
        x.type(torch.float32 if i % 3 == 0 else torch.float64)  # cast: upstream returns float16 (dtype)
        x.type()  # the type name: agreement


def clean_calls():
    x = torch.arange(6.0)
    for _ in range(verdict.comparisons_needed(rules.PARAMS["max_divergence"])):
        x.type(torch.float64)
    elsewhere = torch.arange(6.0, device="npu:1")  # the risky signatures: npu names and classes on a non-current
    for _ in range(40):  # npu, torch_npu's own spelling (upstream against itself: they agree, refusals included)
        for argument in ("torch.npu.FloatTensor", torch.npu.FloatTensor, "torch_npu.npu.FloatTensor"):
            with contextlib.suppress(RuntimeError, TypeError, ValueError):
                elsewhere.type(argument)


def run_verdict(server, job):
    return npu_shadow("verdict", "--prometheus", server.url, "--selector", f'job="{job}"', timeout=120)


def test_rules_alerts_and_verdict_against_a_real_prometheus(tmp_path, monkeypatch):
    # each comparison its own cluster: the rules, alerts and verdict over Prometheus are under test here, not how
    # correlated one process's comparisons are (3,000 of them in a minute would be one cluster)
    fakes.each_comparison_its_own_cluster(monkeypatch)
    EXPORTERS.clear()
    EXPORTERS.update({job: PrometheusExporter(registry=CollectorRegistry(), port=0) for job in ("diverging", "clean")})
    try:
        jobs = {job: exporter.port for job, exporter in EXPORTERS.items()}
        with prometheus(tmp_path, jobs, [str(rules.RULES_PATH)]) as server:
            # legacy named: torch's own Tensor.type, whatever patch this process may carry (a pytest --npu-shadow
            # session installs the reference's)
            clean = dataclasses.replace(builtin.tensor_type(), legacy=torch._C.TensorBase.type)
            broken = dataclasses.replace(clean, upstream=faults.type_to_half)
            stats = {
                "diverging": run_workload(server, "diverging", broken, diverging_calls),
                "clean": run_workload(server, "clean", clean, clean_calls),
            }
            assert stats["diverging"].mismatch == 300 and stats["clean"].compared > 3000
            assert stats["clean"].mismatch == stats["clean"].error == 0

            # the recording rules hold what the monitors counted
            for job, s in stats.items():
                # (by phase, in the run)
                key = (("job", job), ("primary", "legacy"), ("run", EXPORTERS[job].run), ("target", "tensor_type"))
                expected = {
                    "npu_shadow:calls:total": s.calls,
                    "npu_shadow:comparisons:total": s.compared,
                    "npu_shadow:divergent:total": s.mismatch + s.error,
                    "npu_shadow:divergence:ratio_total": (s.mismatch + s.error) / s.compared,
                    "npu_shadow:divergence:wilson_upper_total": verdict.wilson_upper(s.mismatch + s.error, s.compared),
                }
                for record, value in expected.items():
                    server.wait_for(
                        lambda record=record, value=value, key=key: (
                            abs(server.query(record).get(key, -1) - value) < 1e-9
                        ),
                        f"{record} of {job} to be {value}",
                    )

            # the hard-mismatch alert fires for the diverging job, nothing fires for the clean one
            def hard_firing():
                return [
                    a
                    for a in server.alerts()
                    if a["labels"]["alertname"] == "NpuShadowHardMismatch"
                    and a["labels"]["job"] == "diverging"
                    and a["state"] == "firing"
                ]

            (alert,) = server.wait_for(hard_firing, "NpuShadowHardMismatch to fire")
            assert alert["labels"]["reason"] == "dtype" and alert["labels"]["action"] == "rollback"
            clean_alerts = [a for a in server.alerts() if a["labels"].get("job") == "clean"]
            assert not [a for a in clean_alerts if a["state"] == "firing"], clean_alerts
            # (the overhead alert may be pending at rate 1 on a busy machine: it weighs the shadow side's cost against
            # this machine's speed, says nothing of divergence, and fires only after 15 minutes)
            cost = {"NpuShadowPromotionEvidence", "NpuShadowOverhead"}
            assert {a["labels"]["alertname"] for a in clean_alerts} <= cost, clean_alerts

            # and the verdict, read from the server
            rollback = run_verdict(server, "diverging")
            assert rollback.returncode == 1, rollback.stdout + rollback.stderr
            assert "rollback" in rollback.stdout and "300 dtype" in rollback.stdout
            promote = run_verdict(server, "clean")
            assert promote.returncode == 0, promote.stdout + promote.stderr
            assert "overall: promote" in promote.stdout
    finally:
        for exporter in EXPORTERS.values():
            exporter.close()
