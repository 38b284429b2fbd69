"""What a newcomer reads in the first hour (issue 56's smaller findings): tables whose columns stay apart, lines that
say what happened, and nothing printed that is not the tool's to say."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from commands import npu_shadow
from test_verdict import run_verdict

from shadow.core.model.observation import TargetStats
from shadow.launcher.launch import summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_longest_target_name_keeps_its_column_apart(tmp_path) -> None:
    """``storage_deepcopynot exercised`` and ``storage_deepcopyinconclusive``: a 16-character name filled its column."""
    said = summary({"storage_deepcopy": TargetStats(), "tensor_type": TargetStats(calls=3, sampled=3, match=3)})
    assert "storage_deepcopy not exercised" in said
    header, row = [line for line in said.splitlines() if line.startswith(("npu-shadow  ", "tensor_type"))]
    assert header.index("calls") + len("calls") == re.search(r"\d+", row).end()  # numbers under their heading
    scrape = tmp_path / "scrape.prom"
    scrape.write_text(
        'npu_shadow_comparisons_total{target="storage_deepcopy",outcome="match",signature="s",primary="legacy"} 4\n'
    )
    table = run_verdict("--metrics-file", str(scrape)).stdout
    assert re.search(r"^storage_deepcopy +inconclusive +4 +0", table, flags=re.M), table


WARNING_JOB = """
import warnings
import torch
from torch import nn


class Warns(nn.Linear):
    def forward(self, x):
        warnings.warn("the job's own warning, shown once")
        return super().forward(x)


model = nn.DataParallel(Warns(4, 2).to("npu:0"), device_ids=[0, 1])
for _ in range(12):
    model(torch.randn(8, 4, device="npu:0")).sum().backward()
"""


@pytest.mark.slow
def test_the_jobs_warnings_are_shown_once_as_unwrapped(tmp_path) -> None:
    """A DataParallel job showed torch's "not compiled with NCCL support" 7 times where unwrapped it showed it once:
    the shadow side's first backward comparison imported sympy (``torch.autograd.grad`` given cotangent tensors
    does), the import added warning filters, and a change of the filters forgets which warnings were shown."""
    job = tmp_path / "job.py"
    job.write_text(WARNING_JOB)
    every_run = [
        "--budget",
        "off",
        "--sample-rate",
        "1",
        "--backward-rate",
        "1",
        "--aa-rate",
        "1",
        "--truth-rate",
        "1",
        "--oracle",
        "1",
    ]
    unwrapped = f"from shadow.npu import emulated; emulated.install(2); exec(open({str(job)!r}).read())"
    plain = subprocess.run(
        [sys.executable, "-c", unwrapped],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    shadowed = npu_shadow(
        "run",
        "--emulate-npu",
        "2",
        "--legacy-from",
        "reference",
        *every_run,
        "--",
        sys.executable,
        str(job),
        timeout=300,
    )
    assert plain.returncode == shadowed.returncode == 0, shadowed.stderr[-2000:]
    assert re.search(r"^parallel_apply +12 +12 +12 ", shadowed.stderr, flags=re.M), shadowed.stderr[-2000:]
    shown = "UserWarning: the job's own warning"
    assert plain.stderr.count(shown) == 1
    assert shadowed.stderr.count(shown) == 1, shadowed.stderr[-2000:]


@pytest.mark.slow
def test_the_examples_progress_ends_its_line_before_each_epoch_and_a_small_loss_keeps_its_digits() -> None:
    """The demo printed ``... 16/32 loss 0.0000 2.9sepoch 0: mean loss 0.639038`` and a loss of 0.0000 from step 6."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_dataparallel.py"), "--emulate-npu", "2", "--workers",
         "0", "--samples", "256"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    lines = re.split(r"[\r\n]", done.stdout)
    assert [line for line in lines if "epoch" in line] == [line for line in lines if line.startswith("epoch ")]
    assert len([line for line in lines if line.startswith("epoch ")]) == 2
    losses = re.findall(r"\] \d+/\d+ loss (\S+) ", done.stdout)
    assert losses and all(float(loss) > 0 for loss in losses), losses


def test_a_rollback_says_so_once_for_the_process_naming_its_targets(caplog) -> None:
    """The canary demo printed 24 "rolled back" lines: one per target in each of its processes."""
    import types

    import torch

    import shadow
    from shadow.core.model.targets import Target

    ops = types.SimpleNamespace(**{name: (lambda x: x * 2) for name in ("a", "b", "c")})
    targets = [Target(n, ops, n, lambda x: x * 3, isolate=False, signature=lambda a, k: "call") for n in "abc"]
    with shadow.install(targets, sample_rate=1.0, primary="upstream") as monitor, caplog.at_level("WARNING", "shadow"):
        ops.a(torch.ones(1))
        assert monitor.roll_back("api:test") == ["a", "b", "c"]
    said = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert said == ["npu-shadow: rolled back to legacy by api:test: a, b, c"]


