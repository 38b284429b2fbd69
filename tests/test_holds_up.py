"""The job never pays for the monitor: tiny rates, restore failures, memory, disks, signals and hostile files."""

import json
import os
import re
import subprocess
import sys
import threading
import types

import pytest
import torch
from commands import npu_shadow, npu_shadow_here
from fakes import Recorder

import shadow
from shadow import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- 1. memory


MEMORY_JOB = """
import resource, sys, types
import torch
import shadow
torch.set_num_threads(1)
x = torch.ones(100_000_000)  # a 400 MB argument
ops = types.SimpleNamespace(op=lambda t: t * 2)  # legacy: a 400 MB result
monitor = shadow.install([shadow.Target("op", ops, "op", lambda t: t * 2)], sample_rate=1.0)
monitor.uninstall()
ops.op(x[:1000])  # every lazy start-up allocation made
def vm_size():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
if sys.argv[1] == "limited":  # room for legacy's result and a little more, not for a copy of x besides
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (600 << 20), resource.RLIM_INFINITY))
y = ops.op(x)  # legacy alone fits
del y
with shadow.install([shadow.Target("op", ops, "op", lambda t: t * 2)], sample_rate=1.0) as monitor:
    y = ops.op(x)
assert torch.equal(y[:3], torch.full((3,), 2.0))
stats = monitor.stats()["op"]
print(stats.match, dict(stats.by_reason))
"""


@pytest.mark.slow
@pytest.mark.parametrize("limit, expected", [("limited", "0 {'oom': 1}"), ("unlimited", "1 {}")])
def test_the_copies_never_take_legacys_headroom(limit, expected):
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_JOB, limit], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == expected


def test_the_emulated_npu_reports_its_free_memory_as_torch_npu_does():
    from shadow.core.support import memory

    free, total = torch.npu.mem_get_info()
    assert 0 < free <= total
    assert 0 < memory.free_bytes(torch.device("npu:1")) <= total
    with pytest.raises(memory.InsufficientMemory, match="out of memory for the shadow side"):
        memory.check_fits([_Huge()], 1, "test copies")


class _Huge:
    """Stands for a tensor larger than any host: only what check_fits reads."""

    device = torch.device("npu:0")

    def numel(self):
        return 1 << 60

    def element_size(self):
        return 4


# --------------------------------------------------------------------------- 2. tiny and huge rates


@pytest.mark.slow
def test_a_tiny_sample_rate_never_crashes_the_job():
    done = npu_shadow(
        "run",
        "--sample-rate",
        "1e-310",
        "--",
        sys.executable,
        "-c",
        "import torch; from shadow.npu import reference; reference.patch_torch(); torch.ones(2).type(torch.float16);"
        " print('job done')",
    )
    assert done.returncode == 0, done.stderr
    assert "job done" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("rate", [1e-310, 1e-320, 5e-324])
def test_tiny_rates_install_and_sample_nothing(rate):
    ops = types.SimpleNamespace(op=lambda x: x)
    with shadow.install([Target("op", ops, "op", lambda x: x)], sample_rate=rate, oracle=rate, budget=rate) as m:
        for _ in range(100):
            ops.op(1)
    assert m.stats()["op"].calls == 100 and m.stats()["op"].sampled == 0
    assert shadow.Tolerance(rate, rate).rtol == rate
    from shadow.core.calls.sampled.drill import Drill

    assert Drill("value", rate).rate == rate


