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
