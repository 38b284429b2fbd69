"""The canary A/B of the DataLoader's iterator (shadow.core.calls.canary.arms) and what the verdict makes of it
(shadow.analysis.arms): the arms, the measurements, the statistics against an independent computation, and the
whole path under the launcher with torch_npu 2.13.0's own legacy."""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import pytest
import torch
from commands import npu_shadow, npu_shadow_here
from scipy.stats import mannwhitneyu
from torch.utils.data import DataLoader, TensorDataset
from torch_npu_wheels import wheel

from shadow.analysis import arms as analysis
from shadow.core.calls.canary import arms as core_arms
from shadow.core.calls.canary.arms import ArmRun, IteratorArms
from shadow.core.calls.record.record import Publisher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- the statistic


@pytest.mark.parametrize("seed", range(5))
def test_the_interval_is_the_set_of_shifts_the_mann_whitney_test_does_not_reject(seed: int) -> None:
    """An independent computation: scipy's two-sided Mann-Whitney test (normal approximation, no continuity
    correction) of upstream - delta against legacy rejects at 5% just outside the interval, and not just inside."""
    rng = random.Random(seed)
    upstream = [rng.gauss(0.3, 1) for _ in range(rng.randint(6, 30))]
    legacy = [rng.gauss(0.0, 1) for _ in range(rng.randint(6, 30))]
    estimate, lower, upper = analysis.hodges_lehmann(upstream, legacy)
    differences = sorted(u - v for u in upstream for v in legacy)
    assert lower < estimate < upper

    def p(delta: float) -> float:
        shifted = [u - delta for u in upstream]
        return mannwhitneyu(shifted, legacy, alternative="two-sided", method="asymptotic", use_continuity=False).pvalue

    below = max(d for d in differences if d < lower)
    above = min(d for d in differences if d > upper)
    assert p((below + lower) / 2) < 0.05 and p((upper + above) / 2) < 0.05  # (outside: rejected)
    inside_low = min(d for d in differences if d > lower)
    inside_high = max(d for d in differences if d < upper)
    assert p((lower + inside_low) / 2) > 0.05 and p((inside_high + upper) / 2) > 0.05  # (inside: not rejected)


def test_a_ratio_is_the_shift_of_the_logarithms_and_too_few_values_have_no_interval() -> None:
    found = analysis.ratio([2.0, 2.2, 1.8, 2.1, 1.9, 2.0, 2.05], [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02])
    assert found is not None and 1.8 < found.estimate < 2.2 and found.differs
    few = analysis.ratio([2.0], [1.0])
    assert few is not None and few.lower is None and not few.differs and few.describe() == "2.00x"
    assert analysis.ratio([], [1.0]) is None


def _record(arm: str, workers: list, after: list, seed: int = 7, digest: str = "d", per_second: float = 100.0) -> dict:
    return {
        "target": "dataloader_init", "arm": arm, "worker_cores": workers, "caller_cores_before": [0, 1],
        "caller_cores_after": after, "process_cores": [0, 1], "first_batch_seconds": 0.1,
        "batches_per_second": per_second, "base_seed": seed, "first_batch_digest": digest, "raised": "",
    }  # fmt: skip


def test_the_summary_says_what_each_arm_does_to_affinity_and_batches() -> None:
    records = [
        _record("legacy", [[0], [0]], [0]),
        _record("upstream", [[0, 1], [0, 1]], [0, 1]),
        _record("legacy", [[0]], [0], seed=8, digest="a"),
        _record("upstream", [[0, 1]], [0, 1], seed=8, digest="b"),
    ]
    (summary,) = analysis.summarize(records)
    assert summary.iterators == {"legacy": 2, "upstream": 2}
    assert summary.affinity.startswith("differs: legacy's workers run on cores 0, upstream's on 0-1 (of 0-1)")
    assert "legacy leaves the caller's thread on cores 0" in summary.affinity
    assert summary.seeds_differ == (8,) and summary.seeds_equal == 1
    assert "batches DIFFER for seeds 8" in summary.line()
    same = analysis.summarize([_record("legacy", [[0, 1]], [0, 1]), _record("upstream", [[0, 1]], [0, 1])])
    assert same[0].affinity == "same" and "batches equal for 1 seed(s)" in same[0].line()