HUGE = 10**400


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: shadow.install(["tensor_type"], sample_rate=HUGE), "sample_rate"),
        (lambda: shadow.install(["tensor_type"], sample_rate={"tensor_type": HUGE}), "sample_rate['tensor_type']"),
        (lambda: shadow.install(["tensor_type"], oracle=HUGE), "oracle"),
        (lambda: shadow.install(["tensor_type"], budget=HUGE), "budget"),
        (lambda: shadow.Tolerance(HUGE, 0.0), "Tolerance.rtol"),
        (
            lambda: __import__("shadow.core.calls.sampled.drill").core.calls.sampled.drill.Drill("value", HUGE),
            "drill rate",
        ),
    ],
    ids=["sample_rate", "sample_rate table", "oracle", "budget", "Tolerance", "Drill"],
)
def test_a_rate_beyond_any_float_is_a_value_error_naming_the_setting(make, setting):
    with pytest.raises(ValueError, match=r"^" + setting.replace("[", r"\[").replace("]", r"\]")) as caught:
        make()
    assert len(str(caught.value)) < 200  # the number is not printed whole


@pytest.mark.parametrize("max_rate", ["1e-310", "5e-324"])
def test_the_verdict_takes_a_tiny_max_rate(tmp_path, max_rate):
    import journals

    journal = journals.write(tmp_path / "j.jsonl", [journals.line()])
    done = npu_shadow_here("verdict", "--journal", str(journal), "--max-rate", max_rate)
    assert done.returncode == 3, done.stderr  # inconclusive, with a number of comparisons still needed
    assert "more than any job makes: more clusters" in done.stdout
    assert npu_shadow_here("verdict", "--journal", str(journal), "--max-rate", "1e400").returncode == 2


# --------------------------------------------------------------------------- 3. restore failures


def test_an_upstream_that_leaks_a_mode_never_leaves_the_thread_on_the_shadow_side():
    from torch.overrides import TorchFunctionMode

    class Leaked(TorchFunctionMode):  # its __torch_function__ raises NotImplementedError for every torch call
        pass

    def upstream(x):
        Leaked().__enter__()  # never exited
        return x + 100

    ops = types.SimpleNamespace(op=lambda x: x + 1)
    recorder = Recorder()
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0, exporters=[recorder]) as monitor:
        first = ops.op(torch.zeros(1))
        assert torch._C._len_torch_function_stack() == 0  # the leaked mode never reaches the job
        second = ops.op(torch.zeros(1))
    assert first.item() == second.item() == 1.0  # legacy's, every time
    stats = monitor.stats()["op"]
    assert stats.calls == stats.sampled == 2
    assert stats.error == 2 and stats.by_reason == {"exception": 2, "state": 2}  # upstream's own mode broke it


# --------------------------------------------------------------------------- 4. signals, as a transparent wrapper


SIGNAL_JOB = """
import os, signal, sys, time
record = sys.argv[1]
def note(number, frame):
    with open(record, "a") as f:
        f.write(signal.Signals(number).name + "\\n")
    if number == signal.SIGHUP:
        sys.exit(3)
for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
    signal.signal(sig, note)
open(record + ".ready", "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
    if os.path.exists(record + ".stop"):
        time.sleep(1.0)  # time for a second, duplicate delivery to arrive
        break
"""


def _wait_for(condition, what, timeout=60):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _launch(record, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "shadow", "run", "--", sys.executable, "-c", SIGNAL_JOB, str(record)],
        cwd=ROOT, **popen,
    )  # fmt: skip


@pytest.mark.slow
def test_ctrl_c_at_a_terminal_reaches_the_job_once(tmp_path):
    import fcntl
    import pty
    import signal
    import termios

    record = tmp_path / "signals"
    master, slave = pty.openpty()

    def controlling_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a terminal's shell gives it
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    launcher = _launch(record, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                       preexec_fn=controlling_terminal)  # fmt: skip
    os.close(slave)
    try:
        _wait_for(lambda: os.path.exists(f"{record}.ready"), "the job")
        os.write(master, b"\x03")  # Ctrl-C: the terminal signals its whole foreground process group
        _wait_for(lambda: record.exists(), "the job's SIGINT handler")
        (tmp_path / "signals.stop").touch()
        assert launcher.wait(timeout=60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        os.close(master)
    assert record.read_text().split() == ["SIGINT"]


def _signals_as_a_shell_leaves_them():
    """A child's SIGHUP, SIGUSR1 and SIGUSR2 at their defaults, whatever the suite inherited: under ``nohup`` SIGHUP is
    ignored, and a launcher started ignoring a signal rightly does not pass it on (its job ignores it too)."""
    import signal

    for number in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)


