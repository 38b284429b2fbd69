"""What a user sees is true: labels on the side the caller got, signatures that count what runs, the commands'
own help."""

from __future__ import annotations

import re
import shutil
import types
import warnings

import pytest
import torch
from commands import npu_shadow
from fakes import Recorder
from metrics_helpers import without_run
from prometheus_client import generate_latest
from torch import nn

import shadow
from exporters import PrometheusExporter
from shadow.core.calls.sampled.drill import Drill
from shadow.core.model.targets import data_parallel_signature


def test_in_a_canary_skipped_calls_name_upstream_as_the_side_returned():
    """A call skipped for its module's hooks returned upstream's result in a canary: its skip says so."""
    ops = types.SimpleNamespace(op=lambda module, x: module(x))
    model = nn.Linear(2, 2)
    model.register_forward_hook(lambda m, i, o: None)
    exporter = PrometheusExporter()
    target = shadow.Target("op", ops, "op", lambda module, x: module(x))
    with shadow.install([target], sample_rate=1.0, primary="upstream", exporters=[exporter]) as monitor:
        ops.op(model, torch.ones(1, 2))
        assert monitor.stats()["op"].by_reason == {"hooks": 1}
    text = without_run(generate_latest(exporter.registry).decode())
    assert 'npu_shadow_skipped_total{primary="upstream",reason="hooks",signature="",target="op"} 1.0' in text


def test_data_parallels_signature_counts_the_replicas_that_run():
    """A batch of one on [1, 0] runs one replica (scatter cuts no more chunks than rows): the risky replicas=1."""
    model = nn.Linear(2, 2)
    assert data_parallel_signature((model, torch.ones(1, 2), [1, 0]), {}).startswith("replicas=1/")
    assert data_parallel_signature((model, torch.ones(4, 2), [1, 0]), {}).startswith("replicas=2+/")
    assert data_parallel_signature((model, torch.ones(4, 1), [1, 0]), {"dim": 1}).startswith("replicas=1/")
    assert data_parallel_signature((model, (torch.ones(3, 2),), [0]), {}).startswith("replicas=1/")


def _npu_shadow(*args: str) -> str:
    """What the command prints for these arguments (in this process: --help and --version exit)."""
    import contextlib
    import io

    import pytest

    from shadow.launcher import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    assert exited.value.code == 0
    return out.getvalue()


def test_the_command_says_its_version_and_each_subcommand_its_defaults():
    from importlib.metadata import version

    assert _npu_shadow("--version").strip() == f"npu-shadow {version('npu-shadow')}"
    verdict = _npu_shadow("verdict", "--help")
    for shown in ("(default: 0.001)", "(default: 30)", "(default: 60.0)", "(default: table)"):
        assert shown in verdict, shown
    assert "(default: 127.0.0.1:9095)" in _npu_shadow("receiver", "--help")
    assert "(default: npu-shadow-tests.jsonl)" in _npu_shadow("ab", "--help")
    for command in ("replay", "run", "doctor", "verdict", "ab", "receiver", "report"):
        _, _, rest = _npu_shadow(command, "--help").partition("\n\n")
        assert rest.strip() and not rest.startswith(("positional arguments", "options")), command  # a description


def test_the_docs_never_suggest_an_unpinned_install():
    """Every `pip install` of this project in the docs comes after torch is pinned."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        assert "a regular `pip install` works" not in text, page
        for found in re.finditer(r"pip install (?:-e )?\.", text):
            assert "torch==2.13.0" in text[max(0, found.start() - 300) : found.start()], (page, found.group())


IMPORTS_SHADOW_FIRST = """
import shadow  # before torch
import torch
assert torch.accelerator.current_accelerator().type == "npu"  # --emulate-npu applied
for _ in range(3):
    torch.ones(2).type(torch.float64)
