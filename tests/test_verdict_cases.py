"""The verdict in the cases a team meets: an ended run read later, ranks from every launcher, a burst younger than
an hour, a restart after a rollback, a drill beside a real incident, the ETA, two jobs under one run id, the first
minutes of a jittering job, and count records that cannot be."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import journals
import pytest
from commands import npu_shadow
from test_thin_evidence import ROOT, verdict_cli


def _json(*args: str) -> dict:
    done = verdict_cli(*args, "--format", "json")
    assert done.returncode in (0, 1, 3), done.stdout + done.stderr
    return json.loads(done.stdout)


def _source_error(done, *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


# --------------------------------------------------------------------------- 7: count records that cannot be


@pytest.mark.parametrize("field", ["timestamp", "mono"])
def test_a_time_of_ten_to_the_400_is_a_source_error_naming_it_not_a_traceback(tmp_path, field):
    """An integer too large for a float ended in OverflowError with exit 1, the rollback code."""
    record = journals.counts({"s": {"match": 100}}, calls={"s": 100}, timestamp=10.0)
    record[field] = 10**400
    path = journals.write(tmp_path / "j.jsonl", [record])
    _source_error(verdict_cli("--journal", str(path)), f"whose {field} is an integer of 1329 bits")


@pytest.mark.parametrize(
    "args, words",
    [
        (("--start", "100"), ["--start selects a span of --prometheus history", "--journal is read whole"]),
        (("--start", "100", "--end", "200"), ["--start and --end select"]),
        (("--end", "nan"), ["argument --end", "'nan' is not a time"]),
    ],
    ids=["start", "start-end", "nan"],
)
def test_a_span_a_journal_cannot_have_is_refused_never_silently_ignored(tmp_path, args, words):
    path = journals.write(tmp_path / "j.jsonl", [journals.counts({"s": {"match": 100}}, calls={"s": 100})])
    _source_error(verdict_cli("--journal", str(path), *args), *words)


def test_a_span_that_ends_before_it_starts_is_refused():
    done = verdict_cli("--prometheus", "http://127.0.0.1:9", "--start", "200", "--end", "100")
    _source_error(done, "--start (200) is after --end (100)")


# --------------------------------------------------------------------------- 1: an ended run's own last hour


def _history(
    minutes: int, diverging_from: int, rate: float, ended_ago: float, instances: int = 10
) -> tuple[dict, float]:
    """A run's history as Prometheus scraped it, a sample a minute from each of ``instances`` processes: 100
    comparisons a minute each (a cluster a minute), ``rate`` of them divergent after minute ``diverging_from``;
    its last sample ``ended_ago`` seconds before now. (series for ``backfill``, the last sample's time)."""
    import time

    end = (time.time() - ended_ago) // 60 * 60
    start = end - 60 * minutes
    series: dict[str, list] = {
        name: []
        for name in (
            "npu_shadow_calls_total", "npu_shadow_comparisons_total", "npu_shadow_mismatches_total",
            "npu_shadow_clusters_total",
        )
    }  # fmt: skip
    for instance in range(instances):
        common = {"job": "train", "instance": f"rank{instance}", "run": "job-1", "target": "op", "primary": "legacy"}
        points: dict[str, list] = {"match": [], "mismatch": [], "clusters": []}
        match = mismatch = 0
        for minute in range(minutes + 1):
            if minute:
                diverged = round(100 * rate) if minute > diverging_from else 0
                match, mismatch = match + 100 - diverged, mismatch + diverged
            at = start + 60 * minute
            points["match"].append((at, float(match)))
            points["mismatch"].append((at, float(mismatch)))
            points["clusters"].append((at, float(minute)))
        calls = [(at, m + points["mismatch"][i][1]) for i, (at, m) in enumerate(points["match"])]
        series["npu_shadow_calls_total"].append(({**common, "signature": "s"}, calls))
        series["npu_shadow_comparisons_total"] += [
            ({**common, "signature": "s", "outcome": "match"}, points["match"]),
            ({**common, "signature": "s", "outcome": "mismatch"}, points["mismatch"]),
        ]
        series["npu_shadow_mismatches_total"].append(({**common, "reason": "value"}, points["mismatch"]))
        series["npu_shadow_clusters_total"].append((common, points["clusters"]))
    return series, end


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_that_ended_hours_ago_is_judged_on_its_own_last_hour(tmp_path):
    """Ten clean hours, then an hour at 5x the max rate, the run ended 3 hours before the read: "the last hour"
    was the hour before now (empty), and the run promoted; its journals rolled back."""
    from prometheus_server import backfill, prometheus

    history, end = _history(660, 600, 0.05, ended_ago=3 * 3600)
    backfill(tmp_path / "data", history)
    with prometheus(tmp_path, {}, []) as server:
        decided = _json("--prometheus", server.url, "--run", "job-1", "--max-rate", "0.01")
        at_its_end = _json("--prometheus", server.url, "--run", "job-1", "--max-rate", "0.01", "--end", str(end))
    for each in (decided, at_its_end):
        (target,) = each["targets"]
        assert (target["compared"], target["divergent"]) == (660_000, 3_000)
        recent = {s["name"]: s for s in target["slices"]}["the last 1h"]
        assert recent["decision"] == "rollback"
        assert (recent["compared"], recent["divergent"]) == (60_000, 3_000)
        assert each["decision"] == "rollback"


# --------------------------------------------------------------------------- 3: a burst younger than an hour


def test_a_ten_minute_burst_after_ten_clean_hours_is_not_promoted(tmp_path):
    """64 processes x 10 clean hours, their last 10 minutes at 5x the max rate: the last hour diluted the burst to
    0.87x the max rate, and the run promoted. The last 15 and 5 minutes are decided too."""
    from test_thin_evidence import _minutes

    path = _minutes(tmp_path / "j.jsonl", 610, 600, 0.05, pids=range(64))
    decided = _json("--journal", str(path), "--max-rate", "0.01")
    (target,) = decided["targets"]
    assert target["upper"] < 0.01  # (the whole history alone would promote)
    slices = {s["name"]: s for s in target["slices"]}
    assert slices["the last 1h"]["decision"] == "promote" and slices["the last 1h"]["rate"] < 0.01  # (diluted)
    assert slices["the last 5m"]["rate"] == pytest.approx(0.05)
    assert slices["the last 5m"]["decision"] in ("inconclusive", "rollback")
    assert decided["decision"] != "promote"


# --------------------------------------------------------------------------- 6: an ETA that holds


def _one_stratum(k: float, n: float, clusters: float, seconds: float = 0.0):
    from shadow.analysis.evidence import TargetCounts

    evidence = TargetCounts()
    evidence.add_outcome("", "match", n - k)
    evidence.add_outcome("", "mismatch", k)
    evidence.add_clusters(clusters)
    evidence.process_seconds = seconds
    return evidence


def test_the_eta_at_half_the_max_rate_counts_the_divergences_running_on_brings():
    """At a rate seen of half the max, "about N more" kept today's divergences fixed: running on for N at that rate,
    and for 3N, was still inconclusive. Now N includes the divergences at the rate seen, and running on for it at
    that rate promotes."""
    import re

    from shadow.analysis.verdict import INCONCLUSIVE, PROMOTE, decide

    max_rate = 0.01
    decided = decide("op", _one_stratum(5, 1_000, 1_000, seconds=72_000), max_rate)  # (rate 0.005, half the max)
    assert decided.decision == INCONCLUSIVE
    assert "at the rate seen (0.005, its divergences included)" in decided.why, decided.why
    more = int(re.search(r"about ([0-9,]+) more clusters", decided.why).group(1).replace(",", ""))
    n = 1_000 + more
    assert decide("op", _one_stratum(0.005 * n, n, n), max_rate).decision == PROMOTE
    # (and not much earlier: the ETA is the least that does)
    early = 1_000 + int(more * 0.9)
    assert decide("op", _one_stratum(0.005 * early, early, early), max_rate).decision == INCONCLUSIVE
    hours = more / 50  # (1,000 clusters in 20 process-hours: 50 an hour)
    assert f"50 clusters per process-hour: about {hours:,.3g} more process-hours" in decided.why


def test_a_rate_seen_above_the_max_by_chance_is_never_called_cannot_promote():
    """One divergence in 960 clusters (8 processes x 2 h: rate 0.00104 at max rate 0.001) said "cannot promote" of
    jobs whose rate is below the max: the rate is not surely above it (its lower bound is far below), so the verdict
    says which share of the futures the evidence allows never promote, and when the others do."""
    from shadow.analysis.verdict import decide

    decided = decide("op", _one_stratum(1, 960, 960, seconds=8 * 7_200), 0.001)
    assert decided.decision == "inconclusive" and "cannot promote" not in decided.why, decided.why
    assert "running on never promotes, though the rate may be below it" in decided.why
    assert re.search(
        r"90% of them: [0-9,]+ \([0-9.,]+ process-hours\) to never; \d+% of them never promote", decided.why
    )


def test_cannot_promote_is_said_where_the_rate_surely_reaches_the_max_with_the_calls_never_compared():
    """The rate's lower bound (0.00084) and the share of calls never compared (0.0005) together reach the max rate
    (0.001): no running on promotes, whatever the futures."""
    from shadow.analysis.evidence import TargetCounts
    from shadow.analysis.verdict import decide

    evidence = TargetCounts(process_seconds=8 * 3_600 * 100)
    evidence.add_outcome("s", "match", 40_000 - 60)
    evidence.add_outcome("s", "mismatch", 60)
    evidence.add_clusters(40_000)
    evidence.add_calls("s", 40_020)
    evidence.add_skip("oom", 20, signature="s")  # (20 calls never compared: a share of 0.0005)
    decided = decide("op", evidence, 0.001)
    assert decided.decision == "inconclusive" and decided.lower + decided.uncovered_share >= 0.001, decided.why
    assert "running on cannot promote" in decided.why and "predicted" not in decided.why, decided.why


def _actual_more(k: int, n: float, rate: float, max_rate: float, rng) -> float:
    """How much more evidence a job with ``rate`` really took to promote, from ``k`` in ``n``: its divergences drawn
    as it runs on, the one-stratum bound read at each point of the ETA's grid (independently of its tables)."""
    from shadow.analysis import bounds, eta

    prior = bounds.Prior.for_max_rate(max_rate)
    at, reach = n, eta.HORIZON * max(n, bounds.effective_needed(max_rate, 0, prior))
    for _ in range(math.ceil(math.log(reach / n) / math.log(eta.GRID_STEP))):
        grown = at * eta.GRID_STEP
        k += rng.binomial(math.floor(grown - at), rate)
        at = grown
        if bounds.upper_bound(k, at, prior) < max_rate:
            return at - n
    return math.inf


@pytest.mark.parametrize("processes, hours", [(8, 2), (10, 8.3)], ids=["960-clusters", "5000-clusters"])
def test_the_etas_90_percent_range_holds_the_time_a_job_really_takes(processes, hours):
    """With divergences at half the max rate, the promised time was kept in 59% to 86% of runs (actual/promised 0.08
    to 3.8). The range from the predictive simulation holds the time the job really took in >= 85% of simulated
    runs (seeded: 100 jobs, each its own first evidence and its own future)."""
    import numpy as np

    from shadow.analysis import bounds, eta

    max_rate, n = 0.001, round(processes * hours * 60)
    rng = np.random.default_rng(2026)
    inside = 0
    for _ in range(100):
        k = int(rng.binomial(n, max_rate / 2))
        predicted = eta.predict(k, n, max_rate, bounds.Prior.for_max_rate(max_rate))
        inside += predicted.low <= _actual_more(k, n, max_rate / 2, max_rate, rng) <= predicted.high
    assert inside >= 85, inside


def test_clusters_come_at_most_sixty_per_process_hour_however_short_the_process():
    """A process of 24 seconds with one cluster was a rate of 150 clusters per process-hour (at most 60 are)."""
    from shadow.analysis.verdict import decide

    decided = decide("op", _one_stratum(0, 100, 1, seconds=24), 0.01)
    assert "at this evidence's rate, 60 clusters per process-hour" in decided.why, decided.why


def test_one_run_gives_one_evidence_rate_from_its_journal_and_its_metrics(tmp_path):
    """The journal's process time was its first count record to its last, the metrics' the time under the monitor:
    one short run said 152 clusters per process-hour from one source and 249 from the other. Count records now carry
    the time under the monitor."""
    import re
    import time
    import types

    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    import shadow
    from exporters import JsonlExporter, PrometheusExporter

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    registry, journal = CollectorRegistry(), tmp_path / "j.jsonl"
    exporters = [JsonlExporter(str(journal)), PrometheusExporter(registry=registry)]
    with shadow.install([shadow.Target("op", ops, "op", lambda x: x * 2)], sample_rate=1.0, budget=None,
                        exporters=exporters) as monitor:  # fmt: skip
        for _ in range(50):
            ops.op(torch.ones(3))
        time.sleep(1.5)  # (the reporter's ticks: process time reported while the job runs)
        monitor.stats()
    textfile = tmp_path / "m.prom"
    textfile.write_text(generate_latest(registry).decode())
    rates = []
    for source in (("--journal", str(journal)), ("--metrics-file", str(textfile))):
        (target,) = _json(*source, "--recent", "0")["targets"]
        rates.append(
            re.search(r"at this evidence's rate, ([0-9.,]+) clusters per process-hour", target["why"]).group(1)
        )
    assert rates[0] == rates[1], rates
    assert float(rates[0].replace(",", "")) <= 60


# --------------------------------------------------------------------------- 5: a drill never hides a real incident


@pytest.mark.slow
def test_a_drill_over_in_journals_sets_aside_its_marked_comparisons_never_the_real_divergences_beside_them(tmp_path):
    """A drill at 1 in 10 in a process that really diverged on every call set aside its whole span: the 90 real
    divergences went with the 10 drilled, and the clean evidence after it decided."""
    import types

    import torch

    import shadow
    from exporters import JsonlExporter
    from shadow.core.calls.sampled.drill import Drill

    journal = tmp_path / "j.jsonl"
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    diverging = shadow.Target("op", ops, "op", lambda x: x * 2 + 1)
    with shadow.install([diverging], sample_rate=1.0, budget=None, exporters=[JsonlExporter(str(journal))],
                        drill=Drill("value", 0.1, seed=3)) as monitor:  # fmt: skip
        for _ in range(100):
            ops.op(torch.ones(3))
        drilled = monitor.stats()["op"].drilled
    assert 3 <= drilled <= 25
    clean = shadow.Target("op", ops, "op", lambda x: x * 2)
    with shadow.install([clean], sample_rate=1.0, budget=None, exporters=[JsonlExporter(str(journal))]):
        for _ in range(3_000):
            ops.op(torch.ones(3))
    decided = _json("--journal", str(journal), "--max-rate", "0.01", "--recent", "0")
    (target,) = decided["targets"]
    assert target["drill_set_aside"] == drilled
    assert (target["compared"], target["divergent"]) == (3_100 - drilled, 100 - drilled)  # (the real ones stay)
    assert decided["decision"] != "promote"


def _drill_beside_an_incident(minutes: int, drill: range) -> tuple[dict, float]:
    """A run of two processes scraped a minute apart, 100 comparisons a minute each: rank0 drilled every comparison
    in ``drill`` (marked by npu_shadow_drilled_total), rank1 diverged for real in every one of those minutes."""
    import time

    start = (time.time() // 60 - minutes - 120) * 60
    series: dict[str, list] = {}
    for rank in (0, 1):
        common = {"job": "train", "instance": f"rank{rank}", "run": "job-1", "target": "op", "primary": "legacy"}
        match = mismatch = drilled = 0
        points: dict[str, list] = {"match": [], "mismatch": [], "drilled": [], "drill": [], "calls": []}
        for minute in range(minutes + 1):
            at = start + 60 * minute
            if minute:
                diverging = minute in drill
                match, mismatch = match + (0 if diverging else 100), mismatch + (100 if diverging else 0)
                drilled += 100 if diverging and rank == 0 else 0
            for name, value in (("match", match), ("mismatch", mismatch), ("drilled", drilled),
                                ("calls", match + mismatch)):  # fmt: skip
                points[name].append((at, float(value)))
            points["drill"].append((at, 1.0 if rank == 0 and minute in drill else 0.0))
        for name, labels, values in (
            ("npu_shadow_calls_total", {**common, "signature": "s"}, points["calls"]),
            ("npu_shadow_comparisons_total", {**common, "signature": "s", "outcome": "match"}, points["match"]),
            ("npu_shadow_comparisons_total", {**common, "signature": "s", "outcome": "mismatch"}, points["mismatch"]),
            ("npu_shadow_mismatches_total", {**common, "reason": "value"}, points["mismatch"]),
            ("npu_shadow_drilled_total", {**common, "signature": "s", "outcome": "mismatch"}, points["drilled"]),
            ("npu_shadow_drilled_reasons_total", {**common, "reason": "value"}, points["drilled"]),
            ("npu_shadow_drill_active", {k: common[k] for k in ("job", "instance", "run")}, points["drill"]),
        ):
            series.setdefault(name, []).append((labels, values))
    return series, start + 60 * minutes


@pytest.mark.slow
@pytest.mark.e2e
def test_a_drill_on_one_process_never_sets_aside_a_real_incident_on_another(tmp_path):
    """Over Prometheus a drill set aside every process's counts while it ran: a real 100/100 incident on another
    process in those minutes went with it, and 30 minutes later the run promoted."""
    from prometheus_server import backfill, prometheus

    history, end = _drill_beside_an_incident(70, range(31, 41))
    backfill(tmp_path / "data", history)
    with prometheus(tmp_path, {}, []) as server:
        decided = _json("--prometheus", server.url, "--end", str(end), "--max-rate", "0.01", "--recent", "0")
    (target,) = decided["targets"]
    assert target["drill_set_aside"] == 1_000
    assert (target["compared"], target["divergent"]) == (13_000, 1_000)  # (rank1's incident stays evidence)
    assert decided["decision"] == "rollback"


# --------------------------------------------------------------------------- 4: a rollback and a restart


def _exposition(run_lines: dict[str, tuple[int, int, int]], build: list[dict[str, str]], rollbacks: int = 0) -> str:
    """A saved scrape: per run (matches, mismatches, clusters) of target op, and the build_info series given."""
    lines = ["# TYPE npu_shadow_comparisons_total counter", "# TYPE npu_shadow_clusters_total counter"]
    for run, (matched, diverged, clusters) in run_lines.items():
        for outcome, value in (("match", matched), ("mismatch", diverged)):
            lines.append(
                f'npu_shadow_comparisons_total{{run="{run}",target="op",outcome="{outcome}",signature="",'
                f'primary="legacy"}} {value}'
            )
        lines.append(f'npu_shadow_clusters_total{{run="{run}",target="op",primary="legacy"}} {clusters}')
    lines.append("# TYPE npu_shadow_rollbacks_total counter")
    lines.append(f'npu_shadow_rollbacks_total{{run="job-1",target="op",source="http"}} {rollbacks}')
    lines.append("# TYPE npu_shadow_build_info gauge")
    for labels in build:
        rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"npu_shadow_build_info{{{rendered}}} 1")
    return "\n".join(lines) + "\n"


def _build(command: str = "0123456789ab", restart: str = "0", run: str = "job-1") -> dict[str, str]:
    return {"run": run, "version": "0.1.0", "torch": "2.13.0", "torch_npu": "none", "command": command,
            "restart": restart}  # fmt: skip


def test_a_metrics_file_scraped_after_a_restart_never_promotes(tmp_path):
    """A canary rolled back, its process restarted (counters back at 0), then 10,000 clean clusters: the scrape
    after the restart promoted. A moment of a restarted job cannot see the rollback before it."""
    clean = {"job-1": (10_000, 0, 10_000)}
    restarted = tmp_path / "restarted.prom"
    restarted.write_text(_exposition(clean, [_build(restart="1")]))
    decided = _json("--metrics-file", str(restarted), "--max-rate", "0.001")
    assert decided["decision"] == "inconclusive"
    assert "the job was restarted (1 restarts)" in decided["targets"][0]["why"]
    first = tmp_path / "first.prom"  # (the same evidence from a process never restarted promotes: the restart holds it)
    first.write_text(_exposition(clean, [_build(restart="0")]))
    assert _json("--metrics-file", str(first), "--max-rate", "0.001")["decision"] == "promote"


def test_the_exporter_says_the_launchers_restart_count_and_the_jobs_command(monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters import PrometheusExporter
    from shadow.core.model import run_ids

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    registry = CollectorRegistry()
    PrometheusExporter(registry=registry)
    text = generate_latest(registry).decode()
    assert f'command="{run_ids.command_id()}"' in text and 'restart="2"' in text


def _began(run_start: float, started: float) -> str:
    return (
        f'npu_shadow_started_time_seconds{{run="job-1"}} {started}\n'
        f'npu_shadow_run_start_time_seconds{{run="job-1"}} {run_start}\n'
    )


def test_a_metrics_file_of_processes_begun_after_their_run_never_promotes_alone(tmp_path):
    """A pod restarted (no launcher counted it: restart="0") after a rollback, then 10,000 clean clusters: the file
    promoted over the rollback it cannot see. It says when its processes began and when their run did."""
    clean = _exposition({"job-1": (10_000, 0, 10_000)}, [_build(restart="0")])
    later = tmp_path / "later.prom"
    later.write_text(clean + _began(1_796_000_000.0, 1_796_007_200.0))
    decided = _json("--metrics-file", str(later), "--max-rate", "0.001")
    assert decided["decision"] == "inconclusive", decided
    assert "the metrics' processes began 2h after their run did" in decided["targets"][0]["why"]
    first = tmp_path / "first.prom"  # (the run's own first processes, begun with it: the file holds all it counted)
    first.write_text(clean + _began(1_796_000_000.0, 1_796_000_030.0))
    assert _json("--metrics-file", str(first), "--max-rate", "0.001")["decision"] == "promote"


def test_the_exporter_says_when_its_processes_and_their_run_began(monkeypatch):
    """The gauges the one-moment check reads: the launch's start, inherited, and the run's (--run-started, or the
    time a made run id carries; absent for a named run no one dated)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from exporters import PrometheusExporter

    def values(run: str) -> dict[str, float]:
        registry = CollectorRegistry()
        PrometheusExporter(registry=registry, run=run)
        text = generate_latest(registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "start" in s.name}

    monkeypatch.setenv("NPU_SHADOW_STARTED", "1796007200.5")
    monkeypatch.delenv("NPU_SHADOW_RUN_STARTED", raising=False)
    assert values("job-1") == {"npu_shadow_started_time_seconds": 1796007200.5}
    made = values("20261203T073500Z-1a2b3c")
    assert made["npu_shadow_run_start_time_seconds"] == 1796283300.0  # (2026-12-03 07:35:00 UTC)
    monkeypatch.setenv("NPU_SHADOW_RUN_STARTED", "1796000000")
    assert values("job-1")["npu_shadow_run_start_time_seconds"] == 1796000000.0


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["yesterday", "nan", "1e12", "5"])
def test_a_run_start_that_is_not_a_time_fails_at_start_up_naming_the_setting(bad):
    done = npu_shadow("run", "--run-started", bad, "--", sys.executable, "-c", "", timeout=120)
    assert done.returncode == 2 and "--run-started" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_command_id_is_the_same_for_every_rank_and_differs_between_jobs():
    from shadow.core.model.run_ids import command_id, restarts

    rank0 = command_id(["train.py", "--local_rank=0", "--lr", "0.1"])
    assert (
        rank0 == command_id(["train.py", "--local-rank", "3", "--lr", "0.1"]) == command_id(["train.py", "--lr", "0.1"])
    )
    assert command_id(["train.py", "--lr", "0.2"]) != rank0 and command_id(["eval.py", "--lr", "0.1"]) != rank0
    assert restarts({"SLURM_RESTART_COUNT": "3"}) == 3 and restarts({"TORCHELASTIC_RESTART_COUNT": "x"}) == 0


# --------------------------------------------------------------------------- 7: two jobs under one run id


def test_two_jobs_under_one_run_id_are_refused_from_a_metrics_file_never_pooled(tmp_path):
    """Two jobs sharing a run id were pooled: a job diverging at 5% beside a clean one was promoted with it."""
    path = tmp_path / "m.prom"
    path.write_text(_exposition({"job-1": (600_000, 1_500, 6_000)}, [_build("aaaaaaaaaaaa"), _build("bbbbbbbbbbbb")]))
    _source_error(
        verdict_cli("--metrics-file", str(path)), "run job-1 holds evidence of 2 jobs", "give each job its own"
    )


def test_two_jobs_under_one_run_id_are_refused_from_journals(tmp_path):
    records = []
    for pid, command in ((1, "aaaaaaaaaaaa"), (2, "bbbbbbbbbbbb")):
        record = journals.counts({"s": {"match": 100}}, calls={"s": 100}, timestamp=10.0, pid=pid)
        records.append({**record, "run": "job-1", "command": command})
    path = journals.write(tmp_path / "j.jsonl", records)
    _source_error(verdict_cli("--journal", str(path)), "run job-1 holds evidence of 2 jobs")
    one = journals.write(tmp_path / "k.jsonl", [{**r, "command": "aaaaaaaaaaaa"} for r in records])
    assert verdict_cli("--journal", str(one)).returncode != 2  # (one job in two processes: decided)


# --------------------------------------------------------------------------- 2: ranks from every launcher


@pytest.mark.parametrize("variable", ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_ranks_started_by_srun_or_mpirun_are_the_evidence_of_one_rank(tmp_path, monkeypatch, variable):
    """The rank share read only WORLD_SIZE, which srun and mpirun do not set: 8 ranks that saw the same inputs
    counted as 8 independent streams and promoted where torchrun's were inconclusive."""
    from test_thin_evidence import _ranks_in_lockstep

    for source in _ranks_in_lockstep(tmp_path, monkeypatch, 8, variable):
        assert source["compared"] == 1_600 and source["clusters"] == 40  # (eight ranks in lockstep: one rank's)
        assert source["phases"][0]["call_blocks"] == 40  # (their calls' blocks alike: comparing more adds nothing)


def _spawned_rank(rank: int, world_size: int, directory: str) -> None:
    """One rank of a job started by torch.multiprocessing.spawn (no launcher variable): the same 200 inputs as
    every other rank, compared with its process group initialized."""
    import os
    import types

    import torch
    import torch.distributed as dist

    import shadow
    from exporters import JsonlExporter

    for variable in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        os.environ.pop(variable, None)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world_size)
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    target = shadow.Target("op", ops, "op", lambda x: x * 2)
    journal = JsonlExporter(os.path.join(directory, f"rank{rank}.jsonl"))
    with shadow.install([target], sample_rate=1.0, budget=None, seed=rank, exporters=[journal]):
        torch.manual_seed(0)
        for _ in range(200):
            ops.op(torch.randn(4))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_started_by_mp_spawn_count_their_process_groups_share(tmp_path, monkeypatch):
    """torch.multiprocessing.spawn sets no variable: each rank's cluster counts 1 / the process group's size."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("NPU_SHADOW_RUN_ID", "spawned")  # (as `npu-shadow run` gives every process of the job one)
    mp.spawn(_spawned_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    paths = [str(tmp_path / f"rank{rank}.jsonl") for rank in range(2)]
    lines = [line for path in paths for line in pathlib.Path(path).read_text().splitlines()]
    records = [json.loads(line) for line in lines if '"event":"counts"' in line]
    assert records and all(record["clusters"] == 0.5 for record in records)  # (one block each, half a cluster)
    (target,) = _json("--journal", *paths)["targets"]
    assert target["compared"] == 400 and target["clusters"] == 1


# --------------------------------------------------------------------------- 7: the first minutes of a jittering job


def _shadowed_1500_calls(legacy, upstream, aa_rate: float = 0.05):
    """The stats of 1,500 calls of ``legacy`` shadowed by ``upstream``, every one sampled, A/A on a twentieth (the
    launcher's default) unless ``aa_rate`` says otherwise."""
    import types

    import torch

    import shadow

    ops = types.SimpleNamespace(op=legacy)
    target = shadow.Target("op", ops, "op", upstream, signature=lambda a, k: "call")
    with shadow.install([target], sample_rate=1.0, aa_rate=aa_rate, budget=None, seed=4) as monitor:
        for _ in range(1_500):
            ops.op(torch.zeros(64))
    return monitor.stats()["op"]


def _noise(rng, scale: float, varying: bool = False):
    """A function adding normal noise of ``scale`` (times a spread drawn per call where ``varying``)."""
    import numpy as np
    import torch

    def jitter(x):
        spread = float(np.exp(rng.normal(0.0, 1.0))) if varying else 1.0
        return x + scale * spread * torch.as_tensor(rng.standard_normal(tuple(x.shape)), dtype=x.dtype)

    return jitter


def test_an_honest_job_whose_sides_jitter_alike_with_a_varying_spread_lands_beyond_as_often_as_legacy():
    """Legacy and upstream jitter alike, the spread varying from call to call (nondeterministic reductions): once the
    burn-in's A/A runs fixed the thresholds, nearly every call is noise; the few beyond are mismatches (counted,
    never called noise), as rare as legacy's own A/A runs beyond, and the verdict does not roll the job back."""
    import numpy as np

    from shadow.analysis import decisions, evidence, verdict

    jitter = _noise(np.random.default_rng(11), 1e-4, varying=True)
    stats = _shadowed_1500_calls(jitter, jitter, aa_rate=1.0)
    checks = stats.noise_checks
    assert stats.noise > 1_400 and stats.mismatch == checks.get("forward/ab/beyond", 0) <= 15, stats
    aa_beyond = checks.get("forward/aa/beyond", 0)  # (every A/A run after the 200 of the burn-in is judged)
    aa_judged = checks.get("forward/aa/below", 0) + checks.get("forward/aa/within", 0) + aa_beyond
    assert aa_judged == 1_300 and aa_beyond <= 15, checks
    counts = evidence.TargetCounts()
    counts.add_outcome("call", "noise", stats.noise)
    counts.add_outcome("call", "mismatch", stats.mismatch)
    counts.add_reason("value", stats.mismatch)
    for key, value in checks.items():
        counts.add_noise(*key.split("/"), value)
    decided = verdict.decide("op", counts, decisions.DEFAULT_MAX_RATE)
    assert decided.decision != verdict.ROLLBACK and decided.detection_limit > 0, decided.why


def test_a_real_difference_beyond_the_floor_is_still_a_mismatch_within_a_few_calls():
    """The other side of the same rule: upstream 100x legacy's spread (beyond the size the verdict says a wrong call
    must have: 6 x the greatest burn-in A/A error, about 20x a Gaussian's spread over 64 elements) is a mismatch on
    (nearly) every call, those held during the burn-in included."""
    import numpy as np

    rng = np.random.default_rng(12)
    stats = _shadowed_1500_calls(_noise(rng, 1e-4), _noise(rng, 1e-2), aa_rate=1.0)
    assert stats.noise <= 15 and stats.mismatch >= 1_485, stats


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("window", [("--start", None), ("--window", "2h")], ids=["start", "window"])
def test_a_rollback_never_reset_holds_over_any_window_a_reader_picks(tmp_path, window):
    """A run rolled back at its minute 100 (its switch thrown, nobody reset it), clean for ten hours after: read from
    a start after the rollback, or over the last two hours, Prometheus promoted it ([0, 0.00094]); read whole it
    rolled back."""
    from prometheus_server import backfill, prometheus

    history, end = _history(660, 660, 0.0, ended_ago=60)
    start = end - 60 * 660
    common = {"job": "train", "instance": "rank0", "run": "job-1", "target": "op", "source": "http"}
    history["npu_shadow_rollbacks_total"] = [(common, [(start + 60 * m, float(m >= 100)) for m in range(661)])]
    backfill(tmp_path / "data", history)
    flag, value = window
    with prometheus(tmp_path, {}, []) as server:
        whole = _json("--prometheus", server.url, "--run", "job-1", "--recent", "0")
        picked = _json("--prometheus", server.url, "--run", "job-1", "--recent", "0", flag,
                       value or str(start + 60 * 200))  # fmt: skip
    for decided in (whole, picked):
        (target,) = decided["targets"]
        assert decided["decision"] == "rollback" and "rolled back in a running job" in target["why"], target["why"]


@pytest.mark.parametrize(
    "clusters, seconds, words",
    [(500_000, 480 * 60, "more than its comparisons"), (4_800, 480 * 60, "blocks its processes' 28,800 s allow")],
    ids=["fifty-times-the-comparisons", "more-than-a-block-a-minute"],
)
def test_impossible_cluster_counts_are_taken_as_what_the_evidence_can_hold(tmp_path, clusters, seconds, words):
    """A count record with clusters 50 times its comparisons, or 4,800 clusters in 480 process-minutes (more than
    one a 60 s block), promoted; a cluster count is at most the comparisons and the blocks the processes' time holds,
    and the verdict says it capped it."""
    record = journals.counts({"call": {"match": 10_000}}, calls={"call": 10_000}, timestamp=float(seconds))
    record["clusters"], record["process_seconds"] = clusters, float(seconds)
    path = journals.write(tmp_path / "j.jsonl", [record])
    decided = _json("--journal", str(path), "--recent", "0")
    (target,) = decided["targets"]
    assert decided["decision"] != "promote", target["why"]
    assert any(words in note for note in target["notes"]), target["notes"]
    assert target["phases"][0]["clusters"] <= min(10_000, seconds / 60 + 1)


@pytest.mark.parametrize("clusters", [500_000, 4_800], ids=["fifty-times-the-comparisons", "a-block-a-minute"])
def test_a_metrics_file_with_impossible_clusters_is_capped_as_journals_are(clusters):
    """The same counts as a metrics file: one process (``npu_shadow_processes_total``) of 480 minutes."""
    from shadow.analysis import sources, verdict

    labels = 'target="op",primary="legacy",run="r"'
    text = "\n".join([
        f'npu_shadow_calls_total{{{labels},signature="call"}} 10000',
        f'npu_shadow_comparisons_total{{{labels},signature="call",outcome="match"}} 10000',
        f"npu_shadow_clusters_total{{{labels}}} {clusters}",
        'npu_shadow_process_seconds_total{run="r"} 28800',
        'npu_shadow_processes_total{run="r"} 1',
    ]) + "\n"  # fmt: skip
    (decided,) = verdict.decide_all(sources.from_exposition(text), 0.001, {}, 30)
    assert decided.decision != "promote" and decided.phases[0].clusters <= 481, decided.why


@pytest.mark.slow
@pytest.mark.e2e
def test_prometheus_with_impossible_clusters_is_capped_as_journals_are(tmp_path):
    """Ten processes scraped for 11 hours, each counting a cluster a second (60 a minute, 396,000 in all: more than
    the 6,600 blocks their time holds, and each minute's 100 comparisons hold at most 100): from Prometheus, taken
    as the blocks their time allows, as from journals and a metrics file."""
    from prometheus_server import backfill, prometheus

    history, end = _history(660, 660, 0.0, ended_ago=60)
    history["npu_shadow_clusters_total"] = [
        (labels, [(at, value * 60) for at, value in points]) for labels, points in history["npu_shadow_clusters_total"]
    ]
    run = {"job": "train", "run": "job-1"}
    history["npu_shadow_process_seconds_total"] = [
        ({**run, "instance": f"rank{i}"}, [(at, float(m * 60)) for m, (at, _) in enumerate(points)])
        for i, (_, points) in enumerate(history["npu_shadow_calls_total"])
    ]
    history["npu_shadow_processes_total"] = [
        ({**run, "instance": f"rank{i}"}, [(at, 1.0) for at, _ in points])
        for i, (_, points) in enumerate(history["npu_shadow_calls_total"])
    ]
    backfill(tmp_path / "data", history)
    with prometheus(tmp_path, {}, []) as server:
        decided = _json("--prometheus", server.url, "--run", "job-1", "--recent", "0", "--end", str(end))
    (target,) = decided["targets"]
    assert target["phases"][0]["clusters"] <= 6_600 + 10, target["phases"][0]
    assert any("blocks its processes' 396,000 s allow" in note for note in target["notes"]), target["notes"]


# --------------------------------------------------------------------------- 5: called patches without evidence


def test_a_called_patch_no_evidence_speaks_for_is_named_with_what_could_give_it(tmp_path):
    """Journals counted 2,000,000 calls of a patch no target shadows: the verdict promoted the one shadowed target
    and said nothing of the patch. The verdict (text and JSON) and the report name it, with --shadow-patch."""
    from shadow.launcher import cli

    record = journals.counts({"call": {"match": 40_000}}, target="tensor_type", calls={"call": 40_000},
                             timestamp=36_000.0)  # fmt: skip
    record["process_seconds"] = 36_000.0
    called = {"event": "patch_calls", "timestamp": 36_000.0, **journals.process(),
              "calls": {"torch.nn.functional.pad": 2_000_000, "torch.Tensor.type": 40_000}}  # fmt: skip
    path = journals.write(tmp_path / "j.jsonl", [record, called])
    decided = _json("--journal", str(path), "--recent", "0")
    assert [t["target"] for t in decided["targets"]] == ["tensor_type"]
    (silent,) = decided["patches_without_evidence"]  # (torch.Tensor.type: tensor_type compared its calls)
    assert silent["patch"] == "torch.nn.functional.pad" and silent["calls"] == 2_000_000
    assert "--shadow-patch torch.nn.functional.pad" in silent["covered_by"], silent
    text = verdict_cli("--journal", str(path), "--recent", "0").stdout
    assert "patch without evidence: torch.nn.functional.pad: called 2,000,000 times" in text, text
    assert "1 called patches have no evidence here" in text.splitlines()[-1], text
    assert cli.main(["report", "--journal", str(path), "--markdown", str(tmp_path / "r.md")]) in (0, 1, 3)
    markdown = (tmp_path / "r.md").read_text()
    verdict_part = markdown.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert "torch.nn.functional.pad: called 2,000,000 times" in verdict_part, verdict_part


@pytest.mark.slow
def test_what_covers_a_called_patch_is_the_same_first_or_last(tmp_path):
    """The verdict's first patch without evidence, torch.Tensor.type, was said to have no target ("--shadow-patch"):
    its owner was looked up among the modules loaded, and the catalog's owners (torch) were imported only after.
    The most called patch said first and the other after, in a process of its own as a user runs it, each names
    what this process names for it."""
    from shadow.analysis import census

    record = journals.counts({"call": {"match": 40}}, target="data_parallel", calls={"call": 40}, timestamp=36_000.0)
    called = {"event": "patch_calls", "timestamp": 36_000.0, **journals.process(),
              "calls": {"torch.Tensor.type": 2_000_000, "torch.nn.functional.pad": 40_000}}  # fmt: skip
    path = journals.write(tmp_path / "j.jsonl", [record, called])
    done = npu_shadow("verdict", "--journal", str(path), "--format", "json", timeout=120)
    assert done.returncode in (0, 1, 3), done.stderr
    silent = {p["patch"]: p["covered_by"] for p in json.loads(done.stdout)["patches_without_evidence"]}
    assert silent == {name: census.covered_by(name) for name in called["calls"]}
    assert silent["torch.Tensor.type"] == "target tensor_type", silent


@pytest.mark.slow
def test_a_patch_name_from_the_evidence_is_data_never_imported(tmp_path):
    """A name in a journal is looked up among the modules already loaded: naming a module imports nothing."""
    probe = tmp_path / "planted_by_a_journal.py"
    probe.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    called = {"event": "patch_calls", "timestamp": 1.0, **journals.process(),
              "calls": {"planted_by_a_journal.function": 5}}  # fmt: skip
    path = journals.write(tmp_path / "j.jsonl", [journals.counts({"call": {"match": 3}}, calls={"call": 3}), called])
    done = subprocess.run([sys.executable, "-m", "shadow", "verdict", "--journal", str(path), "--format", "json"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})  # fmt: skip
    assert done.returncode in (0, 1, 3), done.stderr
    (silent,) = json.loads(done.stdout)["patches_without_evidence"]
    assert silent["patch"] == "planted_by_a_journal.function" and not (tmp_path / "ran").exists()