# --------------------------------------------------------------------------- the arms, in this process


class _Keep:
    def __init__(self) -> None:
        self.runs: list[Any] = []

    def export(self, record: Any) -> None:
        if isinstance(record, ArmRun):
            self.runs.append(record)


def _arms(keep: _Keep, seed: int = 5) -> tuple[IteratorArms, list[str]]:
    from torch.utils.data import dataloader

    upstream = dataloader._MultiProcessingDataLoaderIter.__init__
    built: list[str] = []

    def legacy(iterator: Any, *args: Any, **kwargs: Any) -> None:
        built.append("legacy")
        upstream(iterator, *args, **kwargs)

    def counted_upstream(iterator: Any, *args: Any, **kwargs: Any) -> None:
        built.append("upstream")
        upstream(iterator, *args, **kwargs)

    trial = IteratorArms(legacy, counted_upstream, Publisher([keep]), seed)
    trial.install()
    return trial, built


def test_each_iterator_is_built_by_one_arm_in_seeded_blocks_and_measured() -> None:
    keep = _Keep()
    trial, built = _arms(keep)
    data = TensorDataset(torch.arange(16.0))
    try:
        for _ in range(4):
            batches = [b[0].tolist() for b in DataLoader(data, batch_size=4, num_workers=1)]
            assert batches[0] == [0.0, 1.0, 2.0, 3.0] and len(batches) == 4  # (the job's batches, as ever)
    finally:
        trial.uninstall()
    assert sorted(built[:2]) == sorted(built[2:]) == ["legacy", "upstream"]  # (one of each in every block)
    again, built_again = _arms(_Keep())
    try:
        for _ in range(4):
            list(DataLoader(data, batch_size=4, num_workers=1))
    finally:
        again.uninstall()
    assert built_again == built  # (the order comes from the seed)
    assert [r.arm for r in keep.runs] == built
    run = keep.runs[0]
    assert run.batches == 4 and run.first_batch_seconds > 0 and run.batches_per_second > 0
    assert len(run.worker_cores) == 1 and run.worker_cores[0] and run.first_batch_digest and not run.raised


def test_after_a_rollback_every_iterator_is_legacys_and_uninstall_puts_torch_back() -> None:
    from torch.utils.data import dataloader

    before = (dataloader._MultiProcessingDataLoaderIter.__init__, dataloader._MultiProcessingDataLoaderIter.__next__)
    keep = _Keep()
    trial, built = _arms(keep)
    try:
        assert trial.roll_back("test") and not trial.roll_back("again")
        for _ in range(3):
            list(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2, num_workers=1))
    finally:
        trial.uninstall()
    assert built == ["legacy"] * 3
    after = (dataloader._MultiProcessingDataLoaderIter.__init__, dataloader._MultiProcessingDataLoaderIter.__next__)
    assert after == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the half-built iterator's __del__)
