"""Multiprocess mode: metrics of every process of a job arrive, also after children exited."""

import json
import os
import subprocess
import sys

from metrics_helpers import samples, scrape, total

HERE = os.path.dirname(__file__)


def test_parent_forked_and_spawned_children_all_arrive(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    job = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multiproc_job.py")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = job.stdout.readline()
        assert line, job.stderr.read()[-3000:]
        report = json.loads(line)
        parsed = samples(scrape(report["port"]))  # every child has exited by now
    finally:
        if job.poll() is None:
            job.stdin.write("quit\n")
            job.stdin.flush()
        job.wait(60)
    reports = report["reports"]
    assert len(reports) == 5 and len({r["pid"] for r in reports}) == 5
    expected_calls = 10 + 7 + 8 + 11 + 12
    assert sum(r["calls"] for r in reports) == expected_calls
    assert total(parsed, "npu_shadow_calls_total", target="op") == expected_calls
    for outcome in ("match", "mismatch"):
        assert total(parsed, "npu_shadow_comparisons_total", target="op", outcome=outcome) == sum(
            r[outcome] for r in reports
        )
    assert total(parsed, "npu_shadow_mismatches_total", target="op", reason="value") == sum(
        r["mismatch"] for r in reports
    )
    assert job.returncode == 0


def test_a_multiprocess_directory_others_can_write_is_refused_by_the_library(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    script = (
        "from exporters import PrometheusExporter\n"
        "try:\n    PrometheusExporter()\nexcept ValueError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)},
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
    )  # fmt: skip
    assert f"PROMETHEUS_MULTIPROC_DIR='{shared}' is not valid: writable by others" in done.stdout, done.stderr
