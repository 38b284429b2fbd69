"""The README's demo, each variant run as a newcomer runs it (`bash scripts/demo.sh [...]`), showing what the
README says it shows. The outputs and the metrics port are moved (NPU_SHADOW_DEMO_OUT, NPU_SHADOW_DEMO_PORT) so
that the variants can run side by side."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo(tmp_path, *args: str) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "NPU_SHADOW_DEMO_OUT": str(tmp_path), "NPU_SHADOW_DEMO_PORT": str(port)}
    done = subprocess.run(
        ["bash", "scripts/demo.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _readme_excerpt():
    spec = importlib.util.spec_from_file_location("readme_excerpt", os.path.join(ROOT, "scripts", "readme_excerpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job_total(output: str, target: str) -> int:
    job = output.split("npu-shadow job:")[1]
    return int(re.search(rf"^{target}\s+(\d+) calls", job, flags=re.M).group(1))


def _verdict_compared(output: str, target: str) -> int:
    verdict = output.split("== verdict")[1]
    return int(re.search(rf"^{target}\s+\w+\s+(\d+)", verdict, flags=re.M).group(1))


def test_the_demo_trains_shadowed_and_shows_the_summary_the_verdict_and_the_report(tmp_path):
    output = demo(tmp_path)
    assert "== setup:" not in output  # the set-up venv is reused (its stamp), never installed into mid-suite
    assert "npu-shadow legacy: torch_npu 2.12.0 source" in output or "NOT torch_npu's own code" in output
    for target in ("parallel_apply", "data_parallel", "tensor_type"):
        assert re.search(rf"^{target}\s+\d+\s+\d+", output, flags=re.M), target  # the per-target summary
        # the summary's job totals cover the DataLoader workers, as the verdict does
        assert _job_total(output, target) == _verdict_compared(output, target), target
    assert "overall: inconclusive" in output  # 32 steps are too few to promote (the README's excerpt)
    # the README's excerpt is this run's verdict: the same targets, decisions, counts and bounds
    excerpt = _readme_excerpt()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        shown = excerpt.rows(excerpt.readme_excerpt(readme.read()))
    assert shown == excerpt.rows(excerpt.verdict_section(output)), "rerun scripts/readme_excerpt.py on a demo's output"
    assert "(verdict exit code 3" in output
    report = (tmp_path / "npu-shadow-report.md").read_text()
    assert "## Verdict" in report and (tmp_path / "npu-shadow-report.html").exists()
    assert str(tmp_path / "npu-shadow-demo") in report  # the sources it names are kept


def test_the_demo_with_a_fire_drill_ends_in_rollback_and_says_it_is_a_drill(tmp_path):
    """Every target the job called is rehearsed: its drilled comparisons decided at once (none held for a noise
    floor) and rolled back, and the drill names those targets alone. (A call whose result is its own input, such as
    the workers' same-dtype casts, is never drilled.)"""
    output = demo(tmp_path, "--drill", "value:1.0")
    called = set(re.findall(r"^(\w+) +\d+ calls, \d+ compared", output.split("npu-shadow job:")[1], flags=re.M))
    assert {"parallel_apply", "data_parallel", "tensor_type", "module_to", "foreach_devices"} <= called
    rows = _readme_excerpt().rows(_readme_excerpt().verdict_section(output))
    assert {target for target, decision, *_ in rows if decision == "rollback"} == called
    assert all(int(divergent) > 0 for target, _, _, divergent, _ in rows if target in called)
    assert "noise_pending" not in output and "noise floor" not in output
    (named,) = re.findall(r"^FIRE DRILL: .* injected by a fire drill \(([\w, ]+)\)", output, flags=re.M)
    assert set(named.split(", ")) == called
    assert "overall: rollback" in output and "(verdict exit code 1" in output


def test_the_canary_drill_rolls_back_the_running_job(tmp_path):
    output = demo(tmp_path, "--canary-drill")
    assert "watcher: hard mismatch" in output and "rollback switch thrown" in output
    rolled = re.findall(r"^\S+ (\w+) rolled back to legacy by file:demo watcher", output, flags=re.M)
    assert {"parallel_apply", "data_parallel", "tensor_type"} <= set(rolled), output[-3000:]  # (and 2.12's others)
    # upstream's result returned until the switch (the divergence that threw it was seen so), legacy's after it
    upstream = re.findall(r"^(\w+)\s+\d+ comparisons with upstream's result returned", output, flags=re.M)
    legacy = re.findall(r"^(\w+)\s+\d+ comparisons with legacy's result returned", output, flags=re.M)
    assert upstream and {"parallel_apply", "data_parallel", "tensor_type"} <= set(legacy), output[-3000:]
    assert "watcher: no hard mismatch before the deadline" not in output
    assert "until a scrape reads them" not in output  # (it waited 75 s for a scrape after the watcher had stopped)
