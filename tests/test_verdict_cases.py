"""The verdict in the cases a team meets: an ended run read later, ranks from every launcher, a burst younger than
an hour, a restart after a rollback, a drill beside a real incident, the ETA, two jobs under one run id, the first
minutes of a jittering job, and count records that cannot be."""

from __future__ import annotations

import json

import journals
import pytest
from test_thin_evidence import verdict_cli


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
        (recent,) = target["slices"]
        assert recent["name"] == "the last 1h" and recent["decision"] == "rollback"
        assert (recent["compared"], recent["divergent"]) == (60_000, 3_000)
        assert each["decision"] == "rollback"