@pytest.mark.slow
def test_hup_and_usr_signals_sent_to_the_launcher_reach_the_job(tmp_path):
    import signal

    record = tmp_path / "signals"
    launcher = _launch(
        record, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_signals_as_a_shell_leaves_them
    )
    try:
        _wait_for(lambda: os.path.exists(f"{record}.ready"), "the job")
        for number, name in ((signal.SIGUSR1, "SIGUSR1"), (signal.SIGUSR2, "SIGUSR2")):
            launcher.send_signal(number)
            _wait_for(lambda name=name: record.exists() and name in record.read_text(), name)
        launcher.send_signal(signal.SIGHUP)
        assert launcher.wait(timeout=60) == 3  # the job's own exit code: it was not orphaned
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert record.read_text().split() == ["SIGUSR1", "SIGUSR2", "SIGHUP"]


@pytest.mark.slow
def test_a_command_that_cannot_run_exits_as_a_shell_says(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("not a program\n")
    assert npu_shadow("run", "--", str(plain)).returncode == 126
    assert npu_shadow("run", "--", str(tmp_path)).returncode == 126
    assert npu_shadow("run", "--", str(tmp_path / "missing")).returncode == 127
    assert npu_shadow("run", "--", "no-such-command-npu-shadow").returncode == 127


# --------------------------------------------------------------------------- 5. a full disk


FULL_DISK_JOB = """
import resource, signal, sys, types
import torch
import shadow
from exporters import JsonlExporter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE a write fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
ops = types.SimpleNamespace(op=lambda x: x * 2)
journal = JsonlExporter(sys.argv[1], all_outcomes=True)
target = shadow.Target("op", ops, "op", lambda x: x * 2)
with shadow.install([target], sample_rate=1.0, exporters=[journal]) as monitor:
    for _ in range(40):
        ops.op(torch.ones(2))
stats = monitor.stats()["op"]
print(stats.match, stats.export_errors, journal.lines_lost)
"""


@pytest.mark.slow
def test_a_full_disk_loses_whole_lines_counted_and_the_journal_stays_readable(tmp_path):
    from shadow.analysis import sources

    journal = tmp_path / "j.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK_JOB, str(journal)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    matches, export_errors, lost = map(int, done.stdout.split())
    lines = journal.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every line whole
    written = sum(b'"outcome"' in line for line in lines)
    assert matches == 40 and 0 < written < 40
    assert export_errors == 40 - written  # every lost line counted
    # (the final count record, shorter than a line, may still fit where lines did not; lost too where it did not)
    final_counts = b'"event":"counts"' in lines[-2]
    assert lost == export_errors + (not final_counts)
    counts = sources.from_journal([str(journal)])  # (every outcome: the lines written, or the final count record)
    assert counts["op"].compared == (40 if final_counts else written)


def test_readers_skip_and_count_a_torn_final_line(tmp_path):
    import journals

    from shadow.analysis import sources

    journal = tmp_path / "j.jsonl"
    whole = json.dumps(journals.line()) + "\n"
    journal.write_text(json.dumps(journals.header()) + "\n" + whole * 3 + whole[:30])
    torn = []
    assert sources.from_journal([str(journal)], torn)["op"].compared == 3
    assert torn == [f"{journal}:5"]
    done = npu_shadow_here("verdict", "--journal", str(journal))
    assert done.returncode == 3 and "skipped 1 torn line" in done.stderr
    journal.write_text("a line that never was a record\n" + whole)  # not a journal
    with pytest.raises(sources.SourceError, match=r"j\.jsonl:1"):
        sources.from_journal([str(journal)])


# --------------------------------------------------------------------------- 6. the textfile exporter


@pytest.mark.skipif(not os.path.exists("/dev/full") or not __import__("stat").S_ISCHR(os.stat("/dev/full").st_mode),
                    reason="needs /dev/full as a character device")  # fmt: skip
def test_the_textfile_never_replaces_a_device_file():
    import stat

    from exporters import PrometheusExporter

    with pytest.raises(OSError, match="not a regular file"):
        PrometheusExporter().write_textfile("/dev/full")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.slow
def test_a_failed_push_never_costs_the_textfile_and_each_failure_is_said(tmp_path):
    textfile = tmp_path / "tf.prom"
    missing = tmp_path / "missing" / "tf.prom"
    job = "import torch; from shadow.npu import reference; reference.patch_torch(); torch.ones(2).type(torch.float16)"
    done = npu_shadow(
        "run", "--sample-rate", "1", "--budget", "off", "--pushgateway", "127.0.0.1:1", "--textfile", str(textfile),
        "--",
        sys.executable, "-c", job,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "npu_shadow_calls_total" in textfile.read_text()
    assert "npu-shadow: push to 127.0.0.1:1 failed" in done.stderr
    done = npu_shadow("run", "--textfile", str(missing), "--", sys.executable, "-c", job)
    assert done.returncode == 0 and f"npu-shadow: textfile {missing} failed" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("template", ["tf-{rank:s}.prom", "tf-{pid:.0}.prom", "tf-{rank:>300}.prom", "tf-{pid!r}.prom"])
def test_format_specs_are_refused_before_the_command(tmp_path, template):
    done = npu_shadow("run", "--textfile", str(tmp_path / template), "--", sys.executable, "-c", "pass")
    assert done.returncode == 2 and "--textfile=" in done.stderr and "format spec" in done.stderr


# --------------------------------------------------------------------------- 7. forked workers


FORKED_WORKERS_JOB = """
import os, sys, types
import torch
import shadow

class Tally:
    def __init__(self, path):
        self.path = path
    def record(self, samples):
        for metric, labels, value in samples:
            if metric.otel_name == "npu_shadow.calls" and value:
                with open(self.path, "a") as f:
                    f.write(f"{os.getpid()} {value}\\n")

ops = types.SimpleNamespace(op=lambda x: x)

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 920
    def __getitem__(self, i):
        return ops.op(torch.tensor(i))

target = shadow.Target("op", ops, "op", lambda x: x)
monitor = shadow.install([target], sample_rate=float(sys.argv[2]), seed=0, exporters=[Tally(sys.argv[1])])
loader = torch.utils.data.DataLoader(Data(), batch_size=8, num_workers=2, multiprocessing_context="fork")
print(sum(len(batch) for batch in loader))
monitor.uninstall()
"""


@pytest.mark.slow
@pytest.mark.parametrize("rate", ["0.5", "0.01"])
def test_forked_dataloader_workers_report_every_call(tmp_path, rate):
    tally = tmp_path / "calls.txt"
    done = subprocess.run(
        [sys.executable, "-c", FORKED_WORKERS_JOB, str(tally), rate],
        capture_output=True, text=True, cwd=ROOT, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["920"], done.stderr
    reported = [line.split() for line in tally.read_text().splitlines()]
    assert sum(int(calls) for _, calls in reported) == 920
    assert len({pid for pid, _ in reported}) == 2  # both workers, the parent made no call


# --------------------------------------------------------------------------- 8. what the user's objects raise


class Unprintable:
    def __repr__(self):
        raise RuntimeError("no repr")


class StatelessNet(torch.nn.Linear):
    def state_dict(self, *args, **kwargs):
        raise RuntimeError("no state")


def test_a_state_dict_that_raises_keeps_the_mismatch():
    ops = types.SimpleNamespace(op=lambda m, x: m(x))
    recorder = Recorder()
    target = Target("op", ops, "op", lambda m, x: m(x) + 1)
    with shadow.install([target], sample_rate=1.0, exporters=[recorder]) as monitor:
        for _ in range(5):
            ops.op(StatelessNet(2, 2), torch.ones(2))
    assert monitor.stats()["op"].mismatch == 5
    assert all(o.evidence is not None and o.evidence.module_state is None for o in recorder.observations)


def test_an_argument_whose_repr_raises_never_costs_the_journal_line(tmp_path):
    from exporters import JsonlExporter

    ops = types.SimpleNamespace(op=lambda x, tag: x * 2)
    captures = tmp_path / "captures"
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(captures))
    target = Target("op", ops, "op", lambda x, tag: x * 3)
    with shadow.install([target], sample_rate=1.0, exporters=[journal]):
        ops.op(torch.ones(2), Unprintable())
    journal.close()
    (line,) = [line for line in (tmp_path / "j.jsonl").read_text().splitlines() if '"outcome"' in line]
    assert '"outcome":"mismatch"' in line
    (capture,) = captures.iterdir()
    from exporters import capture as capture_module

    assert capture_module.load(str(capture))["args"][1] == {"repr": "<Unprintable: repr raised RuntimeError>"}


# --------------------------------------------------------------------------- 8. OpenTelemetry in a fork, SDK faults


def _otel_sum(reader, name):
    data = reader.get_metrics_data()
    for scope in data.resource_metrics[0].scope_metrics:
        for metric in scope.metrics:
            if metric.name == name:
                return sum(point.value for point in metric.data.data_points)
    return None


def test_a_forked_child_reports_its_own_otel_totals():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from exporters import OTelExporter

    reader = InMemoryMetricReader()
    exporter = OTelExporter(meter_provider=MeterProvider(metric_readers=[reader]))
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    with shadow.install([Target("op", ops, "op", lambda x: x * 2)], sample_rate=1.0, exporters=[exporter]) as m:
        for _ in range(5):
            ops.op(torch.ones(1))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one call of its own (what the parent's exporters still had to take is the parent's)
            try:
                ops.op(torch.ones(1))
                m.deliver()
                os.write(write, str(_otel_sum(reader, "npu_shadow.comparisons")).encode())
            finally:
                os._exit(0)
        os.close(write)
        child = os.read(read, 100).decode()
        os.waitpid(pid, 0)
    assert child == "1" and _otel_sum(reader, "npu_shadow.comparisons") == 5


def test_an_sdk_fault_during_collection_is_counted():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from exporters import OTelExporter
    from shadow.core.model import contract

    reader = InMemoryMetricReader()
    exporter = OTelExporter(meter_provider=MeterProvider(metric_readers=[reader]))

    class Broken:
        def record(self, value, attributes=None):
            raise RuntimeError("SDK fault")

    exporter._histograms[contract.ABS_ERROR] = Broken()
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    with shadow.install([Target("op", ops, "op", lambda x: x * 2)], sample_rate=1.0, exporters=[exporter]):
        ops.op(torch.ones(1))
    reader.get_metrics_data()
    assert exporter.dropped == 1 and _otel_sum(reader, "npu_shadow.export_errors") == 1


# --------------------------------------------------------------------------- 9. hostile files


def test_a_file_planted_at_the_journal_path_gets_nothing(tmp_path):
    from exporters import JsonlExporter

    planted = tmp_path / "j.jsonl"
    planted.write_text("")
    planted.chmod(0o666)  # as another user's file in a shared directory would be: writable by all
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    journal = JsonlExporter(str(planted), all_outcomes=True)
    with shadow.install([Target("op", ops, "op", lambda x: x * 3)], sample_rate=1.0, exporters=[journal]) as monitor:
        ops.op(torch.ones(2))
    assert planted.read_text() == "" and monitor.stats()["op"].export_errors == 1


@pytest.mark.slow
@pytest.mark.parametrize("where", ["journal", "lock"])
def test_a_fifo_at_the_journal_path_never_blocks_the_job(tmp_path, where):
    path = tmp_path / "j.jsonl"
    if where == "lock":
        path.write_text("x" * 100)
        path.chmod(0o600)
        os.mkfifo(f"{path}.lock")
    # in a child, so that a blocked open could be timed out: the line rotates (max_bytes=50), taking the lock; a
    # FIFO already at the journal path is refused when the exporter is made (a setting that would lose every line)
    job = f"""
import os, torch, types, shadow
from exporters import JsonlExporter
ops = types.SimpleNamespace(op=lambda x: x * 2)
journal = JsonlExporter({str(path)!r}, all_outcomes=True, max_bytes=50)
if {where!r} == "journal":
    os.mkfifo({str(path)!r})  # planted after start-up
with shadow.install([shadow.Target("op", ops, "op", lambda x: x * 3)], sample_rate=1.0, exporters=[journal]) as m:
    ops.op(torch.ones(2))
print(m.stats()["op"].export_errors)
"""
    done = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["1"], done.stderr


# --------------------------------------------------------------------------- 10. capture names


@pytest.mark.parametrize("name", ["../escaped", "/tmp/absolute", "a/../../b"])
def test_target_names_never_write_captures_outside_capture_dir(tmp_path, name):
    from exporters import JsonlExporter

    captures = tmp_path / "inside" / "captures"
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(captures))
    with shadow.install([Target(name, ops, "op", lambda x: x * 3)], sample_rate=1.0, exporters=[journal]):
        ops.op(torch.ones(2))
    journal.close()
    (written,) = [p for p in tmp_path.rglob("*.pt")]
    assert written.parent == captures


# --------------------------------------------------------------------------- 11. settings that pass and then break


@pytest.mark.slow
@pytest.mark.parametrize(
    "option, value, env",
    [
        ("--journal", "j-{rank:03d}.jsonl", {}),
        ("--journal", "j-{rank:c}.jsonl", {}),
        ("--journal", "j-{pid:.0}.jsonl", {}),
        ("--journal", "j-{pid:>99999999999}.jsonl", {}),
        ("--journal", "DIRECTORY", {}),
        ("--journal", "x" * 250 + "-{pid}.jsonl", {}),
        ("--targets", "tensor_type,tensor_type", {}),
        ("--port", "65535", {"LOCAL_RANK": "1"}),
    ],
)
def test_settings_that_would_break_later_are_refused_before_the_command(tmp_path, option, value, env):
    marker = tmp_path / "ran"
    value = str(tmp_path) if value == "DIRECTORY" else value
    value = str(tmp_path / value) if option == "--journal" and not value.startswith("/") else value
    done = npu_shadow(
        "run", option, value, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", env={**os.environ, **env}
    )
    assert done.returncode == 2, done.stderr
    assert option in done.stderr and not marker.exists()


def test_exporters_refuse_bad_arguments_naming_them(tmp_path):
    from exporters import JsonlExporter, PrometheusExporter

    with pytest.raises(ValueError, match=r"port must be an int in 0\.\.65535"):
        PrometheusExporter(port=70000)
    for value in ("10", None, 1.5):
        with pytest.raises(ValueError, match="max_capture_bytes must be an int"):
            JsonlExporter(str(tmp_path / "j.jsonl"), max_capture_bytes=value)
    with pytest.raises(ValueError, match="path='' is not valid: empty"):
        JsonlExporter("")


def test_an_unbindable_port_loses_the_endpoint_not_the_monitor():
    from prometheus_client import CollectorRegistry

    from exporters.prometheus import serve_registry

    with pytest.warns(RuntimeWarning, match="cannot serve metrics"):
        assert serve_registry(CollectorRegistry(), 65536) is None


# --------------------------------------------------------------------------- 12. replay, verdict and report inputs


def _capture(tmp_path, **fields):
    data = {"format": 1, "target": "tensor_type", "outcome": "mismatch", "signature": "s", "detail": "d",
            "args": [torch.ones(2), torch.float16], "kwargs": {}, **fields}  # fmt: skip
    path = tmp_path / "capture.pt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # (pickling 3,000 levels needs it; loading them must not)
    try:
        torch.save(data, path)
    finally:
        sys.setrecursionlimit(limit)
    return path


def _dag_bomb(levels=40):
    node = [1]
    for _ in range(levels):
        node = [node, node]  # 2**40 leaves in a few KB
    return node


def _deep(levels=3000):
    node = []
    for _ in range(levels):
        node = [node]
    return node


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, says",
    [
        ({"args": [_dag_bomb()]}, "more than 100000 values"),
        ({"args": [_deep()]}, "nested deeper than 100"),
        ({"exact": torch.ones(3)}, "'exact' must be True or False"),
        ({"module_state": [1, 2]}, "'module_state' must be a dict of tensors"),
    ],
    ids=["dag bomb", "deep", "exact tensor", "module_state list"],
)
def test_a_malformed_capture_is_refused_quickly_with_a_usage_error(tmp_path, fields, says):
    import time

    from exporters import capture

    path = _capture(tmp_path, **fields)
    done = npu_shadow("replay", str(path), timeout=600)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    start = time.process_time()  # (this process's CPU: what a walk of the bomb would spend, whatever the load)
    with pytest.raises(ValueError, match=re.escape(says)):
        capture.load(str(path))
    assert time.process_time() - start < 10


