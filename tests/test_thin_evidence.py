"""Evidence right where it is thin: what the statistics are fed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import journals
import pytest
from commands import npu_shadow_here
from fakes import Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verdict_cli(*args: str) -> subprocess.CompletedProcess:
    """``npu-shadow verdict ARGS``, in this process: these tests are of what it decides and says."""
    return npu_shadow_here("verdict", *args)


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

    from shadow.core.judging import truth

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


def test_the_real_engines_gradient_evidence_reaches_the_verdict_alike_from_journals_and_metrics(tmp_path):
    """A legacy whose weight gradient is scaled (the forward bitwise equal), compared backward on a tenth of the
    calls: the gradients' own phase holds those calls, all divergent, from either source."""
    import types

    import torch
    from faults import ScaledGradient
    from prometheus_client import CollectorRegistry, generate_latest
    from torch import nn

    import shadow
    from exporters import JsonlExporter, PrometheusExporter

    ops = types.SimpleNamespace(op=lambda m, x: nn.functional.linear(x, ScaledGradient.apply(m.weight), m.bias))
    target = shadow.Target("linear", ops, "op", lambda m, x: m(x))
    registry, collect = CollectorRegistry(), Recorder()
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


# --------------------------------------------------------------------------- the rare path at 1%


@pytest.mark.parametrize("legacy_patches", ["torch_npu 2.12.0 source"], indirect=True)
def test_five_rare_cross_device_casts_among_two_thousand_are_all_compared_at_one_percent(legacy_patches):
    """A tensor on npu:1 cast by npu type name while npu:0 is current (torch_npu 2.12's legacy moves it, upstream
    keeps npu:1), 5 times among 2,000 ordinary npu casts, late in the job: once every signature seen had its first
    comparisons only one call in 64 was classified, and none of the 5 was compared."""
    import torch

    import shadow
    from shadow.launcher.config import Config

    defaults = Config()
    here, there = torch.ones(4, device="npu:0"), torch.ones(4, device="npu:1")
    rare_at = {700, 1100, 1400, 1700, 1950}
    for seed in range(10):
        collect = Recorder()
        with shadow.install(
            ["tensor_type"], sample_rate=0.01, first_per_signature=defaults.first_per_signature,
            budget=defaults.budget, seed=seed, exporters=[collect],
        ):  # fmt: skip
            for i in range(2_000):
                if i in rare_at:
                    assert there.type("torch.npu.FloatTensor").device == torch.device("npu:0")  # (legacy's)
                here.type(torch.float16 if i % 2 else "torch.npu.HalfTensor")
        rare = [o for o in collect.observations if o.signature == "npu_name/noncurrent/blocking"]
        assert [o.outcome for o in rare] == ["mismatch"] * 5, (seed, [(o.outcome, o.reasons) for o in rare])


def test_a_signature_key_that_fails_or_cannot_be_hashed_never_reaches_the_caller_and_counts_stay_exact():
    """The key runs on every call of the job: its failure, or an unhashable key, classifies the call (the
    signature function decides), never raises to the caller, and every call is counted once."""
    import types

    import torch

    import shadow

    def key(args, kwargs):
        kind = args[1]
        if kind == "raises":
            raise RuntimeError("the key's own failure")
        return [kind] if kind == "unhashable" else kind

    ops = types.SimpleNamespace(op=lambda x, kind: x + 1)
    target = shadow.Target(
        "op", ops, "op", lambda x, kind: x + 1, isolate=False, signature=lambda a, k: a[1], signature_key=key
    )
    kinds = ["common"] * 900 + ["raises"] * 50 + ["unhashable"] * 50
    x = torch.zeros(2)
    with shadow.install([target], sample_rate=0.0, first_per_signature=3, seed=1) as monitor:
        results = [ops.op(x, kind) for kind in kinds]
        stats = monitor.stats()["op"]
    assert all(torch.equal(r, torch.ones(2)) for r in results)
    assert stats.calls == 1000 and sum(stats.signature_calls.values()) == 1000
    assert stats.signature_calls["raises"] == 50 and stats.signature_calls["unhashable"] == 50  # (each classified)
    assert stats.match == 9  # (the first 3 of each signature, whatever its key did)


