"""`npu-shadow run` on real jobs: spawned DataLoader workers, torchrun ranks, bad settings, late
torch_npu imports, the fire drill, and `npu-shadow doctor`."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from commands import npu_shadow, npu_shadow_here
from metrics_helpers import samples, total
from prometheus_server import consecutive_free_ports, free_port, prometheus
from torch_npu_wheels import wheel

from shadow.launcher import config as cfg
from shadow.launcher import doctor, runner, setting_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_dataparallel.py")
FAKE_TORCH_NPU = os.path.join(ROOT, "tests", "fake_torch_npu")
JOB = ["--epochs", "1", "--samples", "128", "--batch-size", "32", "--workers", "2"]
STEPS, SAMPLES = 4, 128


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


@pytest.mark.slow
def test_example_job_with_spawned_workers_is_shadowed_and_unchanged(plain_run, tmp_path):
    plain, weights = plain_run
    textfile, out = tmp_path / "metrics.prom", tmp_path / "weights.pt"
    done = npu_shadow(
        "run", "--sample-rate", "1", "--budget", "off", "--port", str(free_port()), "--textfile", str(textfile),
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


@pytest.mark.slow
def test_exit_code_is_the_commands():
    assert npu_shadow("run", "--", sys.executable, "-c", "import sys; sys.exit(7)").returncode == 7


@pytest.mark.slow
def test_processes_that_never_import_torch_pay_nothing():
    done = npu_shadow(
        "run", "--", sys.executable, "-c", "import sys; print('torch' in sys.modules, 'shadow' in sys.modules)"
    )
    assert done.returncode == 0 and done.stdout.strip() == "False False"


#: An invalid value for every setting (a file where a folder must be: the checks hold for root too).
INVALID = {
    "targets": "tensor_typo",
    "journal_all": "maybe",
    "emulated_soc": "Ascend 910",
    "emulated_device": "kernel_time=fast",
    "sample_rate": "1.5",
    "seed": "one",
    "rtol": "-1",
    "atol": "nan",
    "port": "70000",
    "addr": "local host",
    "multiproc_dir": "/etc/passwd",
    "otel": "maybe",
    "gather": "maybe",
    "journal": "/etc/passwd/journal.jsonl",
    "capture_dir": "/etc/passwd/captures",
    "drill": "fire:0.5",
    "pushgateway": "not a gateway",
    "textfile": "/etc/passwd/metrics.prom",
    "emulate_npu": "17",
    "legacy_from": "/nonexistent/torch_npu-2.12.0.whl",
    "shadow_patches": "layer_norm",
    "oracle": "sometimes",
    "budget": "0",
    "deadline": "0",
    "pure_hooks": "sometimes",
    "trusted_checkpoints": "maybe",
    "first_per_signature": "-1",
    "aa_rate": "1.5",
    "backward_rate": "2",
    "backward_memory": "1.5",
    "truth_rate": "often",
    "primary": "both",
    "rollback_file": "",
    "rollback_port": "70000",
    "rollback_addr": "local host",
    "rollback_token": "short",
    "rollback_token_file": "/no/such/token/file",
    "rollback_optional": "maybe",
    "linger": "-1",
    "run_id": "two words",
    "run_started": "yesterday",
}
MORE_INVALID = [
    ("sample_rate", "tensor_type=x"),
    ("drill", "value"),
    ("drill", "nan:2"),
    ("targets", ","),
    ("journal", ""),
    ("emulate_npu", "two"),
    ("emulate_npu", "²"),
    ("oracle", "1.5"),
    ("budget", "1.5"),
    ("budget", "lots"),
    ("deadline", "-1"),
    ("deadline", "inf"),
    ("deadline", "soon"),
    ("legacy_from", ""),
    ("shadow_patches", "torch.load,torch.load"),
    ("shadow_patches", ","),
    ("port", "²"),  # a digit to str.isdigit, not to int()
    ("multiproc_dir", "/etc/passwd/sub"),  # below a file
    ("multiproc_dir", "/tmp"),  # writable by others
    ("capture_dir", "/tmp"),
    ("multiproc_dir", "/tmp/" + "x" * 300),  # a name longer than a file name can be
    ("journal", "/tmp/j-{bogus}.jsonl"),
    ("journal", "/tmp/j-{0}.jsonl"),
    ("journal", "/tmp/j-{.jsonl"),
    ("textfile", "/tmp/m-{bogus}.prom"),
    ("linger", "soon"),
    ("run_id", "-starts-with-a-dash"),
    ("run_id", "x" * 65),
    ("run_started", "nan"),
    ("run_started", "99999999999"),  # (in the future)
    ("linger", "inf"),
]


def test_every_setting_has_an_invalid_case():
    assert set(INVALID) == set(cfg.SETTINGS)


def marker_command(tmp_path):
    marker = tmp_path / "started"
    return marker, [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]


@pytest.mark.parametrize(
    "name, value",
    [(n, v) for n, v in [*INVALID.items(), *MORE_INVALID] if n not in cfg.FLAGS and cfg.SETTINGS[n].option],
)
def test_bad_option_stops_before_the_command(name, value, tmp_path, capsys):
    # (--otel is a flag: only its variable can hold a bad value)
    marker, command = marker_command(tmp_path)
    options = {name: value}
    if name in ("rtol", "atol"):
        options["atol" if name == "rtol" else "rtol"] = "0"
    assert runner.run(command, options, environ={}) == 2
    assert f"{cfg.SETTINGS[name].option}={value!r} is not valid" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("name, value", [*INVALID.items(), *MORE_INVALID])
def test_bad_variable_stops_before_the_command(name, value, tmp_path, capsys):
    marker, command = marker_command(tmp_path)
    environ = {cfg.SETTINGS[name].variable: value}
    if name in ("rtol", "atol"):
        environ[cfg.SETTINGS["atol" if name == "rtol" else "rtol"].variable] = "0"
    assert runner.run(command, {}, environ=environ) == 2
    assert f"{cfg.SETTINGS[name].variable}={value!r} is not valid" in capsys.readouterr().err
    assert not marker.exists()


def test_legacy_source_without_the_patches_stops_before_the_command(tmp_path, capsys):
    marker, command = marker_command(tmp_path)
    fake = tmp_path / "torch_npu-9.9.9-py3-none-any.whl"
    fake.write_bytes(b"not a zip")
    assert runner.run(command, {"legacy_from": str(fake)}, environ={}) == 2
    assert "--legacy-from: " in capsys.readouterr().err and not marker.exists()
    (tmp_path / "site" / "torch_npu" / "utils").mkdir(parents=True)
    (tmp_path / "site" / "torch_npu" / "utils" / "_module.py").write_text("def something_else(): pass\n")
    assert runner.run(command, {"legacy_from": str(tmp_path / "site")}, environ={}) == 2
    assert "defines none of the patches npu-shadow shadows" in capsys.readouterr().err and not marker.exists()


def test_tolerance_needs_both_settings(tmp_path, capsys):
    marker, command = marker_command(tmp_path)
    assert runner.run(command, {}, environ={"NPU_SHADOW_RTOL": "1e-3"}) == 2
    assert "--rtol needs --atol (NPU_SHADOW_ATOL) too" in capsys.readouterr().err
    assert not marker.exists()


def test_an_option_overrides_its_variable(tmp_path):
    marker, command = marker_command(tmp_path)
    assert runner.run(command, {"sample_rate": "0.5"}, environ={"NPU_SHADOW_SAMPLE_RATE": "bad"}) == 0
    assert marker.exists()


@pytest.mark.slow
def test_bad_setting_through_the_real_command(tmp_path):
    marker, command = marker_command(tmp_path)
    env = dict(os.environ, NPU_SHADOW_SAMPLE_RATE="often")
    done = npu_shadow("run", "--", *command, env=env)
    assert done.returncode == 2 and "NPU_SHADOW_SAMPLE_RATE='often' is not valid" in done.stderr
    assert not marker.exists()


LATE_IMPORT = r"""
import sys
import time
import torch
from shadow.launcher import launch
first = launch.LAUNCHER.monitor
assert first is not None and first.targets == (), first.targets   # nothing patched yet: nothing shadowed
sys.path.insert(0, sys.argv[1])
import torch_npu                                                    # patches torch over the wrappers
second = launch.LAUNCHER.monitor
assert set(second.targets) == {"parallel_apply", "data_parallel", "tensor_type"}, second.targets
legacy = torch_npu.utils.tensor_methods._npu_type
assert torch.Tensor.type.__npu_shadow__.legacy is legacy            # shadowing the new legacy
assert torch.Tensor.type.__wrapped__ is legacy                      # wrapped once, not twice
from torch.nn.parallel import data_parallel
assert data_parallel.__npu_shadow__.target.name == "data_parallel"
torch.ones(2).type(torch.float64)
print(json.dumps(second.stats()["tensor_type"].match))
"""


@pytest.mark.slow
def test_torch_npu_imported_late_is_shadowed_once():
    done = npu_shadow(
        "run",
        "--sample-rate",
        "1",
        "--budget",
        "off",
        "--",
        sys.executable,
        "-c",
        "import json\n" + LATE_IMPORT,
        FAKE_TORCH_NPU,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


@pytest.mark.slow
def test_fire_drill_gives_rollback_and_leaves_the_job_alone(plain_run, tmp_path):
    _, weights = plain_run
    textfile, out = tmp_path / "metrics.prom", tmp_path / "weights.pt"
    done = npu_shadow(
        "run", "--sample-rate", "1", "--budget", "off", "--drill", "dtype:1.0", "--textfile", str(textfile),
        "--journal", str(tmp_path / "journal-{pid}.jsonl"),
        "--", sys.executable, EXAMPLE, *JOB, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_same_weights(out, weights)
    parsed = samples(textfile.read_text())
    assert total(parsed, "npu_shadow_drill_active") == 1
    verdict = npu_shadow_here("verdict", "--metrics-file", str(textfile))
    # (a dtype drill: hard mismatches, a rollback however few clusters a short job's comparisons fall in)
    assert verdict.returncode == 1 and "rollback" in verdict.stdout and "FIRE DRILL" in verdict.stdout, verdict.stdout
    # (the summary says how many comparisons the drill reached: a cast to its own dtype returns its input)
    assert re.search(r"fire drill: injected into \d+ of \d+ comparisons", done.stderr), done.stderr[-2000:]
    lines = [json.loads(line) for path in tmp_path.glob("journal-*.jsonl") for line in path.read_text().splitlines()]
    lines = [line for line in lines if "outcome" in line]
    # (a call whose output aliases its argument cannot be drilled without writing the argument: it compares as is)
    assert lines and all(line["drill"] or line["outcome"] == "match" for line in lines), [
        (line["outcome"], line["reasons"], line["detail"]) for line in lines if not line["drill"]
    ]
    # (the training process's casts change the dtype and take the drill; the DataLoader workers' casts to their own
    # dtype return their argument, and compare as is)
    assert sum(line["drill"] for line in lines) >= 4


@pytest.mark.slow
def test_doctor_on_this_cpu_host_and_with_the_emulated_npu():
    done = npu_shadow("doctor", "--port", str(free_port()))  # a fresh process: no accelerator
    assert done.returncode == 0, done.stdout + done.stderr
    # (no torch_npu and no --legacy-from: npu-shadow run would shadow nothing, and doctor says so)
    assert "ok: this host can shadow\n" not in done.stdout
    assert done.stdout.rstrip().endswith("npu-shadow run without it shadows nothing here")
    assert "device: cpu only" in done.stdout
    assert "torch_npu: not installed" in done.stdout
    assert "legacy: none for npu-shadow run: torch_npu is not importable here" in done.stdout
    assert "parallel_apply, data_parallel cannot run without an accelerator" in done.stdout
    assert "self-test tensor_type: passed" in done.stdout

    done = npu_shadow("doctor", "--emulate-npu", "2", "--port", str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "device: emulated npu (2 devices" in done.stdout
    assert "self-test tensor_type: passed (3/3 casts matched on npu:0)" in done.stdout
    assert (
        "can shadow here: parallel_apply, data_parallel, tensor_type, torch_load, module_to, module_npu, "
        "foreach_devices, lstm_forward" in done.stdout
    )
    assert (
        "dataloader_init (_MultiProcessingDataLoaderIter.__init__, which cannot run twice): compared as a canary"
        in (done.stdout)
    )
    assert "shadowing reports a match under autocast" in done.stdout

    code, lines = doctor.diagnose(free_port())  # this test process has the emulated npu (conftest)
    assert code == 0 and "device: emulated npu (2 devices, host memory: a rehearsal of the real upstream code)" in lines
    for bad in (["--emulate-npu", "17"], ["--port", "-1"], ["--port", "70000"]):
        done = npu_shadow("doctor", *bad)
        assert done.returncode == 2 and "is not valid" in done.stderr, (bad, done.stderr)


EMULATED_JOB = ["--epochs", "1", "--samples", "256", "--batch-size", "32", "--workers", "0", "--autocast"]
EMULATED_STEPS = 8


@pytest.mark.slow
@pytest.mark.parametrize("legacy", ["reference", "torch_npu 2.12.0 source"])
def test_example_job_on_two_emulated_npus_shadows_all_three_targets_and_is_unchanged(tmp_path, legacy):
    legacy_from = ["--legacy-from", wheel("2.12.0")] if legacy != "reference" else []
    plain_out, out, textfile = tmp_path / "plain.pt", tmp_path / "weights.pt", tmp_path / "metrics.prom"
    plain = subprocess.run(
        [sys.executable, EXAMPLE, *EMULATED_JOB, "--emulate-npu", "2", "--out", str(plain_out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    done = npu_shadow(
        "run", "--emulate-npu", "2", *legacy_from, "--sample-rate", "1", "--budget", "off", "--textfile", str(textfile),
        "--", sys.executable, EXAMPLE, *EMULATED_JOB, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # (the job's first line says which legacy patches it found)
    assert done.stdout.splitlines()[1:] == plain.stdout.splitlines()[1:]
    assert f"npu-shadow legacy: {legacy}" in done.stderr
    assert_same_weights(out, torch.load(plain_out))
    parsed = samples(textfile.read_text())
    data_parallel_steps = len([s for s in range(EMULATED_STEPS) if s % 4 == 3])
    expected_calls = {
        "parallel_apply": EMULATED_STEPS - data_parallel_steps,
        "data_parallel": data_parallel_steps,
    }
    for target, calls in expected_calls.items():
        assert total(parsed, "npu_shadow_calls_total", target=target) == calls
        assert total(parsed, "npu_shadow_comparisons_total", target=target, outcome="match") == calls

    def compared(target, signature_matches):
        return sum(
            value
            for (name, items), value in parsed.items()
            if name == "npu_shadow_comparisons_total"
            and dict(items)["target"] == target
            and signature_matches(dict(items)["signature"])
        )

    autocast_on = {t: compared(t, lambda s: s.endswith("/autocast=on")) for t in expected_calls}
    assert autocast_on == {"parallel_apply": 2, "data_parallel": 2}  # odd steps: 1, 5 and 3, 7
    for kind in ("npu_name", "npu_class"):
        assert compared("tensor_type", lambda s, kind=kind: s.startswith(kind + "/")) == EMULATED_STEPS, kind
    assert total(parsed, "npu_shadow_comparisons_total", target="tensor_type", outcome="mismatch") == 0
    verdict = npu_shadow_here("verdict", "--metrics-file", str(textfile))
    assert verdict.returncode == 3  # honest: far too few comparisons to promote
    # every risky signature is named with its coverage: the job casts on the current npu only, one replica never
    # (those it called with their coverage; those it never called, as not exercised by this job)
    # (each risky signature taken on its own: the pattern */autocast=on as the one signature the job took)
    assert "risky signatures compared: replicas=2+/grad=on/autocast=on 2" in verdict.stdout
    never = "risky signatures not exercised by these jobs (never called; the promotion does not cover them): "
    assert never + "replicas=1/*" in verdict.stdout
    assert never + "npu_name/noncurrent/*, npu_class/noncurrent/*, torch_npu_name/*" in verdict.stdout
    # legacy and upstream agree under autocast; the single-device oracle sees what both do
    for target in expected_calls:
        assert total(parsed, "npu_shadow_shared_divergences_total", target=target, reason="dtype") == 2
        assert total(parsed, "npu_shadow_shared_divergences_total", target=target) == 2
    assert verdict.stdout.count("shared divergence: dtype 2 (legacy and upstream agree") == 2


TORCHRUN_JOB = ["--epochs", "1", "--samples", "64", "--batch-size", "16", "--workers", "0", "--linger", "6"]


@pytest.mark.slow
def test_torchrun_two_ranks_both_shadowed_and_scraped(tmp_path):
    port = consecutive_free_ports()
    textfile = tmp_path / "rank{rank}.prom"
    with prometheus(tmp_path, {"rank0": port, "rank1": port + 1}, []) as server:
        job = subprocess.Popen(
            [
                sys.executable, "-m", "shadow", "run", "--sample-rate", "1", "--budget", "off", "--port", str(port),
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
        query = 'sum by (job) (max_over_time(npu_shadow_calls_total{target="tensor_type"}[5m]))'
        scraped = server.wait_for(lambda: len(server.query(query)) == 2 and server.query(query), "both ranks")
    by_job = {dict(labels)["job"]: value for labels, value in scraped.items()}
    for rank in (0, 1):
        final = total(
            samples((tmp_path / f"rank{rank}.prom").read_text()), "npu_shadow_calls_total", target="tensor_type"
        )
        assert final > 0
        assert by_job[f"rank{rank}"] == final  # the last scrape saw every call: nothing lost


def test_library_form_reads_the_same_variables(monkeypatch):
    import shadow
    from shadow.launcher import launch

    monkeypatch.setattr(launch, "LAUNCHER", launch.Launcher())
    monkeypatch.setattr(launch.atexit, "register", lambda function: None)
    monitor = shadow.install_from_env({"NPU_SHADOW_TARGETS": "tensor_type", "NPU_SHADOW_SAMPLE_RATE": "1"})
    try:
        torch.ones(2).type(torch.float64)
        assert monitor.targets == ("tensor_type",) and monitor.stats()["tensor_type"].match == 1
        # a second call with other variables takes them (it used to keep the first call's settings)
        monitor = shadow.install_from_env(
            {"NPU_SHADOW_TARGETS": "tensor_type", "NPU_SHADOW_SAMPLE_RATE": "0", "NPU_SHADOW_FIRST_PER_SIGNATURE": "0"}
        )
        torch.ones(2).type(torch.float64)
        assert monitor.stats()["tensor_type"].calls == 1 and monitor.stats()["tensor_type"].sampled == 0
    finally:
        monitor.uninstall()
    with pytest.raises(cfg.ConfigError, match="NPU_SHADOW_SEED='x' is not valid"):
        shadow.install_from_env({"NPU_SHADOW_SEED": "x"})


@pytest.mark.slow
def test_one_endpoint_per_node_aggregates_every_process(tmp_path):
    from metrics_helpers import scrape

    port = free_port()
    job = subprocess.Popen(
        [
            sys.executable, "-m", "shadow", "run", "--sample-rate", "1", "--budget", "off",
            "--multiproc-dir", str(tmp_path / "node"),
            "--port", str(port), "--", sys.executable, EXAMPLE, *JOB, "--linger", "30",
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    expected = 2 * STEPS + SAMPLES  # the job's process and its two spawned workers, through one endpoint
    seen = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            try:
                seen = total(samples(scrape(port)), "npu_shadow_calls_total", target="tensor_type")
            except OSError:
                seen = None
            if seen == expected:
                break
            time.sleep(0.5)
    finally:
        job.terminate()  # the launcher passes SIGTERM on to the job
        job.wait(60)
    assert seen == expected
    assert job.returncode != 0  # stopped by the signal, not finished


@pytest.mark.slow
def test_sigterm_reaches_the_job(tmp_path):
    import signal

    flag = tmp_path / "terminated"
    script = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(flag)!r}, 'w'), sys.exit(143)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-m", "shadow", "run", "--", sys.executable, "-c", script],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert job.stdout.readline().strip() == "ready"
        job.send_signal(signal.SIGTERM)
        assert job.wait(30) == 143
    finally:
        if job.poll() is None:
            job.kill()
    assert flag.exists()


@pytest.mark.slow
def test_emulate_npu_where_torch_npu_is_imported_warns_and_still_shadows():
    """torch_npu is imported when torch is (torch autoloads it): the emulator refuses, the monitor does not."""
    job = (
        "import sys, types; sys.modules['torch_npu'] = types.ModuleType('torch_npu')\n"
        "import torch\n"
        "from shadow.npu import reference; reference.patch_torch()  # its patches, as torch_npu applies them\n"
        "torch.ones(2).type(torch.float64)\n"
        "from shadow.launcher import launch\nfrom shadow.npu import emulated\n"
        "print(emulated.installed_devices(), sorted(launch.LAUNCHER.monitor.targets))"
    )
    done = npu_shadow(
        "run", "--emulate-npu", "2", "--sample-rate", "1", "--budget", "off", "--", sys.executable, "-c", job
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("--emulate-npu ignored: torch_npu is imported") == 1
    assert done.stdout.split("\n")[0] == "0 ['data_parallel', 'parallel_apply', 'tensor_type']"
    assert "tensor_type" in done.stderr and "not installed" not in done.stderr


@pytest.mark.slow
def test_legacy_from_where_torch_npu_is_imported_keeps_torch_npu_and_says_so():
    """The real torch_npu outranks its source: its patches stay the legacy."""
    job = (
        "import sys, types; sys.modules['torch_npu'] = types.ModuleType('torch_npu')\n"
        "import torch\n"
        "from shadow.npu import reference; reference.patch_torch()  # its patches, as torch_npu applies them\n"
        "from shadow.launcher import launch\n"
        "print(launch.LAUNCHER.monitor.legacy_origins())"
    )
    done = npu_shadow(
        "run", "--emulate-npu", "2", "--legacy-from", wheel("2.12.0"), "--", sys.executable, "-c", job
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("--legacy-from ignored: torch_npu is imported") == 1
    assert "torch_npu 2.12.0 source" not in done.stdout


@pytest.mark.slow
def test_doctor_says_which_legacy_is_active(tmp_path):
    source = wheel("2.12.0")
    done = npu_shadow("doctor", "--emulate-npu", "2", "--legacy-from", source, "--port", str(free_port()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"legacy: torch_npu 2.12.0 source (from {source})" in done.stdout
    assert "legacy patches active: parallel_apply (torch_npu 2.12.0 source)" in done.stdout
    assert "self-test tensor_type: passed" in done.stdout
    broken = tmp_path / "torch_npu-2.12.0-cp311-none-any.whl"
    broken.write_text("not a wheel")
    done = npu_shadow("doctor", "--emulate-npu", "2", "--legacy-from", str(broken), "--port", str(free_port()))
    assert (
        done.returncode == 1 and "legacy: --legacy-from" in done.stdout and "neither a torch_npu wheel" in done.stdout
    )


def test_a_directory_that_cannot_be_created_stops_before_the_command(tmp_path, capsys):
    marker, command = marker_command(tmp_path)
    for name in ("multiproc_dir", "capture_dir"):
        assert runner.run(command, {name: "/proc/npu-shadow-x"}, environ={}) == 2
        assert f"{cfg.SETTINGS[name].option}='/proc/npu-shadow-x' is not valid: cannot create it" in (
            capsys.readouterr().err
        )
    assert not marker.exists()


CASTS = "import torch\nfor _ in range(5):\n    torch.ones(2).type(torch.float64)\n"


@pytest.mark.slow
def test_each_job_gets_a_fresh_private_folder_inside_the_multiproc_dir(tmp_path):
    """Files of an earlier job, planted symlinks and foreign files in the directory never reach a new job."""
    import stat

    base = tmp_path / "metrics"
    base.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (base / "counter_4242.db").symlink_to(victim)
    (base / "gauge_max_4243.db").write_bytes(b"not a metrics file")
    for run in (1, 2):
        textfile = tmp_path / f"run{run}.prom"
        done = npu_shadow(
            "run", "--multiproc-dir", str(base), "--targets", "tensor_type", "--sample-rate", "1", "--budget", "off",
            "--textfile", str(textfile), "--", sys.executable, "-c", CASTS,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert total(samples(textfile.read_text()), "npu_shadow_calls_total", target="tensor_type") == 5
    assert victim.read_text() == "precious"
    jobs = sorted(p for p in base.iterdir() if p.name.startswith("job-"))
    assert len(jobs) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in jobs)


@pytest.mark.slow
def test_a_per_target_rate_applies_to_a_legacy_patched_after_torch():
    """As on an NPU host whose job imports torch_npu itself: the patch comes after `import torch`."""
    job = (
        "import torch\n"
        "from shadow.npu import reference; reference.patch_torch()  # the legacy arrives late\n"
        "for _ in range(200):\n    torch.ones(2).type(torch.float64)\n"
        "from shadow.launcher import launch\n"
        "print(launch.LAUNCHER.monitor.stats()['tensor_type'].sampled)\n"
    )
    done = npu_shadow("run", "--sample-rate", "tensor_type=0.5", "--seed", "1", "--", sys.executable, "-c", job)
    assert done.returncode == 0, done.stderr
    assert "not installed" not in done.stderr
    assert 60 < int(done.stdout.strip().splitlines()[-1]) < 140  # about half of 200 calls


@pytest.mark.slow
@pytest.mark.parametrize(
    "content, says",
    [
        (b"\xff\xfe not ascii at all \xff", "the token in it is not ASCII text"),
        (b"t" * 5000, "it holds more than 4096 bytes"),
    ],
    ids=["not-utf8", "too-long"],
)
def test_a_token_file_that_is_not_a_token_is_refused_saying_why(tmp_path, content, says):
    path = tmp_path / "token"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(setting_values.Invalid, match=says):
        setting_values.read_token_file(str(path))
    done = npu_shadow(
        "run",
        "--primary",
        "upstream",
        "--rollback-port",
        "0",
        "--legacy-from",
        "reference",
        "--",
        sys.executable,
        "-c",
        "pass",
        env={**os.environ, "NPU_SHADOW_ROLLBACK_TOKEN_FILE": str(path)},
        timeout=120,
    )
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


_BLOCKER = """
import importlib.abc, os, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        in_job = os.environ.get("NPU_SHADOW_ENABLED") == "1"
        if name.split(".")[0] == "opentelemetry" and (in_job or os.environ.get("BLOCK_EVERYWHERE") == "1"):
            raise ModuleNotFoundError("No module named 'opentelemetry' (blocked by the test)")
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _blocked_environment(tmp_path, everywhere: bool) -> dict:
    (tmp_path / "blocker").mkdir(exist_ok=True)
    (tmp_path / "blocker" / "sitecustomize.py").write_text(_BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHADOW_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "blocker"), ROOT])
    env["BLOCK_EVERYWHERE"] = "1" if everywhere else "0"
    return env