print(sorted(shadow.BUILTINS))
"""


@pytest.mark.slow
def test_a_job_that_imports_shadow_before_torch_is_shadowed(tmp_path):
    """`import shadow` first under the launcher: installed (no circular import), the emulated npu applied, and
    the calls counted in the exit summary."""
    import subprocess
    import sys

    from torch_npu_wheels import wheel

    done = subprocess.run(
        [sys.executable, "-m", "shadow", "run", "--sample-rate", "1", "--budget", "off", "--emulate-npu", "2",
         "--legacy-from", wheel("2.12.0"), "--", sys.executable, "-c", IMPORTS_SHADOW_FIRST],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "npu-shadow: not installed" not in done.stderr and "circular import" not in done.stderr
    summary = next(line for line in done.stderr.splitlines() if line.startswith("tensor_type"))
    assert summary.split()[1] == "3", summary  # three calls


def test_the_canary_demos_watcher_sees_a_hard_mismatch_whatever_the_labels():
    """Its pattern predated the primary label, so the canary drill never rolled back."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "demo_watcher.py"
    spec = importlib.util.spec_from_file_location("demo_watcher", path)
    watcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(watcher)
    from shadow.core.model import contract
    from shadow.core.model.observation import Observation

    exporter = PrometheusExporter()
    exporter.record(contract.registered_samples("tensor_type", 1.0))
    assert watcher.hard_mismatch(generate_latest(exporter.registry).decode()) is None  # (zeros)
    exporter.record(contract.primary_samples("tensor_type", "upstream"))
    mismatch = Observation("tensor_type", "mismatch", ("dtype",), signature="s", primary="upstream")
    exporter.record(contract.observation_samples(mismatch))
    assert watcher.hard_mismatch(generate_latest(exporter.registry).decode()) == ("dtype", "tensor_type")


class _ChecksItsReplica(nn.Module):
    """PyTorch's test_parameter_list_dict_replica (test/distributed/test_data_parallel.py), cuda -> npu: a
    forward that asserts what real DataParallel replicas hold (broadcast parameters: non-leaf, with a grad_fn)."""

    def __init__(self, data, check_fn):
        super().__init__()
        self.data = data
        self.check_fn = check_fn

    def forward(self, inp):
        self.check_fn(self)
        return inp


def test_pytorchs_parameter_list_dict_replica_holds_on_the_shadow_side(legacy_patches):
    p1 = nn.Parameter(torch.rand(10))
    p2 = nn.Parameter(torch.rand(10))
    checked = []

    def check_fn(self_, key0, key1):
        torch.testing.assert_close(self_.data[key0], p1.to(self_.data[key0].device))
        torch.testing.assert_close(self_.data[key1], p2.to(self_.data[key1].device))
        assert self_.data[key0].requires_grad and self_.data[key1].requires_grad
        assert self_.data[key0].grad_fn is not None and self_.data[key1].grad_fn is not None
        checked.append(self_)

    exporter = Recorder()
    containers = ((nn.ParameterList([p1, p2]), (0, 1)), (nn.ParameterDict({"0": p1, "1": p2}), ("0", "1")))
    targets = ["parallel_apply", "data_parallel"]
    with shadow.install(targets, sample_rate=1.0, oracle=None, exporters=[exporter]) as monitor:
        for container, keys in containers:
            module = _ChecksItsReplica(container, lambda m, keys=keys: check_fn(m, *keys)).to("npu:0")
            model = nn.DataParallel(module, device_ids=[0, 1])
            model(torch.randn((8, 8), device="npu:0"))
        stats = monitor.stats()["parallel_apply"]
    outcomes = [(o.outcome, o.detail) for o in exporter.observations]
    assert outcomes == [("match", "")] * 2, outcomes
    assert (stats.match, stats.compared) == (2, 2)
    assert len(checked) == 2 * 2 * 2  # two containers, two replicas, legacy and upstream
    assert p1.grad is None and p2.grad is None