def test_a_late_cpu_signature_is_compared_on_its_first_calls_and_the_calls_are_counted_exactly():
    import torch

    import shadow

    x = torch.ones(3)
    collect = Recorder()
    with shadow.install(["tensor_type"], sample_rate=0.0, first_per_signature=5, seed=2, exporters=[collect]) as m:
        for i in range(3_000):
            x.type(torch.float64)
            if i >= 2_990:
                x.type("torch.HalfTensor")  # (first met after 2,990 calls of one signature)
        stats = m.stats()["tensor_type"]
    assert stats.calls == 3_010 and sum(stats.signature_calls.values()) == 3_010
    assert stats.signature_calls["name/cpu/blocking"] == 10  # (a key never known for a name: each call classified)
    late = [o.outcome for o in collect.observations if o.signature == "name/cpu/blocking"]
    assert late == ["match"] * 5


# --------------------------------------------------------------------------- start-up noise


def _jitter(x):
    """``x`` plus 1e-3 of a sign drawn afresh for every element on every run (no RNG a shadow run can put back):
    two sides that jitter alike, as nondeterministic kernels do, with no bias."""
    import numpy as np
    import torch

    signs = np.random.default_rng().choice([-1.0, 1.0], size=tuple(x.shape))
    return x + 1e-3 * torch.as_tensor(signs, dtype=x.dtype)


def test_an_honest_jittering_job_at_the_launchers_defaults_never_counts_a_mismatch(tmp_path):
    """Before the noise floor had its A/A runs, every value difference was a mismatch: an honest job whose two
    sides jitter alike rolled back from its metrics and paged at start, at every process start."""
    import types

    import torch

    import shadow
    from exporters import JsonlExporter
    from shadow.launcher.config import Config

    defaults = Config()
    ops = types.SimpleNamespace(op=_jitter)
    target = shadow.Target("op", ops, "op", _jitter, signature=lambda a, k: "call")
    journal = tmp_path / "j.jsonl"
    collect = Recorder()
    with shadow.install(
        [target], sample_rate=defaults.sample_rate, first_per_signature=defaults.first_per_signature,
        aa_rate=defaults.aa_rate, budget=None, seed=4, exporters=[collect, JsonlExporter(str(journal))],
    ) as monitor:  # fmt: skip
        x = torch.zeros(64)
        for _ in range(20_000):
            ops.op(x)
        inside = monitor.stats()["op"]
    stats = monitor.stats()["op"]
    assert stats.calls == 20_000
    assert stats.mismatch == 0, [o.noise_test for o in collect.observations if o.outcome == "mismatch"][:3]
    assert stats.noise > 100 and inside.noise_pending == 0  # (the early ones judged once the floor could)
    assert {o.outcome for o in collect.observations} <= {"noise", "match", "close"}
    decided = _verdict_json("--journal", str(journal))
    assert decided["targets"][0]["decision"] != "rollback" and decided["targets"][0]["divergent"] == 0


def test_a_value_difference_the_floor_never_could_judge_is_a_skip_never_agreement_nor_divergence():
    import types

    import torch

    import shadow

    ops = types.SimpleNamespace(op=_jitter)
    target = shadow.Target("op", ops, "op", _jitter)
    collect = Recorder()
    with shadow.install([target], sample_rate=1.0, aa_rate=0.001, budget=None, seed=5, exporters=[collect]) as m:
        x = torch.zeros(8)
        for _ in range(30):
            ops.op(x)
        during = m.stats()["op"]
    after = m.stats()["op"]
    assert during.sampled == during.compared < 30  # (the held differences are not counted yet)
    assert after.mismatch == 0 and after.by_reason.get("noise_pending", 0) == after.skipped > 0
    assert after.sampled == 30 and after.compared + after.skipped == 30


# --------------------------------------------------------------------------- proxies replaced by the real thing