@pytest.mark.slow
def test_an_exporter_not_asked_for_is_never_imported(tmp_path):
    """Without opentelemetry installed, a job run with a journal only is shadowed (it used to import the OTel
    exporter anyway, print "not installed" among the job's output, and run the job unshadowed, exiting 0)."""
    journal = tmp_path / "j.jsonl"
    job = "import torch; torch.ones(2).type(torch.float64)"
    done = npu_shadow(
        "run", "--legacy-from", "reference", "--journal", str(journal), "--", sys.executable, "-c", job,
        env=_blocked_environment(tmp_path, everywhere=True),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not installed" not in done.stderr and journal.exists(), done.stderr[-2000:]


@pytest.mark.slow
def test_an_exporter_whose_package_is_missing_fails_the_launcher_before_the_job(tmp_path):
    """--otel where opentelemetry cannot be imported: exit 2 naming the setting and the package, the job never
    started. Where the launcher finds it but a job process cannot import it, the job runs (its output is its own)
    and the launcher ends with 2, saying its monitor could not start: never an unshadowed job that exits 0."""
    ran = tmp_path / "ran"
    job = f"import pathlib, torch; pathlib.Path({str(ran)!r}).write_text('x')"
    args = ("run", "--legacy-from", "reference", "--otel", "--", sys.executable, "-c", job)
    refused = npu_shadow(*args, env=_blocked_environment(tmp_path, everywhere=True))
    assert refused.returncode == 2 and "--otel" in refused.stderr and "'opentelemetry'" in refused.stderr
    assert not ran.exists()
    failed = npu_shadow(*args, env=_blocked_environment(tmp_path, everywhere=False))
    assert ran.exists() and failed.returncode == 2, failed.stderr[-2000:]
    assert "the monitor could not start in 1 process(es) of the job, which ran unshadowed" in failed.stderr