def test_an_arm_that_raises_raises_to_the_caller_and_is_recorded() -> None:
    keep = _Keep()

    def failing(iterator: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no workers today")

    trial = IteratorArms(failing, failing, Publisher([keep]), seed=1)
    trial.install()
    try:
        with pytest.raises(RuntimeError, match="no workers today"):
            iter(DataLoader(TensorDataset(torch.arange(4.0)), num_workers=1))
    finally:
        trial.uninstall()
    assert keep.runs[0].raised == "RuntimeError: no workers today"


# --------------------------------------------------------------------------- under the launcher

_DATALOADER_JOB = """
import torch
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.arange(64.0).reshape(32, 2))
total = 0.0
for epoch in range(6):
    loader = DataLoader(data, batch_size=4, num_workers=2, shuffle=True,
                        generator=torch.Generator().manual_seed(epoch // 2))
    total += sum(float(batch[0].sum()) for batch in loader)
print("total", total)
"""


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="torch_npu binds to a device's share of 2+ cores")
def test_a_dataloader_canary_runs_both_arms_and_the_verdict_reports_legacys_affinity(tmp_path) -> None:
    journal = tmp_path / "j.jsonl"
    first, second = sorted(os.sched_getaffinity(0))[:2]  # (device ranges within the cores this test may use)
    env = {**os.environ, "CPU_AFFINITY_CONF": f"1,npu0:{first}-{first},npu1:{second}-{second}"}
    done = npu_shadow(
        "run",
        "--emulate-npu",
        "2",
        "--legacy-from",
        wheel("2.13.0"),
        "--primary",
        "upstream",
        "--rollback-file",
        str(tmp_path / "switch"),
        "--journal",
        str(journal),
        "--textfile",
        str(tmp_path / "metrics.prom"),
        "--",
        sys.executable,
        "-W",
        "ignore",
        "-c",
        _DATALOADER_JOB,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and "total 12096.0" in done.stdout, done.stderr[-3000:]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    arms = [r for r in records if r.get("event") == "arm"]
    assert sorted(r["arm"] for r in arms) == ["legacy"] * 3 + ["upstream"] * 3
    assert all(r["workers_bound"] for r in arms if r["arm"] == "legacy")
    assert not any(r["workers_bound"] for r in arms if r["arm"] == "upstream")
    verdict = npu_shadow_here("verdict", "--journal", str(journal))
    line = next(line for line in verdict.stdout.splitlines() if line.startswith("dataloader_init"))
    assert "canary A/B" in line and "affinity differs: legacy's workers run on cores" in line, verdict.stdout
    assert "throughput" in line and "batches equal for 3 seed(s)" in line
    from_metrics = npu_shadow_here("verdict", "--metrics-file", str(tmp_path / "metrics.prom"))
    line = next(line for line in from_metrics.stdout.splitlines() if line.startswith("dataloader_init"))
    assert (
        "affinity differs: workers bound to fewer cores than the process had in 3 of 3 legacy iterators, 0 of 3 "
        in (line)
    ), from_metrics.stdout
    assert "first batch" in line and "(legacy 3, upstream 3 iterators)" in line


def test_a_failure_measuring_an_iterator_is_counted_and_never_the_jobs(monkeypatch) -> None:
    from shadow.core.calls.canary import arms as core_arms

    def broken(pid: int = 0) -> tuple:
        raise OSError("no affinity here")

    keep = _Keep()
    trial, built = _arms(keep)
    monkeypatch.setattr(core_arms, "_cores", broken)
    monkeypatch.setattr(core_arms, "_digest", lambda batch: 1 / 0)
    try:
        batches = [b[0].tolist() for b in DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2, num_workers=1)]
    finally:
        trial.uninstall()
    assert batches == [[0.0, 1.0], [2.0, 3.0]] and built  # (the job's iterator, built and read as ever)
    assert trial.failures >= 2 and keep.runs == []


class _Loud:
    """A batch leaf whose repr is the job's code."""

    reprs = 0

    def __repr__(self) -> str:
        _Loud.reprs += 1
        return "loud"


def test_the_first_batchs_digest_reads_no_repr_and_copies_only_what_fits(monkeypatch) -> None:
    from shadow.core.support import memory

    strided = torch.arange(4 << 20, dtype=torch.float32).reshape(2048, 2048).t()  # (16 MiB, not contiguous)
    batch = {"x": strided, "meta": _Loud(), "step": 3}
    digest = core_arms._digest(batch)
    assert _Loud.reprs == 0 and len(digest) == 16
    assert digest == core_arms._digest({"x": strided.contiguous(), "meta": _Loud(), "step": 3})
    assert digest != core_arms._digest({"x": strided.contiguous(), "meta": _Loud(), "step": 4})
    monkeypatch.setattr(memory, "host_free_bytes", lambda: 8 << 20)  # (a 16 MiB copy would not fit)
    assert core_arms._digest(batch) == ""
    assert core_arms._digest({"x": strided.contiguous(), "step": 3}) != ""  # (read in place: no copy needed)
    labels = {"label": torch.tensor(3), "flag": torch.tensor(True), "half": torch.ones(2, dtype=torch.bfloat16)}
    assert len(core_arms._digest(labels)) == 16  # (0-d tensors and two-byte types read too)