def test_each_risky_signature_taken_needs_its_own_comparisons_not_its_patterns(tmp_path):
    """A risky signature with calls never compared (every sampled call skipped for memory) was passed because
    another signature matching the same pattern had been compared often enough."""
    record = journals.counts(
        {
            "dtype/cpu/blocking": {"match": 20_000},
            "torch_npu_name/current/blocking": {"match": 40},
        },
        target="tensor_type",
        calls={"dtype/cpu/blocking": 1_000_000, "torch_npu_name/current/blocking": 100,
               "torch_npu_name/noncurrent/blocking": 5},
        skipped={"torch_npu_name/noncurrent/blocking": {"oom": 5}},
        timestamp=10.0,
    )  # fmt: skip
    record["clusters"] = 20_040
    path = journals.write(tmp_path / "j.jsonl", [record])
    (decided,) = _verdict_json("--journal", str(path))["targets"]
    assert decided["risky"] == {"torch_npu_name/current/blocking": 40, "torch_npu_name/noncurrent/blocking": 0}
    assert decided["decision"] == "inconclusive"
    assert "risky signature torch_npu_name/noncurrent/blocking compared 0 times, needs 30" in decided["why"]


def test_a_rollback_in_metrics_stands_until_a_person_resets_it(tmp_path):
    """From a metrics file: a rollback stands (the verdict says rollback) until the resets counted match it."""
    import types

    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    import shadow
    from exporters import PrometheusExporter

    decisions = []
    for reset in (False, True):
        registry = CollectorRegistry()
        ops = types.SimpleNamespace(op=lambda x: x * 2)
        target = shadow.Target("op", ops, "op", lambda x: x * 2)
        with shadow.install(
            [target], sample_rate=1.0, primary="upstream", exporters=[PrometheusExporter(registry=registry)]
        ) as monitor:
            for _ in range(5):
                ops.op(torch.ones(2))
            monitor.roll_back("api")
            if reset:
                monitor.reset_primary("a person")
        textfile = tmp_path / f"m{reset}.prom"
        textfile.write_text(generate_latest(registry).decode())
        (decided,) = _verdict_json("--metrics-file", str(textfile))["targets"]
        decisions.append((decided["decision"], bool(decided["rollbacks"])))
    assert decisions == [("rollback", True), ("inconclusive", False)]


# --------------------------------------------------------------------------- correlation that cannot be gamed


def _ranks_in_lockstep(tmp_path, monkeypatch, world_size: int, variable: str = "WORLD_SIZE"):
    """``world_size`` ranks of one job (``variable`` set as its launcher sets it, one run), each with the real engine
    comparing the same 200 inputs over 40 minutes of its monotonic clock: journals one per rank, metrics summed in
    one registry as a multiprocess endpoint sums them. Returns the verdict's JSON target from each source."""
    import types

    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    import shadow
    from exporters import JsonlExporter, PrometheusExporter
    from shadow.core.calls import monitor
    from shadow.core.calls.record import clusters

    for each in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(each, raising=False)
    monkeypatch.setenv(variable, str(world_size))
    monkeypatch.setenv("NPU_SHADOW_RUN_ID", "job-1")
    clock = [0.0]
    monkeypatch.setattr(clusters, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))  # (its process time)
    registry = CollectorRegistry()
    metrics = PrometheusExporter(registry=registry)
    paths = []
    for rank in range(world_size):
        clock[0] = 1_000.0
        ops = types.SimpleNamespace(op=lambda x: x * 2)
        target = shadow.Target("op", ops, "op", lambda x: x * 2)
        path = tmp_path / f"w{world_size}-{variable}-rank{rank}.jsonl"
        with shadow.install(
            [target], sample_rate=1.0, budget=None, seed=rank, exporters=[JsonlExporter(str(path)), metrics]
        ):
            torch.manual_seed(0)  # (every rank sees the same inputs)
            for _ in range(40):
                for _ in range(5):
                    ops.op(torch.randn(4))
                clock[0] += 60.0
        paths.append(str(path))
    textfile = tmp_path / f"w{world_size}-{variable}.prom"
    textfile.write_text(generate_latest(registry).decode())
    (from_journals,) = _verdict_json("--max-rate", "0.05", "--journal", *paths)["targets"]
    (from_metrics,) = _verdict_json("--max-rate", "0.05", "--metrics-file", str(textfile))["targets"]
    return from_journals, from_metrics


