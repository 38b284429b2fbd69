"""Evidence right where it is thin: what the statistics are fed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import journals
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verdict_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shadow", "verdict", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize("timestamp", [None, "yesterday", float("nan"), float("inf")])
def test_a_count_record_whose_timestamp_is_not_a_finite_number_is_a_source_error_naming_it(tmp_path, timestamp):
    """It ended in a TypeError (or ValueError) traceback with exit 1, the rollback code."""
    good = journals.counts({"s": {"match": 40}}, calls={"s": 40}, timestamp=100.0)
    bad = journals.counts({"s": {"match": 80}}, calls={"s": 80}, timestamp=160.0)
    path = journals.write(tmp_path / "j.jsonl", [good, bad])
    lines = path.read_text().splitlines()
    record = json.loads(lines[-1])
    record["timestamp"] = timestamp
    lines[-1] = json.dumps(record)  # (NaN and Infinity as Python's json writes them)
    path.write_text("\n".join(lines) + "\n")
    done = verdict_cli("--journal", str(path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{path}:{len(lines)}: a count record whose timestamp is" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_truth_from_both_code_paths_against_an_independent_computation():
    """Agreeing float64 runs are the truth each side is measured against; runs apart beyond float64 rounding make
    ``differs-in-float64``, each side measured against its own path's run (computed here with NumPy)."""
    import numpy as np
    import torch

    from shadow.core import truth

    exact = np.linspace(-3.0, 5.0, 101)
    legacy = torch.tensor(exact * 3.14159, dtype=torch.float32)
    upstream = torch.tensor(exact, dtype=torch.float16).float() * 3.14159  # (rounds by design, in its own path)
    legacy_path = torch.tensor(exact * 3.14159)
    upstream_path = torch.tensor(exact, dtype=torch.float16).double() * 3.14159
    judged = truth.judge_both(legacy, upstream, legacy_path, upstream_path)
    assert judged.nearer == "differs-in-float64"

    def error(side, path):
        return np.abs(side.double().numpy() - path.numpy()).max() / np.abs(path.numpy()).max()

    assert judged.legacy_error == pytest.approx(error(legacy, legacy_path), rel=1e-12)
    assert judged.upstream_error == pytest.approx(error(upstream, upstream_path), rel=1e-12)
    # the same paths a rounding apart (another summation order): one truth, the sides measured against it
    nudged = legacy_path * (1 + 1e-14)
    agreed = truth.judge_both(legacy, upstream, legacy_path, nudged)
    assert agreed.nearer == "legacy"
    assert agreed.upstream_error == pytest.approx(error(upstream, nudged), rel=1e-12)
    # with upstream's path alone (the old truth run), the upstream that rounds by design was judged nearer
    assert truth.judge(legacy, upstream, upstream_path).nearer == "upstream"


# --------------------------------------------------------------------------- gradients as their own evidence


def _verdict_json(*args: str) -> dict:
    done = verdict_cli("--format", "json", *args)
    assert done.returncode in (0, 1, 3), done.stdout + done.stderr
    return json.loads(done.stdout)


def test_gradient_mismatches_are_rated_over_the_calls_that_had_a_backward_run(tmp_path):
    """100,000 comparisons, 5,000 of them with a backward run (the launcher's 0.05), 50 of those gradients
    differing: 1% of the gradients, read as 0.05% of all comparisons and promoted at max rate 0.001."""
    record = journals.counts(
        {"s": {"match": 100_000 - 50, "mismatch": 50}}, calls={"s": 100_000}, reasons={"grad": 50}, timestamp=10.0
    )
    record["clusters"] = 100_000  # (every comparison its own cluster: the counts alone decide)
    record["backward"] = {"s": {"match": 4_950, "mismatch": 50}}
    path = journals.write(tmp_path / "j.jsonl", [record])
    decided = _verdict_json("--journal", str(path), "--max-rate", "0.001")
    (target,) = decided["targets"]
    phases = {p["primary"]: p for p in target["phases"]}
    assert phases["legacy"]["divergent"] == 0 and phases["legacy"]["compared"] == 100_000
    gradients = phases["legacy gradients"]
    assert (gradients["compared"], gradients["divergent"]) == (5_000, 50)
    assert gradients["decision"] == "rollback" and target["decision"] == "rollback"
    assert gradients["lower"] > 0.001


class _Collect:
    def __init__(self):
        self.observations = []

    def export(self, observation):
        self.observations.append(observation)


def test_the_real_engines_gradient_evidence_reaches_the_verdict_alike_from_journals_and_metrics(tmp_path):
    """A legacy whose weight gradient is scaled (the forward bitwise equal), compared backward on a tenth of the
    calls: the gradients' own phase holds those calls, all divergent, from either source."""
    import types

    import torch
    from prometheus_client import CollectorRegistry, generate_latest
    from torch import nn

    import shadow
    from exporters import JsonlExporter, PrometheusExporter

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.5

    ops = types.SimpleNamespace(op=lambda m, x: nn.functional.linear(x, Scaled.apply(m.weight), m.bias))
    target = shadow.Target("linear", ops, "op", lambda m, x: m(x))
    registry, collect = CollectorRegistry(), _Collect()
    journal = tmp_path / "j.jsonl"
    exporters = [collect, JsonlExporter(str(journal)), PrometheusExporter(registry=registry)]
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    with shadow.install([target], sample_rate=1.0, backward_rate=0.1, budget=None, seed=3, exporters=exporters):
        for _ in range(200):
            ops.op(module, torch.randn(5, 4)).sum().backward()
    backward = sum(o.backward for o in collect.observations)
    assert 5 <= backward <= 40 and all(o.backward_outcome == "mismatch" for o in collect.observations if o.backward)
    textfile = tmp_path / "m.prom"
    textfile.write_text(generate_latest(registry).decode())
    by_source = {}
    for source in (("--journal", str(journal)), ("--metrics-file", str(textfile))):
        (decided,) = _verdict_json(*source)["targets"]
        by_source[source[0]] = {p["primary"]: (p["compared"], p["divergent"]) for p in decided["phases"]}
    assert (
        by_source["--journal"]
        == by_source["--metrics-file"]
        == {
            "legacy": (200, 0),
            "legacy gradients": (backward, backward),
        }
    )
