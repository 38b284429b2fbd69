"""The JSON-lines journal: content, rotation, disk full, and repro captures with replay."""

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    lines = [r for r in map(json.loads, (tmp_path / "journal-3.jsonl").read_text().splitlines()) if "outcome" in r]
    assert len(lines) == stats.mismatch == 2  # inputs 3.0 differ; matches are not journaled
    first = lines[0]
    assert first["target"] == "op" and first["outcome"] == "mismatch" and first["reasons"] == ["value"]
    assert first["rank"] == 3 and first["pid"] == os.getpid() and first["host"]
    assert first["max_abs_error"] == 1.0 and "legacy 6" in first["detail"] and first["time"].endswith("+00:00")

    everything = JsonlExporter(str(tmp_path / "all.jsonl"), all_outcomes=True)
    run([everything])
    everything.close()
    written = (tmp_path / "all.jsonl").read_text().splitlines()
    assert sum('"outcome"' in line for line in written) == 8


def test_rotation_by_size_keeps_the_configured_backups(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = JsonlExporter(str(path), max_bytes=2000, backups=2)
    run([journal], calls=200)
    journal.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["j.jsonl", "j.jsonl.1", "j.jsonl.2", "j.jsonl.lock"]  # (the lock serialises rotations)
    for name in files[:-1]:
        size = (tmp_path / name).stat().st_size
        assert 0 < size <= 2000
        for line in (tmp_path / name).read_text().splitlines():
            json.loads(line)  # rotation never splits a line


@pytest.mark.skipif(
    not os.path.exists("/dev/full") or not stat.S_ISCHR(os.stat("/dev/full").st_mode),
    reason="needs /dev/full as a character device",
)
def test_disk_full_is_counted_as_export_skip_and_training_goes_on(recwarn, tmp_path, monkeypatch):
    import errno

    path = str(tmp_path / "j.jsonl")
    real_write = os.write

    def full(fd, data):  # every write to the journal fails as on a full disk
        if os.readlink(f"/proc/self/fd/{fd}") == path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    prometheus = PrometheusExporter(registry=CollectorRegistry())
    journal = JsonlExporter(path, max_bytes=0)
    stats = run([prometheus, journal])
    assert stats.mismatch == 2 and stats.export_errors == 2
    value = prometheus.registry.get_sample_value(
        "npu_shadow_export_errors_total", {"run": prometheus.run, "target": "op"}
    )
    assert value == 2


def test_unwritable_path_is_counted_too(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the journal's directory should be")
    journal = JsonlExporter(str(blocker / "j.jsonl"))
    stats = run([journal])
    assert stats.export_errors == stats.mismatch == 2


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
    lines = [r for r in map(json.loads, (tmp_path / "j.jsonl").read_text().splitlines()) if "outcome" in r]
    assert [line["capture"] for line in lines[:2]] == [str(p) for p in captures]
    assert all(line["capture"] is None for line in lines[2:])


def replay_cli(path, *options, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "shadow", "replay", str(path), *options],
        capture_output=True, text=True, env=env, timeout=120, cwd=cwd,
    )  # fmt: skip


@pytest.mark.slow
def test_replayed_custom_capture_reproduces_its_mismatch_with_the_functions_given(tmp_path):
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(tmp_path / "captures"))
    run([journal], calls=4)
    journal.close()
    (path,) = (tmp_path / "captures").iterdir()
    data = capture_format.load(str(path))
    assert data["legacy_fn"] == "faults:scale" and data["upstream_fn"] == "faults:scale_wrong"
    done = replay_cli(path, "--legacy", "faults:scale", "--upstream", "faults:scale_wrong")
    assert done.returncode == 1, done.stderr
    assert "replayed: mismatch (value)" in done.stdout
    fixed = replay_cli(path, "--legacy", "faults:scale", "--upstream", "faults:scale")  # as if upstream were fixed
    assert fixed.returncode == 0 and "replayed: match" in fixed.stdout
    (tmp_path / "junk.pt").write_bytes(b"not a capture")
    assert replay_cli(tmp_path / "junk.pt").returncode == 2


def tensor_type_capture(tmp_path, args, **fields):
    """A tensor_type capture as the journal writes it (the CPU-only replay process knows no npu)."""
    data = {
        "format": 1, "target": "tensor_type", "outcome": "error", "reasons": ["exception"], "signature": "s",
        "detail": "d", "args": args, "kwargs": {}, "legacy": None, "upstream": None, "module_state": {},
        "legacy_fn": None, "upstream_fn": None, "exact": True, **fields,
    }  # fmt: skip
    path = tmp_path / "capture.pt"
    capture_format.save(data, str(path))
    return path