def test_eight_ranks_in_lockstep_are_the_evidence_of_one_not_eight(tmp_path, monkeypatch):
    """Eight torchrun ranks that saw the same inputs counted as eight times one rank's evidence and promoted where
    one rank was inconclusive: a block of the job is one cluster however many ranks compare in it."""
    one = _ranks_in_lockstep(tmp_path, monkeypatch, 1)
    eight = _ranks_in_lockstep(tmp_path, monkeypatch, 8)
    for alone, together in zip(one, eight, strict=True):
        assert together["compared"] == 8 * alone["compared"] == 1_600
        assert alone["decision"] == together["decision"] == "inconclusive"
        assert together["clusters"] == alone["clusters"] == 40
        assert together["upper"] == pytest.approx(alone["upper"], rel=1e-9)
    assert eight[0]["upper"] == pytest.approx(eight[1]["upper"], rel=1e-9)  # (journals and metrics alike)


def test_a_world_size_that_is_not_a_number_of_ranks_fails_at_start_up_naming_it(monkeypatch):
    import types

    import shadow

    monkeypatch.setenv("WORLD_SIZE", "eight")
    original = lambda x: x  # noqa: E731
    ops = types.SimpleNamespace(op=original)
    with pytest.raises(ValueError, match="WORLD_SIZE='eight'"):
        shadow.install([shadow.Target("op", ops, "op", lambda x: x)], sample_rate=1.0)
    assert ops.op is original  # (nothing was left installed)


# --------------------------------------------------------------------------- recent evidence and runs apart


def _minutes(
    path, minutes: int, diverging_from: int, rate: float, pids: range = range(10), run: str = "job-1"
) -> pathlib.Path:
    """Count records, a minute apart, of ``pids`` processes of ``run``: 100 comparisons a minute each (one cluster
    a minute), ``rate`` of them divergent from minute ``diverging_from`` on."""
    records = []
    for pid in pids:
        compared = divergent = 0
        for minute in range(1, minutes + 1):
            compared += 100
            divergent += round(100 * rate) if minute > diverging_from else 0
            record = journals.counts(
                {"s": {"match": compared - divergent, "mismatch": divergent}},
                timestamp=1_700_000_000.0 + 60 * minute,
                pid=pid,
            )
            records.append({**record, "clusters": minute, "mono": 60.0 * minute, "run": run})
    return journals.write(path, records)


def test_ten_clean_hours_do_not_hide_an_hour_at_five_times_the_max_rate(tmp_path):
    """Ten clean hours then an hour at 5x the max rate promoted on the pooled history (its rate 0.45x the max):
    the last hour is decided too, and it rolls back."""
    path = _minutes(tmp_path / "j.jsonl", 660, 600, 0.05)
    decided = _verdict_json("--journal", str(path), "--max-rate", "0.01")
    (target,) = decided["targets"]
    assert target["compared"] == 660_000 and target["divergent"] == 3_000
    assert target["upper"] < 0.01  # (the whole history alone would promote)
    slices = {s["name"]: s for s in target["slices"]}
    assert list(slices) == ["the last 1h", "the last 15m", "the last 5m"]
    recent = slices["the last 1h"]
    assert recent["decision"] == "rollback"
    assert (recent["compared"], recent["divergent"]) == (60_000, 3_000)
    assert (slices["the last 5m"]["compared"], slices["the last 5m"]["divergent"]) == (5_000, 250)
    assert recent["lower"] > 0.01
    assert target["decision"] == decided["decision"] == "rollback"
    assert target["why"].startswith("the last 1h, legacy phase: divergence rate is at least")
    whole_only = _verdict_json("--journal", str(path), "--max-rate", "0.01", "--recent", "0")  # (no window at all)
    assert whole_only["decision"] == "promote" and whole_only["targets"][0]["slices"] == []


