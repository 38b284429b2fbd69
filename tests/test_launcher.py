"""`npu-shadow run` on real jobs: spawned DataLoader workers, torchrun ranks, bad settings, late
torch_npu imports, the fire drill, and `npu-shadow doctor`."""

import json
import os
import subprocess
import sys

import pytest
import torch
from metrics_helpers import samples, total
from prometheus_server import consecutive_free_ports, free_port, prometheus

from shadow import config as cfg
from shadow import doctor, runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_dataparallel.py")
FAKE_TORCH_NPU = os.path.join(ROOT, "tests", "fake_torch_npu")
JOB = ["--epochs", "1", "--samples", "128", "--batch-size", "32", "--workers", "2"]
STEPS, SAMPLES = 4, 128


def npu_shadow(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "weights.pt"
    done = subprocess.run(
        [sys.executable, EXAMPLE, *JOB, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done, torch.load(out)


def assert_same_weights(path, expected):
    got = torch.load(path)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_example_job_with_spawned_workers_is_shadowed_and_unchanged(plain_run, tmp_path):
    plain, weights = plain_run
    textfile, out = tmp_path / "metrics.prom", tmp_path / "weights.pt"
    done = npu_shadow(
        "run", "--sample-rate", "1", "--port", str(free_port()), "--textfile", str(textfile),
        "--", sys.executable, EXAMPLE, *JOB, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == plain.returncode == 0, done.stderr
    assert "cannot serve" not in done.stderr  # the job serves; its DataLoader workers do not try
    assert done.stdout == plain.stdout  # the job's own output, untouched
    assert_same_weights(out, weights)
    assert "tensor_type" in done.stderr and "not exercised" in done.stderr  # the summary
    parsed = samples(textfile.read_text())
    # two casts per step in the job's process, one per sample in the two spawned DataLoader workers
    assert total(parsed, "npu_shadow_calls_total", target="tensor_type") == 2 * STEPS + SAMPLES
    assert total(parsed, "npu_shadow_comparisons_total", target="tensor_type", outcome="match") == 2 * STEPS + SAMPLES


def test_exit_code_is_the_commands():
    assert npu_shadow("run", "--", sys.executable, "-c", "import sys; sys.exit(7)").returncode == 7


def test_processes_that_never_import_torch_pay_nothing():
    done = npu_shadow(
        "run", "--", sys.executable, "-c", "import sys; print('torch' in sys.modules, 'shadow' in sys.modules)"
    )
    assert done.returncode == 0 and done.stdout.strip() == "False False"


BAD_OPTIONS = [
    ("--targets", "tensor_typo", "--targets='tensor_typo'"),
    ("--sample-rate", "1.5", "--sample-rate='1.5'"),
    ("--sample-rate", "tensor_type=x", "--sample-rate='tensor_type=x'"),
    ("--seed", "one", "--seed='one'"),
    ("--rtol", "-1", "--rtol='-1'"),
    ("--atol", "nan", "--atol='nan'"),
    ("--port", "70000", "--port='70000'"),
    ("--drill", "value", "--drill='value'"),
    ("--drill", "fire:0.5", "--drill='fire:0.5'"),
    ("--journal", "", "--journal=''"),
]
BAD_VARIABLES = [
    ("NPU_SHADOW_TARGETS", ",", "NPU_SHADOW_TARGETS"),
    ("NPU_SHADOW_SAMPLE_RATE", "-0.1", "NPU_SHADOW_SAMPLE_RATE"),
    ("NPU_SHADOW_SEED", "1.5", "NPU_SHADOW_SEED"),
    ("NPU_SHADOW_PROMETHEUS_PORT", "http", "NPU_SHADOW_PROMETHEUS_PORT"),
    ("NPU_SHADOW_OTEL", "maybe", "NPU_SHADOW_OTEL"),
    ("NPU_SHADOW_DRILL", "nan:2", "NPU_SHADOW_DRILL"),
    ("NPU_SHADOW_RTOL", "1e-3", "--rtol needs --atol"),
]


def marker_command(tmp_path):
    marker = tmp_path / "started"
    return marker, [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]


@pytest.mark.parametrize("option, value, named", BAD_OPTIONS)
def test_bad_option_stops_before_the_command(option, value, named, tmp_path, capsys):
    marker, command = marker_command(tmp_path)
    name = next(n for n, s in cfg.SETTINGS.items() if s.option == option)
    assert runner.run(command, {name: value}, environ={}) == 2
    assert named in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("variable, value, named", BAD_VARIABLES)
def test_bad_variable_stops_before_the_command(variable, value, named, tmp_path, capsys):
    marker, command = marker_command(tmp_path)
    assert runner.run(command, {}, environ={variable: value}) == 2
    err = capsys.readouterr().err
    assert (named in err and "expected" in err) or "needs" in err
    assert not marker.exists()


def test_bad_setting_through_the_real_command(tmp_path):
    marker, command = marker_command(tmp_path)
    env = dict(os.environ, NPU_SHADOW_SAMPLE_RATE="often")
    done = npu_shadow("run", "--", *command, env=env)
    assert done.returncode == 2 and "NPU_SHADOW_SAMPLE_RATE='often' is not valid" in done.stderr
    assert not marker.exists()


LATE_IMPORT = r"""
import sys
import torch
from shadow import launch
first = launch._state["monitor"]
assert first is not None and first.targets == (), first.targets   # nothing patched yet: nothing shadowed
sys.path.insert(0, sys.argv[1])
import torch_npu                                                    # patches torch over the wrappers
second = launch._state["monitor"]
assert set(second.targets) == {"parallel_apply", "data_parallel", "tensor_type"}, second.targets
legacy = torch_npu.utils.tensor_methods._npu_type
assert torch.Tensor.type.__npu_shadow__.legacy is legacy            # shadowing the new legacy
assert torch.Tensor.type.__wrapped__ is legacy                      # wrapped once, not twice
from torch.nn.parallel import data_parallel
assert data_parallel.__npu_shadow__.target.name == "data_parallel"
torch.ones(2).type(torch.float64)
print(json.dumps(second.stats()["tensor_type"].match))
"""


def test_torch_npu_imported_late_is_shadowed_once():
    done = npu_shadow(
        "run", "--sample-rate", "1", "--", sys.executable, "-c", "import json\n" + LATE_IMPORT, FAKE_TORCH_NPU
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_fire_drill_gives_rollback_and_leaves_the_job_alone(plain_run, tmp_path):
    _, weights = plain_run
    textfile, out = tmp_path / "metrics.prom", tmp_path / "weights.pt"
    done = npu_shadow(
        "run", "--sample-rate", "1", "--drill", "value:1.0", "--textfile", str(textfile),
        "--journal", str(tmp_path / "journal-{pid}.jsonl"),
        "--", sys.executable, EXAMPLE, *JOB, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_weights(out, weights)
    parsed = samples(textfile.read_text())
    assert total(parsed, "npu_shadow_drill_active") == 1
    verdict = npu_shadow("verdict", "--metrics-file", str(textfile))
    assert verdict.returncode == 1 and "rollback" in verdict.stdout, verdict.stdout
    lines = [json.loads(line) for path in tmp_path.glob("journal-*.jsonl") for line in path.read_text().splitlines()]
    assert lines and all(line["drill"] for line in lines)


def test_doctor_on_this_cpu_host():
    code, lines = doctor.diagnose(free_port())
    text = "\n".join(lines)
    assert code == 0
    assert "torch_npu not installed; reference legacy available" in text
    assert "parallel_apply, data_parallel cannot run without an accelerator" in text
    assert "self-test tensor_type: passed" in text
    done = npu_shadow("doctor", "--port", str(free_port()))
    assert done.returncode == 0 and "ok: this host can shadow" in done.stdout


TORCHRUN_JOB = ["--epochs", "1", "--samples", "64", "--batch-size", "16", "--workers", "0", "--linger", "6"]


def test_torchrun_two_ranks_both_shadowed_and_scraped(tmp_path):
    port = consecutive_free_ports()
    textfile = tmp_path / "rank{rank}.prom"
    with prometheus(tmp_path, {"rank0": port, "rank1": port + 1}, []) as server:
        job = subprocess.Popen(
            [
                sys.executable, "-m", "shadow", "run", "--sample-rate", "1", "--port", str(port),
                "--textfile", str(textfile), "--",
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port()), EXAMPLE, *TORCHRUN_JOB,
            ],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            _, err = job.communicate(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode == 0, err[-3000:]
        # the ranks have exited: their series are stale now, so read the last value each scrape saw
        query = 'max_over_time(npu_shadow_calls_total{target="tensor_type"}[5m])'
        scraped = server.wait_for(lambda: len(server.query(query)) == 2 and server.query(query), "both ranks")
    by_job = {dict(labels)["job"]: value for labels, value in scraped.items()}
    for rank in (0, 1):
        final = total(
            samples((tmp_path / f"rank{rank}.prom").read_text()), "npu_shadow_calls_total", target="tensor_type"
        )
        assert final > 0
        assert by_job[f"rank{rank}"] == final  # the last scrape saw every call: nothing lost