@pytest.mark.slow
def test_replayed_tensor_type_capture_runs_the_builtin_functions(tmp_path):
    """On a CPU-only host the reference legacy casts an npu type name where torch refuses it: an error."""
    done = replay_cli(tensor_type_capture(tmp_path, [torch.arange(4.0), "torch.npu.HalfTensor"]))
    assert done.returncode == 1, done.stderr
    assert "replayed: error (exception)" in done.stdout and "upstream raised" in done.stdout


def test_every_field_survives_a_json_round_trip_including_awkward_strings(tmp_path):
    import time

    from shadow.core.model.observation import Observation

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
        primary_seconds=1e-6,
        timestamp=time.time(),
        drill=True,
    )
    journal.export(awkward)
    journal.close()
    (record,) = [r for r in map(json.loads, (tmp_path / "j.jsonl").read_text().splitlines()) if "outcome" in r]
    assert record["detail"] == awkward.detail and record["signature"] == awkward.signature
    assert record["reasons"] == ["nan", "value"] and record["drill"] is True
    assert record["max_abs_error"] == "inf" and record["max_rel_error"] == "nan"
    assert record["timestamp"] == awkward.timestamp and record["primary_seconds"] == 1e-6
    assert record["pid"] == os.getpid() and record["capture"] is None


def test_the_line_carries_every_field_of_the_schema_and_the_reader_reads_old_lines_by_role(tmp_path):
    """One schema for writer and reader (exporters.journal_format): every observation field that is data is on the
    line with its value (the A/A, backward and truth seconds among them), and a line written before the role names
    (legacy_seconds, upstream_seconds) reads with them, by the side that was primary."""
    import dataclasses

    from exporters.journal_format import NULL_WHEN_EMPTY, OBSERVATION_FIELDS, readable
    from shadow.analysis.sources import journal_records
    from shadow.core.model.observation import Observation

    values = {"aa_seconds": 0.25, "backward_seconds": 0.5, "truth_seconds": 0.75, "shadow_seconds": 2.0}
    observation = Observation("op", "close", numel=4, primary_seconds=1.0, primary="upstream", **values)
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), all_outcomes=True)
    journal.export(observation)
    journal.close()
    (record,) = [r for r in journal_records([str(tmp_path / "j.jsonl")]) if "outcome" in r]
    for name, _ in OBSERVATION_FIELDS:
        expected = getattr(observation, name)
        expected = list(expected) if isinstance(expected, tuple) else expected
        assert record[name] == (None if expected == "" and name in NULL_WHEN_EMPTY else expected), name
    assert {f.name for f in dataclasses.fields(Observation)} - {n for n, _ in OBSERVATION_FIELDS} == {
        "evidence", "leaf_errors", "noise_pending", "timestamp"
    }  # fmt: skip
    old = {"outcome": "close", "primary": "upstream", "legacy_seconds": 2.0, "upstream_seconds": 1.0}
    assert readable(old)["primary_seconds"] == 1.0 and readable(old)["shadow_seconds"] == 2.0
    assert readable({**old, "primary": "legacy"})["primary_seconds"] == 2.0


_NEVER_UNINSTALLED = """
import sys, types
import torch
import shadow
from exporters import JsonlExporter

ops = types.SimpleNamespace(op=lambda x: x * 2)
shadow.install([shadow.Target("op", ops, "op", lambda x: x * 3)], sample_rate=1.0,
               exporters=[JsonlExporter(sys.argv[1])])
ops.op(torch.ones(2))
"""


@pytest.mark.slow
def test_a_job_that_never_uninstalls_still_journals_its_last_records_at_exit(tmp_path):
    """The records wait for the exporters up to a second (the reporter's round): a library user's job that installs
    and exits at once gets them at exit, from the reporter's last round."""
    journal = tmp_path / "j.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _NEVER_UNINSTALLED, str(journal)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [r["outcome"] for r in records if "outcome" in r] == ["mismatch"]
    (counts,) = [r for r in records if r.get("event") == "counts"]
    assert [table for table in counts["outcomes"].values()] == [{"mismatch": 1}] and sum(counts["calls"].values()) == 1
