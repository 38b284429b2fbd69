"""The JSON-lines journal: content, rotation, disk full, and repro captures with replay."""

import dataclasses
import json
import os
import stat
import subprocess
import sys
import types

import faults
import pytest
import torch
from prometheus_client import CollectorRegistry

import shadow
from exporters import JsonlExporter, PrometheusExporter
from exporters import capture as capture_format
from shadow import Target
from shadow import targets as builtin


def run(exporters, calls=8, upstream=faults.scale_wrong):
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0, exporters=exporters) as monitor:
        for i in range(calls):
            ops.op(torch.tensor([float(i % 4)]))
    return monitor.stats()["op"]


def test_one_line_per_non_match_with_its_facts(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    path = tmp_path / "journal-{rank}.jsonl"
    journal = JsonlExporter(str(path))
    stats = run([journal])
    journal.close()
    lines = [json.loads(line) for line in (tmp_path / "journal-3.jsonl").read_text().splitlines()]
    assert len(lines) == stats.mismatch == 2  # inputs 3.0 differ; matches are not journaled
    first = lines[0]
    assert first["target"] == "op" and first["outcome"] == "mismatch" and first["reasons"] == ["value"]
    assert first["rank"] == 3 and first["pid"] == os.getpid() and first["host"]
    assert first["max_abs_error"] == 1.0 and "legacy 6" in first["detail"] and first["time"].endswith("+00:00")

    everything = JsonlExporter(str(tmp_path / "all.jsonl"), all_outcomes=True)
    run([everything])
    everything.close()
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == 8


def test_rotation_by_size_keeps_the_configured_backups(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = JsonlExporter(str(path), max_bytes=2000, backups=2)
    run([journal], calls=200)
    journal.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["j.jsonl", "j.jsonl.1", "j.jsonl.2"]
    for name in files:
        size = (tmp_path / name).stat().st_size
        assert 0 < size <= 2000
        for line in (tmp_path / name).read_text().splitlines():
            json.loads(line)  # rotation never splits a line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_is_counted_as_export_skip_and_training_goes_on(recwarn):
    prometheus = PrometheusExporter(registry=CollectorRegistry())
    journal = JsonlExporter("/dev/full", max_bytes=0)  # every write fails with ENOSPC
    stats = run([prometheus, journal])
    assert stats.mismatch == 2 and stats.by_reason["export"] == 2
    value = prometheus.registry.get_sample_value("npu_shadow_skipped_total", {"target": "op", "reason": "export"})
    assert value == 2


def test_unwritable_path_is_counted_too(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the journal's directory should be")
    journal = JsonlExporter(str(blocker / "j.jsonl"))
    stats = run([journal])
    assert stats.by_reason["export"] == stats.mismatch == 2


def test_capture_files_are_private_safe_and_bounded(tmp_path):
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(tmp_path / "captures"), max_captures=2)
    run([journal], calls=16)
    journal.close()
    captures = sorted((tmp_path / "captures").iterdir())
    assert len(captures) == 2
    for path in captures:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        data = torch.load(path, weights_only=True)
        assert data["target"] == "op" and data["outcome"] == "mismatch"
        assert data["upstream_fn"] == "faults:scale_wrong"
    lines = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert [line["capture"] for line in lines[:2]] == [str(p) for p in captures]
    assert all(line["capture"] is None for line in lines[2:])


def replay_cli(path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "shadow", "replay", str(path)], capture_output=True, text=True, env=env, timeout=120
    )


def test_replayed_tensor_type_capture_reproduces_its_mismatch(tmp_path):
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(tmp_path / "captures"))
    target = dataclasses.replace(builtin.tensor_type(), upstream=faults.type_to_half)
    with shadow.install([target], sample_rate=1.0, exporters=[journal]):
        torch.arange(4.0).type(torch.float64)
    journal.close()
    (path,) = (tmp_path / "captures").iterdir()
    data = capture_format.load(str(path))
    assert data["legacy_fn"] == "torch._C:TensorBase.type" and data["reasons"] == ["dtype"]
    done = replay_cli(path)
    assert done.returncode == 1, done.stderr
    assert "replayed: mismatch (dtype)" in done.stdout
    assert "dtype torch.float64 vs torch.float16" in done.stdout


def test_replay_of_a_fixed_upstream_agrees_and_bad_files_are_usage_errors(tmp_path):
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(tmp_path / "c"))
    run([journal], calls=4)
    journal.close()
    (path,) = (tmp_path / "c").iterdir()
    data = capture_format.load(str(path))
    data["upstream_fn"] = "faults:scale"  # as if upstream had been fixed
    fixed = tmp_path / "fixed.pt"
    capture_format.save(data, str(fixed))
    done = replay_cli(fixed)
    assert done.returncode == 0 and "replayed: match" in done.stdout
    (tmp_path / "junk.pt").write_bytes(b"not a capture")
    assert replay_cli(tmp_path / "junk.pt").returncode == 2


def test_every_field_survives_a_json_round_trip_including_awkward_strings(tmp_path):
    import time

    from shadow.observation import Observation

    journal = JsonlExporter(str(tmp_path / "j.jsonl"))
    awkward = Observation(
        target="op",
        outcome="mismatch",
        reasons=("nan", "value"),
        max_abs_error=float("inf"),
        max_rel_error=float("nan"),
        mismatched=2,
        numel=10,
        signature='odd/"quoted"/sig',
        detail='line\nbreak, tab\t, quote " and backslash \\ and unicode \u00e9',
        legacy_seconds=1e-6,
        timestamp=time.time(),
        drill=True,
    )
    journal.export(awkward)
    journal.close()
    (record,) = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert record["detail"] == awkward.detail and record["signature"] == awkward.signature
    assert record["reasons"] == ["nan", "value"] and record["drill"] is True
    assert record["max_abs_error"] == "inf" and record["max_rel_error"] == "nan"
    assert record["timestamp"] == awkward.timestamp and record["legacy_seconds"] == 1e-6
    assert record["pid"] == os.getpid() and record["capture"] is None
