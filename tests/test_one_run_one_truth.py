"""One run, one truth: the counts a scrape sees are the job's, as they happen and at its end."""

import os
import subprocess
import sys
import time
import types

from metrics_helpers import samples, total
from prometheus_client import CollectorRegistry
from prometheus_server import free_port, prometheus

import shadow
from exporters import PrometheusExporter
from shadow import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _calls_exposed(registry, target):
    return registry.get_sample_value("npu_shadow_calls_total", {"target": target, "signature": "", "primary": "legacy"})


def wait_for(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def test_1_calls_between_sampled_calls_reach_the_exposition_within_a_second():
    """Calls reached the exposition only with a published comparison: a job of unsampled calls showed none."""
    owner = types.SimpleNamespace(op=lambda x: x)
    registry = CollectorRegistry()
    with shadow.install(
        [Target("op", owner, "op", lambda x: x)], sample_rate=0.0, exporters=[PrometheusExporter(registry=registry)]
    ):
        for i in range(250):
            owner.op(i)
        wait_for(lambda: _calls_exposed(registry, "op") == 250, "250 calls on the exposition")
        owner.op(0)
        wait_for(lambda: _calls_exposed(registry, "op") == 251, "the next call too")


def test_1_a_real_prometheus_sees_every_call_of_a_running_job_and_its_final_counts_after_it(tmp_path):
    """Under the launcher's defaults the last scrape held 30 of 40 calls of a target: calls reached the exposition
    only with a comparison, and the counts at exit were never scraped."""
    port = free_port()
    ready, stop, textfile = tmp_path / "ready", tmp_path / "stop", tmp_path / "final.prom"
    with prometheus(tmp_path, {"job": port}, []) as server:
        job = subprocess.Popen(
            [
                sys.executable, "-m", "shadow", "run", "--legacy-from", "reference", "--port", str(port),
                "--textfile", str(textfile), "--linger", "60", "--",
                sys.executable, os.path.join(ROOT, "tests", "counting_job.py"), "--calls", "3000", "--more", "700",
                "--ready", str(ready), "--stop", str(stop),
            ],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_for(ready.exists, "the job's first calls", timeout=120)
            calls = 'sum(npu_shadow_calls_total{target="tensor_type"})'
            server.wait_for(lambda: server.query(calls) == {(): 3000.0}, "3000 calls while the job runs", timeout=30)
            stop.write_text("stop")
            _, err = job.communicate(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode == 0, err[-3000:]
        assert "final counts were scraped" in err, err[-3000:]
        final = total(samples(textfile.read_text()), "npu_shadow_calls_total", target="tensor_type")
        assert final == 3700
        last = server.query('sum(last_over_time(npu_shadow_calls_total{target="tensor_type"}[5m]))')
        assert last == {(): 3700.0}  # the exit's counts, scraped after the job ended