def test_a_quiet_recent_hour_never_outvotes_a_clean_history(tmp_path):
    """The last hour alone holds too little evidence to promote: it allows promote, it does not hold it back."""
    path = _minutes(tmp_path / "j.jsonl", 660, 660, 0.0, pids=range(2))
    (target,) = _verdict_json("--journal", str(path), "--max-rate", "0.01")["targets"]
    assert len(target["slices"]) == 3
    for recent in target["slices"]:
        assert recent["decision"] == "promote" and recent["upper"] > 0.01  # (it could not promote on its own)
    assert target["decision"] == "promote"


def test_a_divergent_hour_held_back_below_significance_waits(tmp_path):
    """A recent hour whose rate is above the max rate without evidence to roll back holds promote as
    inconclusive."""
    path = _minutes(tmp_path / "j.jsonl", 660, 600, 0.04, pids=range(1))
    path2 = _minutes(tmp_path / "k.jsonl", 660, 660, 0.0, pids=range(1, 3))
    (target,) = _verdict_json("--journal", str(path), str(path2), "--max-rate", "0.01")["targets"]
    assert target["upper"] < 0.01  # (the whole history alone would promote)
    for recent in target["slices"]:
        assert recent["decision"] == "inconclusive" and recent["rate"] > 0.01 > recent["lower"]
    assert target["decision"] == "inconclusive" and "promote waits until it is not" in target["why"]


def test_two_runs_pooled_are_each_decided_and_the_worst_decides(tmp_path):
    """Two jobs pooled (--all-runs), one of them 5% divergent, promoted on the pooled rate: each run is a slice,
    and the divergent one rolls the target back."""
    clean = _minutes(tmp_path / "a.jsonl", 60, 60, 0.0, pids=range(100), run="clean")
    bad = _minutes(tmp_path / "b.jsonl", 60, 0, 0.05, pids=range(100, 105), run="bad")
    decided = _verdict_json("--journal", str(clean), str(bad), "--all-runs", "--max-rate", "0.01", "--recent", "0")
    (target,) = decided["targets"]
    assert target["upper"] < 0.01  # (pooled: 0.0024)
    slices = {s["name"]: s["decision"] for s in target["slices"]}
    assert slices == {"run bad": "rollback", "run clean": "promote"}
    assert decided["decision"] == "rollback" and target["why"].startswith("run bad, legacy phase")


def test_two_runs_pooled_from_a_metrics_file_are_each_decided(tmp_path):
    lines = ["# TYPE npu_shadow_comparisons_total counter", "# TYPE npu_shadow_clusters_total counter"]
    for run, (matched, diverged, clusters) in {"clean": (600_000, 0, 6_000), "bad": (28_500, 1_500, 300)}.items():
        for outcome, value in (("match", matched), ("mismatch", diverged)):
            lines.append(
                f'npu_shadow_comparisons_total{{run="{run}",target="op",outcome="{outcome}",signature="",'
                f'primary="legacy"}} {value}'
            )
        lines.append(f'npu_shadow_clusters_total{{run="{run}",target="op",primary="legacy"}} {clusters}')
    path = tmp_path / "m.prom"
    path.write_text("\n".join(lines) + "\n")
    decided = _verdict_json("--metrics-file", str(path), "--all-runs", "--max-rate", "0.01")
    (target,) = decided["targets"]
    assert target["upper"] < 0.01
    assert {s["name"]: s["decision"] for s in target["slices"]} == {"run bad": "rollback", "run clean": "promote"}
    assert decided["decision"] == "rollback"


def test_a_signature_that_always_diverges_rolls_back_on_its_own_whatever_its_share(tmp_path):
    """One signature at 1e-5 of the calls, diverging on each of its 30 comparisons: it widened every signature's
    joint bound (promote needed some 144,000 comparisons) and the verdict stayed inconclusive; its own bound decides
    its rollback."""
    record = journals.counts(
        {"common": {"match": 20_000}, "rare": {"mismatch": 30}},
        calls={"common": 10_000_000 - 100, "rare": 100},
        timestamp=10.0,
    )
    record["clusters"] = 20_030
    path = journals.write(tmp_path / "j.jsonl", [record])
    (target,) = _verdict_json("--journal", str(path), "--max-rate", "0.001")["targets"]
    assert target["rate"] < 0.001  # (its share of the calls: 1e-5)
    assert target["decision"] == "rollback"
    assert "signature rare diverges on its own" in target["why"]
    from shadow.analysis import bounds

    assert bounds.lower_bound(30, 30, bounds.ALPHA / 2) > 0.001  # (the independent check of its own bound)


