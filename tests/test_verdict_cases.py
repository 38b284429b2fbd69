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
