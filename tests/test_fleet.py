"""The fleet: a job's series within its budget at the launcher's defaults (docs/fleet.md), and the fleet-wide store
(VictoriaMetrics fed by Prometheus' remote_write) deciding as the Prometheus that fed it."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from torch_npu_wheels import wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The most series one job may export at the launcher's defaults (docs/fleet.md: the series budget).
SERIES_BUDGET = 250


def series_of(text: str) -> collections.Counter:
    """The series of an exposition, counted by sample name (a histogram's every bucket, sum and count is one)."""
    found: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] += 1
    return found


@pytest.mark.slow
def test_the_example_job_exports_at_most_its_series_budget_at_the_launchers_defaults(tmp_path):
    """The example on 2 emulated npus, legacy from torch_npu 2.14.0, one epoch, at the launcher's defaults: 778 series
    when every series was created at zero for every label value it could take; at most 250 now, with every target's
    calls and the comparisons it made there."""
    textfile = tmp_path / "metrics.prom"
    done = subprocess.run(
        [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", wheel("2.14.0"),
         "--textfile", str(textfile), "--linger", "0", "--",
         sys.executable, "examples/train_dataparallel.py", "--epochs", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = series_of(textfile.read_text())
    assert sum(found.values()) <= SERIES_BUDGET, found.most_common()
    targets = {
        s.labels["target"]
        for f in text_string_to_metric_families(textfile.read_text())
        for s in f.samples
        if s.name == "npu_shadow_calls_total"
    }
    compared = {
        s.labels["target"]
        for f in text_string_to_metric_families(textfile.read_text())
        for s in f.samples
        if s.name == "npu_shadow_comparisons_total" and s.value > 0
    }
    assert len(targets) >= 10 and {"tensor_type", "data_parallel", "parallel_apply"} <= compared
    # (nothing it did not do: no mismatch, skip, rollback or shared divergence series for a job that had none)
    assert not {"npu_shadow_mismatches_total", "npu_shadow_rollbacks_total", "npu_shadow_resets_total"} & set(found)