def test_a_signature_with_a_few_divergences_among_many_is_left_to_the_joint_bound(tmp_path):
    record = journals.counts(
        {"common": {"match": 20_000}, "rare": {"match": 9_999, "mismatch": 1}},
        calls={"common": 10_000_000, "rare": 10_000},
        timestamp=10.0,
    )
    record["clusters"] = 30_000
    path = journals.write(tmp_path / "j.jsonl", [record])
    (target,) = _verdict_json("--journal", str(path), "--max-rate", "0.001")["targets"]
    assert "diverges on its own" not in target["why"] and target["decision"] != "rollback"


# --------------------------------------------------------------------------- a fire drill set aside by its marks


def _drill_then_clean(path, drill_minutes: int, clean_minutes: int) -> pathlib.Path:
    """One process drilled (every comparison of its ``drill_minutes`` divergent, marked drilled), then a process
    of the same run without a drill: 100 clean comparisons a minute for ``clean_minutes``, in 20 processes."""
    records = []
    for minute in range(1, drill_minutes + 1):
        record = journals.counts({"s": {"mismatch": 100 * minute}}, timestamp=1_700_000_000.0 + 60 * minute, pid=1)
        marks = {"drilled_outcomes": {"s": {"mismatch": 100 * minute}}, "drilled_reasons": {"value": 100 * minute}}
        records.append({**record, "drilled": 100 * minute, **marks, "clusters": minute, "mono": 60.0 * minute})
    start = 1_700_000_000.0 + 60 * (drill_minutes + 1)
    for pid in range(2, 22):
        for minute in range(1, clean_minutes + 1):
            record = journals.counts({"s": {"match": 100 * minute}}, timestamp=start + 60 * minute, pid=pid)
            records.append({**record, "clusters": minute, "mono": 60.0 * minute})
    return journals.write(path, records)


def test_a_fire_drill_followed_by_clean_evidence_is_set_aside_and_the_clean_evidence_decides(tmp_path):
    """A ten-minute fire drill followed by clean evidence stayed inconclusive (or rolled back) for good."""
    path = _drill_then_clean(tmp_path / "j.jsonl", 10, 60)
    done = verdict_cli("--journal", str(path), "--max-rate", "0.01", "--recent", "0")
    assert done.returncode == 0, done.stdout
    assert "a fire drill is over: its 1,000 comparisons (op) were set aside by its marks" in done.stdout
    assert "overall: promote (max rate 0.01)" in done.stdout
    (target,) = _verdict_json("--journal", str(path), "--max-rate", "0.01", "--recent", "0")["targets"]
    assert (target["compared"], target["divergent"], target["drill_set_aside"]) == (120_000, 0, 1_000)


def test_a_fire_drill_still_drilling_is_rehearsed_not_set_aside(tmp_path):
    path = _drill_then_clean(tmp_path / "j.jsonl", 10, 0)
    done = verdict_cli("--journal", str(path), "--max-rate", "0.01")
    assert done.returncode == 1 and "FIRE DRILL: 1,000 comparisons carry" in done.stdout
    assert done.stdout.rstrip().endswith("- a FIRE DRILL")