def test_the_reports_rate_chart_is_labelled_in_utc_not_on_the_processes_own_clock(tmp_path) -> None:
    """The chart's axis said "time (UTC)" and showed the monotonic clock: 01:11 for a run at 15:10 UTC."""
    import json
    import time

    import journals

    from shadow.launcher import cli

    start = 1_700_000_000.0 - 1_700_000_000.0 % 3600 + 10 * 60  # (22:10 UTC)
    records = []
    for minute in range(1, 4):
        record = journals.counts({"call": {"match": 10 * minute}}, timestamp=start + 60 * minute)
        record["mono"] = 4260.0 + 60 * minute  # (the process's own clock: 01:11 when read as a time)
        records.append(record)
    path = journals.write(tmp_path / "j.jsonl", records)
    page = tmp_path / "r.html"
    assert cli.main(["report", "--journal", str(path), "--markdown", str(tmp_path / "r.md"), "--html", str(page)]) == 0
    chart = page.read_text().split('aria-label="Divergence rate over time"')[1].split("</svg>")[0]
    labels = re.findall(r">(\d\d:\d\d)</text>", chart)
    assert labels == ["22:11", "22:14"] == [time.strftime("%H:%M", time.gmtime(start + s)) for s in (60, 240)], (
        labels,
        json.dumps(records[0]),
    )


@pytest.mark.slow
@pytest.mark.e2e
def test_a_report_from_prometheus_names_what_the_run_ran(tmp_path) -> None:
    """A report read from Prometheus said "npu-shadow: not recorded" (and torch, torch_npu and the run too): the
    processes' build info is in Prometheus as it is in a metrics file."""
    import time

    from prometheus_server import backfill, prometheus

    from shadow.launcher import cli

    end = (time.time() // 60 - 60) * 60
    common = {"job": "train", "instance": "rank0", "run": "job-7"}
    points = [(end - 60 * i, 1.0) for i in range(5, -1, -1)]
    backfill(
        tmp_path / "data",
        {
            "npu_shadow_build_info": [
                ({**common, "version": "0.1.0", "torch": "2.13.0+cpu", "torch_npu": "none", "command": "c1"}, points)
            ],
            "npu_shadow_calls_total": [({**common, "target": "op", "primary": "legacy", "signature": "s"}, points)],
            "npu_shadow_comparisons_total": [
                ({**common, "target": "op", "primary": "legacy", "signature": "s", "outcome": "match"}, points)
            ],
        },
    )
    with prometheus(tmp_path, {}, []) as server:
        markdown = tmp_path / "r.md"
        args = ["report", "--prometheus", server.url, "--end", str(end), "--markdown", str(markdown)]
        assert cli.main(args) == 0
    environment = markdown.read_text().split("## Environment")[1].split("## ")[0]
    for row in ("| run | job-7 |", "| npu-shadow | 0.1.0 |", "| torch | 2.13.0+cpu |", "| torch_npu | none |"):
        assert row in environment, environment


@pytest.mark.slow
def test_a_launcher_started_ignoring_sigint_ignores_it_as_its_job_does(tmp_path) -> None:
    """A job started with ``&`` in a script ignores SIGINT: a SIGINT to the launcher left the job running to exit 0,
    and the launcher said "stopped by a signal" and kept no endpoint after it."""
    import signal
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = "import time; print('ready', flush=True); time.sleep(3)"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shadow", "run", "--port", str(port), "--linger", "1", "--", sys.executable, "-c", job],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # (as `&` in a script starts it)
    )  # fmt: skip
    try:
        assert launcher.stdout.readline().strip() == "ready"
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    said = launcher.stderr.read()
    assert "stopped by a signal" not in said and "until a scrape reads them" in said, said


def test_the_verdict_and_the_report_say_the_dataloaders_canary_ab_runs_only_in_a_canary(tmp_path) -> None:
    """Under the defaults nothing said that the DataLoader's canary A/B runs only with --primary upstream."""
    from shadow.launcher import cli

    scrape = tmp_path / "scrape.prom"
    scrape.write_text(
        'npu_shadow_comparisons_total{target="tensor_type",outcome="match",signature="s",primary="legacy"} 4\n'
    )
    said = run_verdict("--metrics-file", str(scrape)).stdout
    assert re.search(r"^dataloader_init +canary A/B +not in these sources: it runs only in a canary \(npu-shadow run "
                     r"--primary upstream\)", said, flags=re.M), said  # fmt: skip
    markdown = tmp_path / "r.md"
    assert cli.main(["report", "--metrics-file", str(scrape), "--markdown", str(markdown)]) == 0
    canary = markdown.read_text().split("## Canary A/B")[1]
    assert "| dataloader_init | not in these sources: it runs only in a canary" in canary