def test_a_trickling_prometheus_is_given_up_on_within_the_timeout():
    import socket
    import threading
    import time

    from shadow.analysis import sources

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def trickle():
        connection, _ = server.accept()
        with connection:
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not stop.wait(0.5):
                try:
                    connection.sendall(b"{")
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(sources.SourceError, match="did not answer within 3 s"):
            sources.from_prometheus(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=3)
    finally:
        stop.set()
        server.close()
    assert time.monotonic() - start < 30  # (deadline: 3 s, in this process; the trickle alone takes hours)


@pytest.mark.slow
def test_the_report_survives_surrogates_and_never_passes_raw_html(tmp_path):
    import journals

    journal = tmp_path / "j.jsonl"
    line = ('{"target": "op", "outcome": "mismatch", "signature": "call", "reasons": ["value"], "pid": 1, '
            '"host": "h", "stream": "sh1", "detail": "bad \\ud800 value", '
            '"test": "tests/test_x.py::test_<!-- hidden"}\n')  # fmt: skip
    journal.write_text(json.dumps(journals.header()) + "\n" + line)
    markdown, page = tmp_path / "r.md", tmp_path / "r.html"
    done = npu_shadow("report", "--journal", str(journal), "--markdown", str(markdown), "--html", str(page))
    assert done.returncode == 0, done.stderr
    text = markdown.read_text()
    assert "<!--" not in text and "&lt;!--" in text
    assert "\\ud800" in text and "<!-- hidden" not in page.read_text()


