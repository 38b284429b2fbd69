"""Which of a release's function patches a job calls: counted where each function starts
(shadow.core.calls.patch_calls, on sys.monitoring), the function at every place left itself, the job's calls only,
carried by every exporter. Where this Python has no sys.monitoring (3.10, 3.11) nothing is counted and every
place says why; the counting itself is then checked by a newer Python found on the machine
(tests/patch_calls_mechanism.py)."""

from __future__ import annotations

import glob
import inspect
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import types

import pytest
import torch
from commands import npu_shadow

import shadow
from exporters import JsonlExporter, PrometheusExporter
from shadow.core.calls import patch_calls

#: Whether this Python counts (sys.monitoring): each count test says what this interpreter must do.
COUNTS = patch_calls.STARTS is not None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def counted_ops(monkeypatch):
    """A module of the job's (``counted_ops``) with a function a test counts and shadows."""
    module = types.ModuleType("counted_ops")
    module.op = lambda x: x * 2
    monkeypatch.setitem(sys.modules, "counted_ops", module)
    return module


def _newer_python() -> str:
    """A Python 3.12+ on this machine (on PATH, or pyenv's), for the counting mechanism where this one has no
    sys.monitoring. Skips where there is none; under CI (CI=true) fails instead."""
    if sys.version_info >= (3, 12):
        return sys.executable
    candidates = [shutil.which(f"python3.{minor}") for minor in range(20, 11, -1)]
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", "3.1[2-9]*", "bin", "python3")), reverse=True)
    for candidate in filter(None, candidates):
        found = subprocess.run([candidate, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        if found.stdout.strip() == "True":
            return candidate
    why = "no Python 3.12+ on this machine: the patch call counter's mechanism (sys.monitoring) was not run"
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


@pytest.mark.slow
def test_the_counting_mechanism_keeps_each_function_itself_and_counts_the_jobs_calls_only():
    """On a Python with sys.monitoring, without torch: identity, pickling, signature, code and recursion headroom
    unchanged; the job's calls counted, the shadow side's and the tool's own not; each closure of a factory its own;
    a forked child from zero; everything as it was after uninstalling."""
    done = subprocess.run([_newer_python(), os.path.join(ROOT, "tests", "patch_calls_mechanism.py")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def _places(names):
    """What the job sees at every reachable place of ``names``: the object there, its identity, hash, pickle,
    signature and code (an exception's type where one of those raises)."""

    def attempt(read):
        try:
            return read()
        except Exception as exc:
            return type(exc).__name__

    seen = {}
    for name in names:
        place = patch_calls._place(name)
        if place is None:
            continue
        raw = inspect.getattr_static(*place, None)
        value = attempt(lambda place=place: getattr(*place))
        code = getattr(value, "__code__", None)
        seen[name] = (
            id(raw), id(getattr(value, "__func__", value)), attempt(lambda v=value: hash(v)),
            attempt(lambda v=value: pickle.dumps(v)), attempt(lambda v=value: str(inspect.signature(v))),
            getattr(code, "co_code", None),
            getattr(code, "co_filename", None), getattr(code, "co_firstlineno", None),
        )  # fmt: skip
    return seen


@pytest.mark.parametrize("release", ["2.13.0", "2.14.0"])
def test_every_place_a_release_counts_stays_itself(release):
    """Every function patch of the release (its census' list, not a hand-picked few), with the job's modules and
    torch's compilers imported: the object at each place, its identity, hash, pickle, signature and code are what
    they are without counters, while counting and after. What cannot be counted here says why."""
    import torch._dynamo
    import torch.utils.data  # noqa: F401
    from torch_npu_wheels import wheel

    from shadow.analysis import census_cache

    names = json.loads(census_cache.patch_list(wheel(release)).read_text())["patches"]
    before = _places(names)
    assert len(before) > 20, before  # (most of them are reachable in this process)
    with shadow.install([], count_patches=names) as monitor:
        assert _places(names) == before
        uncounted = monitor.patches_uncounted()
        counted = monitor.patch_calls.counted
    assert _places(names) == before
    assert set(counted) | set(uncounted) <= set(before)
    if COUNTS:
        assert counted and set(uncounted.values()) <= {patch_calls.C_FUNCTION}, uncounted
    else:
        assert not counted and uncounted and set(uncounted.values()) <= {patch_calls.NO_MONITORING,
                                                                          patch_calls.C_FUNCTION}  # fmt: skip


class _Scripted(torch.nn.Module):
    """A model TorchScript compiles through F.embedding, F.layer_norm and torch.matmul (places 2.14.0 counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embedding(tokens))
        return torch.matmul(hidden, hidden.transpose(0, 1))


def _attention(x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, x.t()).softmax(-1)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_model_trains_under_the_counters_of_214_as_unwrapped():
    """A job that scripts a model with LayerNorm and Embedding (and a function calling torch.matmul) under 2.14.0's
    counters: it scripts, and trains bitwise as it does unwatched."""
    from torch_npu_wheels import wheel

    from shadow.analysis import census_cache

    names = json.loads(census_cache.patch_list(wheel("2.14.0")).read_text())["patches"]

    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.jit.script(_Scripted())
        scripted_fn = torch.jit.script(_attention)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.tensor([1, 2, 3])
        for _ in range(3):
            loss = model(tokens).sum() + scripted_fn(torch.ones(2, 2)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    with shadow.install([], count_patches=names):  # (first: TorchScript keeps what it compiled, by class)
        watched = train()
    unwatched = train()
    assert all(torch.equal(a, b) for a, b in zip(unwatched, watched, strict=True))


def test_the_jobs_calls_of_each_place_are_counted_and_every_place_is_put_back():
    places = {
        "torch.serialization._save": torch.serialization._save,
        "torch.Tensor.__repr__": inspect.getattr_static(torch.Tensor, "__repr__"),
        "torch.storage.UntypedStorage.cpu": inspect.getattr_static(torch.UntypedStorage, "cpu"),
    }
    names = [*places, "torch.not_a_module.save", "torch._dynamo.eval_frame.innermost_fn", "torch.matmul"]
    with shadow.install([], count_patches=names) as monitor:
        tensor = torch.ones(3)
        for _ in range(3):
            repr(tensor)
        torch.save(tensor, io.BytesIO())  # (torch.save reaches the _save place, as it does on an NPU host)
        tensor.untyped_storage().cpu()
        if COUNTS:  # (unreachable and compile-time places left alone; a C function cannot be counted)
            assert monitor.patch_calls.counted == tuple(places)
            assert monitor.patches_uncounted() == {"torch.matmul": patch_calls.C_FUNCTION}
            assert monitor.patch_counts() == {
                "torch.serialization._save": 1, "torch.Tensor.__repr__": 3, "torch.storage.UntypedStorage.cpu": 1,
            }  # fmt: skip
        else:
            assert monitor.patch_calls.counted == () and monitor.patch_counts() == {}
            assert monitor.patches_uncounted() == {
                **dict.fromkeys(places, patch_calls.NO_MONITORING), "torch.matmul": patch_calls.C_FUNCTION,
            }  # fmt: skip
    assert torch.serialization._save is places["torch.serialization._save"]
    assert inspect.getattr_static(torch.Tensor, "__repr__") is places["torch.Tensor.__repr__"]
    assert inspect.getattr_static(torch.UntypedStorage, "cpu") is places["torch.storage.UntypedStorage.cpu"]


def test_the_shadow_sides_calls_are_not_the_jobs(counted_ops):
    """Upstream's run and the A/A run call the counted place too: only the job's own calls count."""

    def legacy(x):
        return counted_ops.op(x) + 1

    def upstream(x):
        return counted_ops.op(x) + 1

    ops = types.SimpleNamespace(step=legacy)
    target = shadow.Target("step", ops, "step", upstream)
    with shadow.install([target], sample_rate=1.0, aa_rate=1.0, budget=None, count_patches=["counted_ops.op"]) as m:
        for _ in range(20):
            ops.step(torch.ones(2))
        assert m.stats()["step"].compared == 20
        expected = {"counted_ops.op": 20} if COUNTS else {}  # (not 60: upstream's and the A/A run's are not counted)
        assert m.patch_counts() == expected


def test_a_place_a_target_shadows_counts_each_call_once(counted_ops):
    target = shadow.Target("op", counted_ops, "op", lambda x: x * 2)
    with shadow.install([target], sample_rate=1.0, budget=None, count_patches=["counted_ops.op"]) as monitor:
        for _ in range(10):
            counted_ops.op(torch.ones(2))
        assert monitor.stats()["op"].compared == 10
        assert monitor.patch_counts() == ({"counted_ops.op": 10} if COUNTS else {})


def test_the_counts_reach_the_metrics_and_the_journal(tmp_path):
    """What is counted reaches every source; where this Python counts nothing, no source holds a count."""
    from prometheus_client import CollectorRegistry, generate_latest

    from shadow.analysis.sources import JournalReader, patch_calls

    registry, journal = CollectorRegistry(), tmp_path / "j.jsonl"
    exporters = [PrometheusExporter(registry=registry), JsonlExporter(str(journal))]
    with shadow.install([], exporters=exporters, count_patches=["torch.Tensor.__repr__"]):
        for _ in range(4):
            repr(torch.zeros(1))
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith("npu_shadow_patch_calls_total{")]  # fmt: skip
    if not COUNTS:
        assert lines == [] and (not journal.exists() or '"patch_calls"' not in journal.read_text())
        return
    records = [json.loads(line) for line in journal.read_text().splitlines() if '"patch_calls"' in line]
    reader = JournalReader()
    reader.read([str(journal)])
    (line,) = lines
    assert 'patch="torch.Tensor.__repr__"' in line and line.endswith(" 4.0")
    assert records[-1]["calls"] == {"torch.Tensor.__repr__": 4}
    assert patch_calls(reader) == {"torch.Tensor.__repr__": 4}


def test_count_patches_must_be_dotted_names():
    with pytest.raises(ValueError, match="count_patches: expected dotted names"):
        shadow.install([], count_patches="torch.save")


@pytest.mark.slow
@pytest.mark.e2e
def test_a_job_under_the_launcher_says_which_of_the_releases_patches_it_called(tmp_path):
    """A job on 2 emulated npus with legacy from torch_npu 2.14.0 prints npu tensors, saves and loads a checkpoint
    and copies a storage to the host: the exit summary, the journal and the metrics count those patches' calls,
    ``tensor_repr``, ``torch_save`` and ``storage_cpu`` compare them, and what the job prints and writes is
    byte-identical to the unshadowed run."""
    import collections

    from torch_npu_wheels import wheel

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = os.path.join(root, "tests", "patch_surface_job.py")
    wheel("2.14.0")  # (in the cache: --legacy-from takes the version)
    plain_out, out = tmp_path / "plain.pt", tmp_path / "shadowed.pt"
    journal, textfile = tmp_path / "j.jsonl", tmp_path / "m.prom"
    plain = subprocess.run([sys.executable, job, str(plain_out), "--emulate-npu"], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    done = subprocess.run(
        [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", "2.14.0",
         "--journal", str(journal), "--textfile", str(textfile), "--", sys.executable, job, str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == plain.stdout and out.read_bytes() == plain_out.read_bytes()
    line, *uncounted = [line for line in done.stderr.splitlines() if line.startswith("npu-shadow patches:")]
    assert "of torch_npu 2.14.0's" in line
    expected = {"torch.Tensor.__repr__": 3, "torch.serialization._save": 2, "torch.load": 1} if COUNTS else {}
    for patch, calls in expected.items():
        assert f"{patch} {calls}" in line, line
    records = [json.loads(r) for r in journal.read_text().splitlines() if '"event":"patch_calls"' in r]
    if COUNTS:
        assert all(records[-1]["calls"][patch] == calls for patch, calls in expected.items()), records[-1]
    else:  # (nothing counted, and the summary says why)
        assert records == [] and "called 0 of" in line, line
        assert any("not counted" in u and "sys.monitoring" in u for u in uncounted), uncounted
    counted = [json.loads(r) for r in journal.read_text().splitlines() if '"event":"counts"' in r]
    counted = list({(r["target"], r["primary"]): r for r in counted}.values())  # (cumulative: the last of each)
    outcomes = collections.defaultdict(collections.Counter)
    for record in counted:
        for by_outcome in record["outcomes"].values():
            outcomes[record["target"]].update(by_outcome)
    assert outcomes["tensor_repr"]["match"] == 3 and outcomes["torch_save"]["match"] == 2, counted
    assert outcomes["storage_cpu"]["match"] >= 1 and all(set(o) == {"match"} for o in outcomes.values()), counted
    assert not any(record["skipped"] for record in counted), counted
    ranked = subprocess.run(
        [sys.executable, "-m", "shadow", "census", wheel("2.14.0"), "--journal", str(journal), "--format", "json"],
        capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert ranked.returncode == 0, ranked.stderr
    found = json.loads(ranked.stdout)
    by_name = {p["name"]: p for p in found["patches"]}
    assert found["called"] == len([p for p in found["patches"] if p["calls"]]) >= (3 if COUNTS else 0)
    assert [p["calls"] for p in found["patches"]] == sorted((p["calls"] for p in found["patches"]), reverse=True)
    assert by_name["torch.Tensor.__repr__"]["calls"] == (3 if COUNTS else 0)
    assert by_name["torch.load"]["covered_by"] == "target torch_load"
    assert by_name["torch.utils.dlpack.to_dlpack"]["covered_by"].startswith("nothing: a DLPack capsule")
    # (the patch board: each covered patch with its covering target's decision, as the verdict reaches it on the same
    # journal; a patch nothing covers has none)
    decided = subprocess.run([sys.executable, "-m", "shadow", "verdict", "--journal", str(journal), "--format", "json"],
                             capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    by_target = {t["target"]: t["decision"] for t in json.loads(decided.stdout)["targets"] if t["compared"]}
    assert by_name["torch.Tensor.__repr__"]["decision"] == by_target["tensor_repr"]
    assert by_name["torch.serialization._save"]["decision"] == by_target["torch_save"]
    assert by_name["torch.utils.dlpack.to_dlpack"]["decision"] == "-"
    if not COUNTS:
        return
    report = subprocess.run([sys.executable, "-m", "shadow", "report", "--journal", str(journal), "--markdown", "-"],
                            capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    assert "Patches the jobs called" in report.stdout and "| torch.Tensor.__repr__ | 3 |" in report.stdout, (
        report.stdout[-2000:] + report.stderr
    )
    metrics = textfile.read_text()
    assert any('patch="torch.serialization._save"' in m and m.endswith(" 2.0") for m in metrics.splitlines()
               if m.startswith("npu_shadow_patch_calls_total"))  # fmt: skip


@pytest.mark.slow
def test_a_legacy_version_not_in_the_cache_is_refused_at_start_up_naming_the_setting():
    done = npu_shadow("run", "--legacy-from", "9.9.9", "--", "true", timeout=120)
    assert done.returncode == 2 and "--legacy-from='9.9.9' is not valid" in done.stderr, done.stderr
    assert "nor a version whose wheel is cached" in done.stderr


_COMPILED = """
import torch, shadow
linear = torch.nn.Linear(4, 4)
def step(x):
    return linear(x).relu()
with shadow.install([], count_patches=["torch.nn.Module.__call__"]) as monitor:
    explained = torch._dynamo.explain(step)(torch.ones(2, 4))
    counted = monitor.patch_calls.counted
print(explained.graph_break_count, [str(b.reason) for b in explained.break_reasons], list(counted))
"""


@pytest.mark.slow
def test_counters_add_no_graph_break_to_compiled_code():
    """A counted place dynamo traces through (a module's call) is traced as before: no graph break. (In a process of
    its own: dynamo's state, once traced, leaves later eager calls making reference cycles that other tests count.)"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _COMPILED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    counted = ["torch.nn.Module.__call__"] if COUNTS else []
    assert done.stdout.strip() == f"0 [] {counted}", done.stdout
