"""A job stopped by a signal under `npu-shadow run`: the shell's exit code, and its evidence kept."""

import os
import signal
import subprocess
import sys

import pytest
from metrics_helpers import samples, total

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = "import os, time, torch\ntorch.ones(2).type(torch.float64)\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n"


def start(tmp_path):
    return subprocess.Popen(
        [sys.executable, "-m", "shadow", "run", "--targets", "tensor_type", "--sample-rate", "1", "--budget", "off",
         "--textfile", str(tmp_path / "metrics.prom"), "--", sys.executable, "-c", JOB],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests", "fake_torch_npu")),
        preexec_fn=_default_sigint,
    )  # fmt: skip


def _default_sigint():
    """A process started in the background by a non-interactive shell ignores SIGINT, and so would the launcher
    and the job it starts (as under a shell): give the launcher the default disposition a terminal gives."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_forwarded_signal_exits_as_a_shell_would_after_the_job_flushed(tmp_path, sig, code):
    launcher = start(tmp_path)
    try:
        int(launcher.stdout.readline())  # the job is up and has made its call
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == code, err
    assert "tensor_type" in err and "calls" in err  # the summary was printed
    parsed = samples((tmp_path / "metrics.prom").read_text())
    assert total(parsed, "npu_shadow_calls_total", target="tensor_type") >= 1


def test_a_job_killed_outright_exits_137(tmp_path):
    launcher = start(tmp_path)
    try:
        os.kill(int(launcher.stdout.readline()), signal.SIGKILL)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 137
