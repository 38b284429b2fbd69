import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_core_benchmark_runs_and_reports_both_ratios():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_core.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "shadow wrapper / bare wrapper = " in done.stdout
    assert "compare_seconds / assert_close = " in done.stdout
    assert "outcome close" in done.stdout  # the pair is within tolerance but not bitwise equal
