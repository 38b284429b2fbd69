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
