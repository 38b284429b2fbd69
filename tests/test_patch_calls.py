"""Which of a release's function patches a job calls: a call counter at each patch's place
(shadow.core.calls.patch_calls), the job's calls only, carried by every exporter."""

from __future__ import annotations

import inspect
import io
import json
import sys
import types

import pytest
import torch

import shadow
from exporters import JsonlExporter, PrometheusExporter


@pytest.fixture
def counted_ops(monkeypatch):
    """A module of the job's (``counted_ops``) with a function a test counts and shadows."""
    module = types.ModuleType("counted_ops")
    module.op = lambda x: x * 2
    monkeypatch.setitem(sys.modules, "counted_ops", module)
    return module


def test_the_jobs_calls_of_each_place_are_counted_and_every_place_is_put_back():
    places = {
        "torch.serialization._save": torch.serialization._save,
        "torch.Tensor.__repr__": inspect.getattr_static(torch.Tensor, "__repr__"),
        "torch.storage.UntypedStorage.cpu": inspect.getattr_static(torch.UntypedStorage, "cpu"),
    }
    names = [*places, "torch.not_a_module.save", "torch._dynamo.eval_frame.innermost_fn"]
    with shadow.install([], count_patches=names) as monitor:
        assert monitor.patch_calls.counted == tuple(places)  # (unreachable and compile-time places left alone)
        tensor = torch.ones(3)
        for _ in range(3):
            repr(tensor)
        torch.save(tensor, io.BytesIO())  # (torch.save reaches the _save place, as it does on an NPU host)
        tensor.untyped_storage().cpu()
        assert monitor.patch_counts() == {
            "torch.serialization._save": 1, "torch.Tensor.__repr__": 3, "torch.storage.UntypedStorage.cpu": 1,
        }  # fmt: skip
    assert torch.serialization._save is places["torch.serialization._save"]
    assert inspect.getattr_static(torch.Tensor, "__repr__") is places["torch.Tensor.__repr__"]
    assert inspect.getattr_static(torch.UntypedStorage, "cpu") is places["torch.storage.UntypedStorage.cpu"]
    assert "cpu" not in vars(torch.UntypedStorage) or places["torch.storage.UntypedStorage.cpu"] is vars(
        torch.UntypedStorage
    ).get("cpu")


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
        assert m.patch_counts() == {"counted_ops.op": 20}  # (not 60: upstream's and the A/A run's are not counted)


def test_a_place_a_target_shadows_counts_each_call_once(counted_ops):
    target = shadow.Target("op", counted_ops, "op", lambda x: x * 2)
    with shadow.install([target], sample_rate=1.0, budget=None, count_patches=["counted_ops.op"]) as monitor:
        for _ in range(10):
            counted_ops.op(torch.ones(2))
        assert monitor.stats()["op"].compared == 10 and monitor.patch_counts() == {"counted_ops.op": 10}


def test_the_counts_reach_the_metrics_and_the_journal(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from shadow.analysis.sources import JournalReader, patch_calls

    registry, journal = CollectorRegistry(), tmp_path / "j.jsonl"
    exporters = [PrometheusExporter(registry=registry), JsonlExporter(str(journal))]
    with shadow.install([], exporters=exporters, count_patches=["torch.Tensor.__repr__"]):
        for _ in range(4):
            repr(torch.zeros(1))
    (line,) = [line for line in generate_latest(registry).decode().splitlines()
               if line.startswith("npu_shadow_patch_calls_total{")]  # fmt: skip
    assert 'patch="torch.Tensor.__repr__"' in line and line.endswith(" 4.0")
    records = [json.loads(line) for line in journal.read_text().splitlines() if '"patch_calls"' in line]
    assert records[-1]["calls"] == {"torch.Tensor.__repr__": 4}
    reader = JournalReader()
    reader.read([str(journal)])
    assert patch_calls(reader) == {"torch.Tensor.__repr__": 4}


def test_count_patches_must_be_dotted_names():
    with pytest.raises(ValueError, match="count_patches: expected dotted names"):
        shadow.install([], count_patches="torch.save")


@pytest.mark.e2e
def test_a_job_under_the_launcher_says_which_of_the_releases_patches_it_called(tmp_path):
    """A job on 2 emulated npus with legacy from torch_npu 2.14.0 prints npu tensors, saves and loads a checkpoint
    and copies a storage to the host: the exit summary, the journal and the metrics count those patches' calls,
    ``tensor_repr``, ``torch_save`` and ``storage_cpu`` compare them, and what the job prints and writes is
    byte-identical to the unshadowed run."""
    import collections
    import os
    import subprocess

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
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("npu-shadow patches:")]
    assert "of torch_npu 2.14.0's" in line
    expected = {"torch.Tensor.__repr__": 3, "torch.serialization._save": 2, "torch.load": 1}
    for patch, calls in expected.items():
        assert f"{patch} {calls}" in line, line
    records = [json.loads(r) for r in journal.read_text().splitlines() if '"event":"patch_calls"' in r]
    assert all(records[-1]["calls"][patch] == calls for patch, calls in expected.items()), records[-1]
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
    assert found["called"] == len([p for p in found["patches"] if p["calls"]]) >= 3
    assert [p["calls"] for p in found["patches"]] == sorted((p["calls"] for p in found["patches"]), reverse=True)
    assert by_name["torch.Tensor.__repr__"]["calls"] == 3
    assert by_name["torch.load"]["covered_by"] == "target torch_load"
    assert by_name["torch.utils.dlpack.to_dlpack"]["covered_by"].startswith("nothing: a DLPack capsule")
    report = subprocess.run([sys.executable, "-m", "shadow", "report", "--journal", str(journal), "--markdown", "-"],
                            capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    assert "Patches the jobs called" in report.stdout and "| torch.Tensor.__repr__ | 3 |" in report.stdout, (
        report.stdout[-2000:] + report.stderr
    )
    metrics = textfile.read_text()
    assert any('patch="torch.serialization._save"' in m and m.endswith(" 2.0") for m in metrics.splitlines()
               if m.startswith("npu_shadow_patch_calls_total"))  # fmt: skip


def test_a_legacy_version_not_in_the_cache_is_refused_at_start_up_naming_the_setting():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "shadow", "run", "--legacy-from", "9.9.9", "--", "true"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--legacy-from='9.9.9' is not valid" in done.stderr, done.stderr
    assert "nor a version whose wheel is cached" in done.stderr


_COMPILED = """
import torch, shadow
linear = torch.nn.Linear(4, 4)
def step(x):
    return linear(x).relu()
with shadow.install([], count_patches=["torch.nn.Module.__call__"]) as monitor:
    explained = torch._dynamo.explain(step)(torch.ones(2, 4))
    assert monitor.patch_calls.counted == ("torch.nn.Module.__call__",)
print(explained.graph_break_count, [str(b.reason) for b in explained.break_reasons])
"""


def test_counters_add_no_graph_break_to_compiled_code():
    """A counted place dynamo traces through (a module's call) is traced as before: no graph break. (In a process of
    its own: dynamo's state, once traced, leaves later eager calls making reference cycles that other tests count.)"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _COMPILED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 []", done.stdout