def _drill_history(minutes: int, drill: range) -> tuple[dict, float]:
    """A run's history as Prometheus would have scraped it, a sample a minute: 100 comparisons a minute, every one
    a mismatch while a fire drill's gauge is 1 (the minutes in ``drill``), none otherwise. (series, its end)."""
    start = (time.time() // 60 - minutes - 120) * 60  # (two hours back: within the head block's range, never ahead)
    common = {"job": "train", "instance": "rank0", "run": "job-1", "target": "op", "primary": "legacy"}
    match = mismatch = drilled = 0
    points: dict[str, list[tuple[float, float]]] = {
        "calls": [],
        "match": [],
        "mismatch": [],
        "drill": [],
        "drilled": [],
    }
    for minute in range(minutes + 1):
        at = start + 60 * minute
        if minute:
            mismatch += 100 if minute in drill else 0
            drilled += 100 if minute in drill else 0
            match += 0 if minute in drill else 100
        for name, value in (
            ("calls", match + mismatch),
            ("match", match),
            ("mismatch", mismatch),
            ("drilled", drilled),
        ):
            points[name].append((at, float(value)))
        points["drill"].append((at, 1.0 if minute in drill else 0.0))
    series = {
        "npu_shadow_calls_total": [({**common, "signature": "s"}, points["calls"])],
        "npu_shadow_comparisons_total": [
            ({**common, "signature": "s", "outcome": "match"}, points["match"]),
            ({**common, "signature": "s", "outcome": "mismatch"}, points["mismatch"]),
        ],
        "npu_shadow_mismatches_total": [({**common, "reason": "value"}, points["mismatch"])],
        "npu_shadow_drilled_total": [({**common, "signature": "s", "outcome": "mismatch"}, points["drilled"])],
        "npu_shadow_drilled_reasons_total": [({**common, "reason": "value"}, points["drilled"])],
        "npu_shadow_drill_active": [({"job": "train", "instance": "rank0", "run": "job-1"}, points["drill"])],
    }
    return series, start + 60 * minutes


@pytest.mark.slow
@pytest.mark.e2e
def test_a_fire_drill_that_is_over_is_set_aside_from_prometheus_by_its_gauges_history(tmp_path):
    """A ten-minute fire drill, then clean evidence, read from a real Prometheus: the comparisons it marked
    (npu_shadow_drilled_total) are set aside once its gauge says it is over, the clean evidence decides; a drill
    still on at the end is rehearsed (rollback, FIRE DRILL)."""
    from prometheus_server import backfill, prometheus

    over, over_end = _drill_history(130, range(31, 41))
    still, still_end = _drill_history(130, range(121, 131))
    for name, (history, end) in {"over": (over, over_end), "still": (still, still_end)}.items():
        place = tmp_path / name
        place.mkdir()
        backfill(place / "data", history)
        with prometheus(place, {}, []) as server:
            args = ("--prometheus", server.url, "--end", str(end), "--max-rate", "0.01")
            done = verdict_cli(*args)
            if name == "over":
                assert done.returncode == 0, done.stdout + done.stderr
                assert "a fire drill is over: its 1,000 comparisons (op) were set aside" in done.stdout
                (target,) = _verdict_json(*args)["targets"]
                # 13,000 compared, 1,000 of them drilled: exactly those are set aside
                assert (target["compared"], target["divergent"], target["drill_set_aside"]) == (12_000, 0, 1_000)
            else:
                assert done.returncode == 1, done.stdout + done.stderr
                assert "FIRE DRILL" in done.stdout and done.stdout.rstrip().endswith("- a FIRE DRILL")


# --------------------------------------------------------------------------- repeated looks with the new units


@pytest.mark.slow
def test_repeated_looks_at_the_max_rate_with_rank_shares_and_the_recent_windows_promote_at_most_5_percent():
    """A job of 4 ranks in lockstep, its true rate at the max rate, read again and again on its whole history and
    its recent windows (benchmarks/verdict_looks.py, each look decided by the verdict itself): promote at most 5%
    of the jobs (+ Monte Carlo error); the same job at a tenth of the max rate is promoted (it can); an honest job
    read every hour for a week is never rolled back by a window, one at 3x the max rate is."""
    import re

    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "verdict_looks.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shares = [float(x) / 100 for x in re.findall(r"([0-9.]+)% of", done.stdout)]
    false_promotes, *_ = shares
    assert false_promotes <= 0.05 + 3 * (0.05 * 0.95 / 300) ** 0.5, done.stdout
    assert "promotes at a tenth of the max rate (the check that it can): 100.00%" in done.stdout
    honest_weeks = re.findall(r"honest job at [0-9.]+x the max rate .*?: ([0-9.]+)% of", done.stdout)
    assert honest_weeks == ["0.00", "0.00"], done.stdout
    (can,) = re.findall(r"at 3x the max rate \(the check that it can\): ([0-9.]+)%", done.stdout)
    assert float(can) > 90, done.stdout
