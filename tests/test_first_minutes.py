"""The first minutes: a command line that behaves like the tools users know."""

import json
import os
import subprocess
import sys

import pytest
from commands import npu_shadow

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_misspelt_option_is_answered_with_the_one_meant_and_the_commands_usage():
    """`npu-shadow run --sampel-rate 0.1 -- job` said "unrecognized arguments" with the top-level usage."""
    done = npu_shadow("run", "--sampel-rate", "0.1", "--", "true")
    assert done.returncode == 2
    assert "npu-shadow run: error: unrecognized argument --sampel-rate; did you mean --sample-rate?" in done.stderr
    assert done.stderr.startswith("usage: npu-shadow run ")
    done = npu_shadow("verdict", "--journal", "j.jsonl", "--max-reta=0.01")
    assert done.returncode == 2 and "did you mean --max-rate?" in done.stderr


def test_a_misspelt_variable_fails_at_start_up_naming_the_one_meant():
    """A misspelt NPU_SHADOW_SAMPEL_RATE was silently ignored: the job ran on defaults the user thought changed."""
    misspelt = {**os.environ, "NPU_SHADOW_SAMPEL_RATE": "0.1"}
    done = npu_shadow("run", "--", sys.executable, "-c", "print('ran')", env=misspelt)
    assert done.returncode == 2 and "ran" not in done.stdout
    assert "NPU_SHADOW_SAMPEL_RATE is not a setting of npu-shadow; did you mean NPU_SHADOW_SAMPLE_RATE?" in done.stderr
    from shadow.launcher import config

    assert config.misspelt_variables({"NPU_SHADOW_JOB": "x", "NPU_SHADOW_SAMPLE_RATE": "1", "NPU_SHADOW_ZZZ": ""}) == []


def test_a_window_that_is_no_prometheus_duration_is_refused_saying_what_one_is():
    """`--window 6hours` just said "HTTP 400"."""
    done = npu_shadow("verdict", "--prometheus", "http://127.0.0.1:9", "--window", "6hours")
    assert done.returncode == 2
    assert "'6hours' is not a Prometheus duration (e.g. 30m, 6h, 1h30m, 7d)" in done.stderr
    assert (
        npu_shadow("verdict", "--prometheus", "http://127.0.0.1:9", "--window", "1h30m").stderr.count(
            "not a Prometheus duration"
        )
        == 0
    )


def test_doctor_on_a_host_without_torch_npu_names_the_emulated_npu_and_the_cached_wheel(tmp_path):
    """`doctor` on a host without torch_npu suggested neither --emulate-npu nor the cached wheel."""
    empty = npu_shadow("doctor", "--port", "0", env={**os.environ, "NPU_SHADOW_WHEEL_DIR": str(tmp_path)})
    assert "npu-shadow run --emulate-npu 2" in empty.stdout + empty.stderr
    assert "scripts/fetch_torch_npu.sh 2.12.0" in empty.stdout + empty.stderr
    (tmp_path / "torch_npu-2.12.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    cached = npu_shadow("doctor", "--port", "0", env={**os.environ, "NPU_SHADOW_WHEEL_DIR": str(tmp_path)})
    assert f"--legacy-from {tmp_path}/torch_npu-2.12.0-" in cached.stdout + cached.stderr


def test_setup_on_a_set_up_clone_does_nothing_twice():
    """A second scripts/setup.sh on a set-up clone took 14 s: a silent `pip install -e` on every run."""
    import glob

    setup = [os.environ.get("BASH", "bash"), os.path.join(ROOT, "scripts", "setup.sh")]
    first = subprocess.run(setup, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    (installed,) = glob.glob(os.path.join(ROOT, ".venv", "lib", "python*", "site-packages", "npu_shadow-*.dist-info"))
    before = os.stat(installed).st_mtime_ns
    again = subprocess.run(setup, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout == again.stderr == ""  # (every step's result already there)
    assert os.stat(installed).st_mtime_ns == before  # (not installed again)


def test_the_emulated_npus_build_says_it_is_still_going(tmp_path, monkeypatch, capsys):
    """The emulated npu's build was silent for minutes (199 s with no progress)."""
    from shadow.npu import emulated

    monkeypatch.setattr(emulated, "_COMPILE", "import time; time.sleep(1.0)")
    monkeypatch.setattr(emulated, "PROGRESS_SECONDS", 0.2)
    emulated._compile(tmp_path)
    lines = [line for line in capsys.readouterr().err.splitlines() if "still building the emulated npu" in line]
    assert len(lines) >= 2
    monkeypatch.setattr(emulated, "_COMPILE", "import sys; print('the compiler said no'); sys.exit(1)")
    with pytest.raises(emulated.EmulatorUnavailable, match="the compiler said no"):
        emulated._compile(tmp_path)


START_WITHOUT_TORCH = r"""
import contextlib, io, json, sys
from shadow.launcher import cli

out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "printed": bool(out.getvalue())}))
"""


@pytest.mark.parametrize("command", ["verdict", "report"])
def test_verdict_and_report_never_load_torch(tmp_path, command):
    """They read files and a Prometheus: torch (a second and a half to import) held their first line back."""
    import journals

    path = journals.write(tmp_path / "j.jsonl", [journals.counts({"s": {"match": 5}}, calls={"s": 5}, timestamp=1.0)])
    done = subprocess.run(
        [sys.executable, "-c", START_WITHOUT_TORCH, command, "--journal", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["printed"] and said["code"] in (0, 1, 3) and said["torch"] is False


def test_doctor_says_it_loads_torch_before_it_does():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from shadow.launcher import cli; sys.exit(cli.main(['doctor']))"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.stderr.splitlines()[0] == "npu-shadow doctor: loading torch to check it..."


def test_the_demos_set_up_finds_the_cached_wheel_without_importing_torch(tmp_path):
    """The warm demo's first 18 s printed nothing: its set-up imported torch twice only to find a cached file."""
    from shadow.npu import wheels

    if wheels.cached_wheel("2.12.0") is None:
        pytest.skip("no cached torch_npu 2.12.0 wheel")
    blocked = tmp_path / "torch"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('the set-up scripts must not import torch')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    for script in ("fetch_torch_npu.sh", "demo_legacy.sh"):
        done = subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], capture_output=True, text=True,
                              timeout=120, env=env)  # fmt: skip
        assert done.returncode == 0 and "must not import torch" not in done.stderr, done.stderr
    assert done.stdout.split() == ["--legacy-from", str(wheels.cached_wheel("2.12.0"))]