def test_a_nul_in_a_custom_signature_keeps_the_textfile_readable(tmp_path):
    from exporters import PrometheusExporter
    from shadow.analysis import sources

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    exporter = PrometheusExporter()
    target = Target("op", ops, "op", lambda x: x * 2, signature=lambda args, kwargs: "a\x00b\nc")
    with shadow.install([target], sample_rate=1.0, exporters=[exporter]):
        ops.op(torch.ones(1))
    path = tmp_path / "tf.prom"
    exporter.write_textfile(str(path))
    counts = sources.from_exposition(sources.read_text(str(path)), str(path))
    assert counts["op"].phase().outcomes[("a?b?c", "match")] == 1.0
    with pytest.raises(ValueError, match="without control characters"):
        Target("a\x00b", ops, "op", lambda x: x)


# --------------------------------------------------------------------------- 13. settings outside torch's core


def _leak_saved_tensors_hooks():
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()


def _read_saved_tensors_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


MORE_SETTERS = {
    "mkldnn": (lambda: setattr(torch.backends.mkldnn, "enabled", False), lambda: torch.backends.mkldnn.enabled),
    "opt_einsum": (lambda: setattr(torch.backends.opt_einsum, "enabled", not torch.backends.opt_einsum.enabled),
                   lambda: torch.backends.opt_einsum.enabled),
    "mha fast path": (lambda: torch.backends.mha.set_fastpath_enabled(False), torch.backends.mha.get_fastpath_enabled),
    "warn_always": (lambda: torch.set_warn_always(True), torch.is_warn_always_enabled),
    "fill_uninitialized_memory": (lambda: setattr(torch.utils.deterministic, "fill_uninitialized_memory", False),
                                  lambda: torch.utils.deterministic.fill_uninitialized_memory),
    "autograd multithreading": (lambda: torch.autograd.set_multithreading_enabled(False),
                                torch.autograd.is_multithreading_enabled),
    "numpy errors": (lambda: __import__("numpy").seterr(all="raise"), lambda: __import__("numpy").geterr()),
    "warnings filters": (lambda: __import__("warnings").simplefilter("error"),
                         lambda: list(__import__("warnings").filters)),
    "recursion limit": (lambda: sys.setrecursionlimit(sys.getrecursionlimit() + 7), sys.getrecursionlimit),
    "device mode": (lambda: torch.device("meta").__enter__(), lambda: torch.empty(1).device),
    "saved tensors hooks": (_leak_saved_tensors_hooks, _read_saved_tensors_hooks),
}  # fmt: skip