def test_a_filter_written_by_legacys_first_import_is_no_difference(tmp_path, monkeypatch):
    """Legacy's first call imports a module that writes a warning filter at import (sympy does): upstream, run
    from the state before the call, finds it imported and cannot write it again. A filter the call itself writes
    is still a difference."""
    (tmp_path / "writes_a_filter_once.py").write_text(
        "import warnings\nwarnings.filterwarnings('once', category=FutureWarning, module='writes_a_filter_once')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def legacy(x):
        import writes_a_filter_once  # noqa: F401

        return x + 1

    def writes_a_filter(x):
        warnings.filterwarnings("ignore", message="written by the call")
        return x + 1

    ops = types.SimpleNamespace(op=legacy, other=writes_a_filter)
    exporter = Recorder()
    targets = [shadow.Target("op", ops, "op", lambda x: x + 1), shadow.Target("other", ops, "other", lambda x: x + 1)]
    with warnings.catch_warnings(), shadow.install(targets, sample_rate=1.0, exporters=[exporter]):
        ops.op(torch.ones(2))
        ops.op(torch.ones(2))
        ops.other(torch.ones(2))
    assert [(o.target, o.outcome) for o in exporter.observations] == [
        ("op", "match"),
        ("op", "match"),
        ("other", "mismatch"),
    ]
    assert "warning filters" in exporter.observations[2].detail


def _drilled(kind, fn, *args):
    ops = types.SimpleNamespace(op=fn)
    exporter = Recorder()
    with shadow.install(
        [shadow.Target("op", ops, "op", fn)], sample_rate=1.0, exporters=[exporter], drill=Drill(kind, 1.0)
    ):
        ops.op(*args)
    (observation,) = exporter.observations
    return observation


def test_a_drill_injects_only_its_own_kind():
    x = torch.randn(3, 4, requires_grad=True)
    value = _drilled("value", lambda t: (t * 2, t.t() * 3), x)  # outputs that require grad, one transposed
    assert (value.outcome, value.reasons, value.drill) == ("mismatch", ("value",), True), value.detail
    nan = _drilled("nan", lambda t: t * 2, x)
    assert (nan.outcome, nan.reasons, nan.drill) == ("mismatch", ("nan",), True), nan.detail
    dtype = _drilled("dtype", lambda t: t * 2, x)
    assert (dtype.outcome, dtype.reasons, dtype.drill) == ("mismatch", ("dtype",), True), dtype.detail
    flags = _drilled("value", lambda t: t > 0, torch.tensor([True, False]))
    assert (flags.outcome, flags.reasons) == ("mismatch", ("value",))
    shared = _drilled("value", lambda t: (t + 1,) * 2, torch.ones(2))  # one tensor returned twice stays one
    assert (shared.outcome, shared.reasons) == ("mismatch", ("value",)), shared.detail


def test_a_drilled_difference_is_decided_at_once_even_where_the_noise_floor_has_no_runs_yet():
    """With A/A runs on, a value difference waits for the noise floor's ten runs (reason noise_pending where they
    never come): `--drill value:1.0` on a DataParallel job compared none of its calls. A drill's difference is the
    monitor's own: a mismatch at once, and never part of the floor's sample."""
    ops = types.SimpleNamespace(op=lambda t: t * 2)
    exporter = Recorder()
    target = shadow.Target("op", ops, "op", lambda t: t * 2)
    with shadow.install([target], sample_rate=1.0, exporters=[exporter], drill=Drill("value", 1.0), aa_rate=0.5,
                        seed=1) as monitor:  # fmt: skip
        for _ in range(4):
            ops.op(torch.randn(8))
    stats = monitor.stats()["op"]
    assert (stats.mismatch, stats.skipped, stats.noise, stats.drilled) == (4, 0, 0, 4), stats
    assert {(o.outcome, o.reasons, o.drill) for o in exporter.observations} == {("mismatch", ("value",), True)}
    assert not any(o.noise_check for o in exporter.observations), "a drill's difference was judged against noise"


def test_a_drill_that_cannot_inject_its_kind_injects_nothing():
    """An output that aliases an argument cannot be changed without writing the argument; a nan has no place in
    an integer tensor: the call compares as it is and is not counted as drilled."""
    same = _drilled("value", lambda t: t, torch.ones(2))
    assert (same.outcome, same.drill) == ("match", False), same.detail
    integers = _drilled("nan", lambda t: t + 1, torch.arange(3))
    assert (integers.outcome, integers.drill) == ("match", False), integers.detail


def test_the_report_marks_the_rows_a_drill_made(tmp_path):
    import journals

    from shadow.analysis import report

    lines = [journals.line("mismatch", drill=True, reasons=["value"]), journals.line("mismatch", reasons=["value"])]
    evidence = report.collect([str(journals.write(tmp_path / "j.jsonl", lines))])
    outcomes = sorted(outcome for (_, _, outcome, _) in evidence.groups)
    assert outcomes == ["mismatch", "mismatch (fire drill)"]


CASTS = "import torch\nx = torch.ones(2)\nfor _ in range(5):\n    x.type(torch.float16)\n"


@pytest.mark.slow
def test_run_and_doctor_agree_on_a_host_without_torch_npu(tmp_path):
    """Without torch_npu and without --legacy-from, run shadows nothing and doctor says so; --legacy-from
    reference rehearses on shadow.npu.reference in both."""
    import sys

    def succeeds(*args):
        done = npu_shadow(*args, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    bare = succeeds("run", "--sample-rate", "1", "--budget", "off", "--", sys.executable, "-c", CASTS)
    assert "(no target installed: no active legacy patch in this process)" in bare.stderr
    rehearsal = succeeds(
        "run", "--legacy-from", "reference", "--sample-rate", "1", "--budget", "off", "--", sys.executable, "-c", CASTS
    )
    line = next(line for line in rehearsal.stderr.splitlines() if line.startswith("tensor_type"))
    assert line.split()[1:4] == ["5", "5", "5"], rehearsal.stderr  # calls, sampled, match
    assert "npu-shadow legacy: reference" in rehearsal.stderr

    doctor = succeeds("doctor", "--port", "0")
    assert doctor.stdout.rstrip().endswith("npu-shadow run without it shadows nothing here")
    doctor = succeeds("doctor", "--port", "0", "--legacy-from", "reference")
    assert "legacy: shadow.npu.reference (--legacy-from reference: a rehearsal" in doctor.stdout
    assert doctor.stdout.rstrip().endswith(
        "ok: this host can rehearse shadowing on shadow.npu.reference (--legacy-from reference)"
    )


@pytest.mark.slow
def test_a_plugin_value_apart_from_its_option_is_refused_by_pytest_and_joined_by_ab(tmp_path):
    """pytest chooses its rootdir before it knows the plugin's options: ``--npu-shadow-journal PATH`` (space form)
    would make PATH's directory the rootdir and drop the suite's own config."""
    import subprocess
    import sys

    from shadow.launcher.ab import joined

    suite, elsewhere = tmp_path / "suite", tmp_path / "elsewhere"
    (suite / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    suites_own: a marker only this config declares\n")
    (suite / "sub" / "test_one.py").write_text("import pytest\n\n@pytest.mark.suites_own\ndef test_one():\n    pass\n")
    journal = elsewhere / "journal.jsonl"
    journal.write_text("")

    def pytest_in_suite(*args):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", *args],
            capture_output=True, text=True, cwd=suite, timeout=120,
        )  # fmt: skip

    apart = pytest_in_suite("--npu-shadow-journal", str(journal))
    assert apart.returncode == 4, apart.stdout + apart.stderr
    assert f"--npu-shadow-journal {journal}: pytest took" in apart.stderr
    assert f"write --npu-shadow-journal={journal}" in apart.stderr
    together = pytest_in_suite(f"--npu-shadow-journal={journal}")
    assert together.returncode == 0 and f"rootdir: {suite}" in together.stdout, together.stdout + together.stderr

    assert joined(["tests/", "--npu-shadow-legacy-from", "W.whl", "-k", "x", "--npu-shadow-emulate-npu", "2"]) == [
        "tests/", "--npu-shadow-legacy-from=W.whl", "-k", "x", "--npu-shadow-emulate-npu=2"
    ]  # fmt: skip
    assert joined(["--npu-shadow-targets=tensor_type", "--", "--npu-shadow-journal", "j"]) == [
        "--npu-shadow-targets=tensor_type", "--", "--npu-shadow-journal", "j"
    ]  # fmt: skip


def _replay(path):

    return npu_shadow("replay", str(path), timeout=600)


@pytest.mark.slow
def test_an_npu_capture_replays_on_the_emulated_npu_as_it_was_recorded(tmp_path):
    """Captures taken on npu:1 (this process has the emulated npu): a fresh replay process has no npu of its own."""
    base = {"format": 1, "target": "tensor_type", "outcome": "match", "signature": "s", "detail": "", "kwargs": {}}
    on_npu = {**base, "args": [torch.ones(3, device="npu:1"), "torch.npu.HalfTensor"], "device": "npu:1"}
    by_class = {**base, "args": [torch.ones(3), {"class": "torch.npu:HalfTensor"}], "device": "npu:1"}
    for name, data in (("on_npu", on_npu), ("by_class", by_class)):
        torch.save(data, tmp_path / f"{name}.pt")
        done = _replay(tmp_path / f"{name}.pt")
        assert done.returncode == 0, name + ": " + done.stdout + done.stderr
        assert "replayed: match" in done.stdout, name + ": " + done.stdout
        assert "on the emulated npu (2 devices), current device npu:1" in done.stdout, done.stdout


def test_a_capture_records_the_current_device(tmp_path):
    from exporters import JsonlExporter, capture

    ops = types.SimpleNamespace(op=lambda x: x + 1)
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(tmp_path / "captures"))
    target = shadow.Target("op", ops, "op", lambda x: x + 2)
    with shadow.install([target], sample_rate=1.0, exporters=[journal]), torch.accelerator.device_index(1):
        ops.op(torch.ones(2, device="npu:1"))
    journal.close()
    (path,) = (tmp_path / "captures").iterdir()
    assert capture.load(str(path))["device"] == "npu:1"


WORKERS_JOB = """
import torch
from torch.utils.data import DataLoader, Dataset

class Casts(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.full((2,), float(index)).type(torch.float16)  # in a worker process

if __name__ == "__main__":
    for batch in DataLoader(Casts(), batch_size=2, num_workers=2, multiprocessing_context="fork"):
        batch.type(torch.float32)  # in the job's main process
"""


@pytest.mark.slow
def test_the_exit_summary_covers_the_workers_or_says_it_does_not(tmp_path):
    import sys

    from metrics_helpers import samples, total

    job = tmp_path / "job.py"
    job.write_text(WORKERS_JOB)
    common = ["run", "--legacy-from", "reference", "--sample-rate", "1", "--budget", "off"]

    def run(*options):
        done = npu_shadow(*common, *options, "--", sys.executable, str(job), timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr

    textfile = tmp_path / "metrics.prom"
    with_metrics = run("--textfile", str(textfile))
    calls = total(samples(textfile.read_text()), "npu_shadow_calls_total", target="tensor_type")
    assert calls == 8 + 4  # 8 casts in the workers, 4 in the main process
    own = next(line for line in with_metrics.splitlines() if line.startswith("tensor_type"))
    assert own.split()[1] == "4"
    assert "npu-shadow job: 3 processes shared these metrics" in with_metrics, with_metrics
    job_line = next(line for line in with_metrics.split("npu-shadow job:")[1].splitlines() if "tensor_type" in line)
    assert job_line.split()[:5] == ["tensor_type", "12", "calls,", "12", "compared,"], with_metrics

    without_metrics = run()
    assert "(this process only: it forked 2 processes" in without_metrics, without_metrics


@pytest.mark.slow
def test_every_skip_reason_is_named_in_the_summary():
    import subprocess
    import sys

    model = "import torch\nm = torch.nn.Linear(2, 2)\nm.register_forward_hook(lambda *a: None)\n"
    calls = "ops = __import__('types').SimpleNamespace(op=lambda m, x: m(x))\n"
    job = CASTS + "import shadow\n" + model + calls + (
        "t = shadow.Target('op', ops, 'op', lambda m, x: m(x))\n"
        "with shadow.install([t], sample_rate=1.0) as monitor:\n"
        "    ops.op(m, torch.ones(1, 2))\n"
        "import shadow.launcher.launch\n"
        "print(shadow.launcher.launch.summary(monitor.stats()))\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 for hooks: a module in the call has user hooks" in done.stdout, done.stdout


def test_the_emulated_npus_first_build_says_what_it_is_doing(tmp_path, monkeypatch, capsys):
    from shadow.npu import emulated

    monkeypatch.setenv("NPU_SHADOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(emulated, "_compile", lambda w: (w / f"{emulated.EXTENSION_NAME}.so").write_bytes(b"built"))
    emulated._build(emulated.build_directory())
    said = capsys.readouterr().err
    assert "npu-shadow: building the emulated npu into" in said and "about 25 s on 2 idle cores" in said
    assert "npu-shadow: emulated npu built in" in said
    emulated._build(emulated.build_directory())  # built: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_the_receiver_says_it_listens_before_torch_could_load():
    """The receiver needs no torch: it listens within a few seconds even where importing torch takes many."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import sys, runpy\n"
        "sys.modules['torch'] = None  # (an import of torch would raise)\n"
        "sys.argv = ['npu-shadow', 'receiver', '--listen', sys.argv[1], '--switch', 'job=http://127.0.0.1:9']\n"
        "runpy.run_module('shadow', run_name='__main__')\n"
    )
    env = dict(__import__("os").environ, NPU_SHADOW_ROLLBACK_TOKEN="t" * 32, NPU_SHADOW_RECEIVER_TOKEN="r" * 32)
    receiver = subprocess.Popen(
        [sys.executable, "-c", code, f"127.0.0.1:{port}"], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        first = receiver.stderr.readline()
        assert first.startswith(f"npu-shadow receiver: listening on http://127.0.0.1:{port}/alerts"), first
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)


def test_setup_says_what_it_installs_when_it_installs():
    import pathlib

    setup = (pathlib.Path(__file__).parent.parent / "scripts" / "setup.sh").read_text()
    torch_line = next(i for i, line in enumerate(setup.splitlines()) if "pip install -q torch==" in line)
    assert "installing torch 2.13.0" in setup.splitlines()[torch_line - 1]
    assert "installing npu-shadow" in setup


MEASURE = """
<script>
const found = [];
document.querySelectorAll("svg").forEach((svg, chart) => {
  const frame = svg.getBoundingClientRect();
  const boxes = [...svg.querySelectorAll(":scope > text")].map(t => [t.textContent, t.getBoundingClientRect()]);
  boxes.forEach(([text, b]) => {
    if (b.left < frame.left - 0.5 || b.right > frame.right + 0.5 || b.top < frame.top - 0.5 ||
        b.bottom > frame.bottom + 0.5) found.push(`chart ${chart}: "${text}" leaves the picture`);
  });
  boxes.forEach(([a, p], i) => boxes.slice(i + 1).forEach(([b, q]) => {
    const x = Math.min(p.right, q.right) - Math.max(p.left, q.left);
    const y = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
    if (x > 0.5 && y > 0.5) found.push(`chart ${chart}: "${a}" overlaps "${b}"`);
  }));
});
const out = document.createElement("pre");
out.id = "layout";
out.textContent = JSON.stringify({charts: document.querySelectorAll("svg").length, found});
document.body.appendChild(out);
</script>
"""


def _layout_journal(path, drill_rate):
    import journals

    records = []
    start = 1_790_000_000.0
    for minute in range(45):  # a drill or a canary: a divergence rate far above every threshold
        compared = 40 * (minute + 1)
        divergent = int(compared * drill_rate)
        by_signature = {"dtype=float16/float32/contiguous": {"match": compared - divergent, "mismatch": divergent}}
        records.append(journals.counts(by_signature, target="tensor_type", timestamp=start + 60 * minute))
    long_signatures = [
        "replicas=2+/autocast=on/dtype=float16/kwargs=none/module=TransformerEncoderLayer",
        "replicas=1/autocast=off/dtype=bfloat16/kwargs=dict/module=ResNet",
        "dtype=float16/float32/non-contiguous/blocking",
    ]
    for i, signature in enumerate(long_signatures):
        for _ in range(3):
            records.append(journals.line("match", "parallel_apply", signature, timestamp=start + i, aa=True,
                                         aa_abs_error=10.0 ** -(3 * i + 2), numel=8))  # fmt: skip
    for exponent in range(-12, 7):  # every decade of the error histogram
        records.append(journals.line("close", "tensor_type", "dtype=float16/float32/contiguous", timestamp=start,
                                     max_abs_error=10.0**exponent, numel=4))  # fmt: skip
    return journals.write(path, records)


def _chart_problems(tmp_path, page):
    import json
    import os
    import re
    import subprocess

    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    probe = tmp_path / "probe.html"
    probe.write_text("<!doctype html><html><body>" + "".join(svgs) + MEASURE + "</body></html>")
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip
    result = re.search(r'<pre id="layout">(.*?)</pre>', done.stdout, flags=re.S)
    assert result, done.stderr[-2000:]
    measured = json.loads(result.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert measured["charts"] == len(svgs)
    return measured["found"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (the test command installs it)")
@pytest.mark.parametrize("rate", [0.5, 0.002], ids=["drill", "near-thresholds"])
def test_no_chart_text_overlaps_or_leaves_its_picture_in_chromium(tmp_path, rate):
    from shadow.launcher import cli

    journal = _layout_journal(tmp_path / "j.jsonl", rate)
    page = tmp_path / "report.html"
    assert (
        cli.main(["report", "--journal", str(journal), "--markdown", str(tmp_path / "r.md"), "--html", str(page)]) == 0
    )
    text = page.read_text()
    assert text.count("<svg") == 4
    assert _chart_problems(tmp_path, text) == []
    rate_chart = re.search(r"<svg.*?</svg>", text, flags=re.S).group(0)
    assert ">time (UTC)" in rate_chart and re.search(r">\d\d:\d\d</text>", rate_chart)  # a time axis
    histogram = next(s for s in re.findall(r"<svg.*?</svg>", text, flags=re.S) if "Greatest absolute error" in s)
    assert ">comparisons</text>" in histogram and ">greatest absolute error" in histogram  # axis titles


def test_the_reports_environment_comes_from_the_metrics_build_info(tmp_path):
    from shadow.launcher import cli

    exporter = PrometheusExporter()
    with shadow.install(
        [shadow.Target("op", types.SimpleNamespace(op=lambda x: x), "op", lambda x: x)],
        sample_rate=1.0,
        exporters=[exporter],
    ):
        pass
    metrics = tmp_path / "metrics.prom"
    exporter.write_textfile(str(metrics))
    out = tmp_path / "r.md"
    assert cli.main(["report", "--metrics-file", str(metrics), "--markdown", str(out)]) == 0
    text = out.read_text()
    assert f"| torch | {torch.__version__} |" in text, text
    assert "| torch_npu | none |" in text and "| npu-shadow | 0." in text


def test_no_test_bounds_the_wall_clock_time_of_what_it_starts():
    """A bound on wall-clock time fails on a busy machine (interpreters start slowly there): tests wait for
    conditions, and measure durations where the code measures them (a line it prints, CPU time). Only a bound on
    an in-process deadline of the code under test may read the clock, saying so."""
    import pathlib

    clocks = re.compile(r"\b(time\.monotonic|time\.perf_counter|time\.time|monotonic|perf_counter)\(\)\s*-")
    found = []
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            names = re.findall(r"(\w+) = [\w.]*(?:monotonic|perf_counter|time)\(\) - ", line)
            if "# (deadline:" in line:
                continue
            if (line.lstrip().startswith("assert") and clocks.search(line)) or names:
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert found == []