@pytest.mark.parametrize("setting", sorted(MORE_SETTERS))
def test_settings_upstream_changes_never_reach_the_job(setting):
    change, read = MORE_SETTERS[setting]

    def upstream(x):
        change()
        return x * 2

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    before = read()
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(torch.ones(2))
        assert read() == before
    stats = monitor.stats()["op"]
    assert (stats.mismatch, stats.by_reason) == (1, {"state": 1})  # and upstream's difference is seen


def test_upstream_turning_off_requires_grad_never_reaches_the_callers_parameters():
    def upstream(module, x):
        for parameter in module.parameters():
            parameter.requires_grad_(False)
        return module(x)

    module = torch.nn.Linear(3, 3)
    ops = types.SimpleNamespace(op=lambda m, x: m(x))
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(module, torch.ones(2, 3))
    assert all(p.requires_grad for p in module.parameters())
    assert monitor.stats()["op"].by_reason == {"requires_grad": 1}


def test_a_setting_that_cannot_be_put_back_is_counted_and_the_others_still_are(monkeypatch):
    from shadow.core.runs import global_state

    def refuse(value):
        raise RuntimeError("cannot write threads")

    monkeypatch.setitem(
        global_state.SETTINGS, "threads", global_state.Setting("threads", torch.get_num_threads, refuse)
    )
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()

    def upstream(x):
        torch.set_num_threads(threads + 1)
        torch.set_default_dtype(torch.float64)
        return x * 2

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    try:
        # (the intra-op threads are the thread's own: the caller's differ from a fresh thread's, so each upstream
        # run's start has to write them)
        fresh: list[int] = []
        probe = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        probe.start()
        probe.join()
        torch.set_num_threads(fresh[0] + 3)
        with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
            first = ops.op(torch.ones(1))
            assert torch.get_default_dtype() == dtype  # put back although threads could not be
            second = ops.op(torch.ones(1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, second) and first.dtype == torch.float32
    stats = monitor.stats()["op"]
    assert stats.calls == stats.sampled == stats.mismatch == 2  # still compared: upstream left settings changed
    assert stats.settings_failures >= 1 and "comparator" not in stats.by_reason
