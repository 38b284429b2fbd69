"""The journal and captures where others can reach and where things go wrong: nothing followed, nothing lost."""

import json
import os
import stat
import subprocess
import sys
import types

import faults
import pytest
import torch

import shadow
from exporters import JsonlExporter
from shadow import Target

HERE = os.path.dirname(__file__)


def run(exporters, calls=8):
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([Target("op", ops, "op", faults.scale_wrong)], sample_rate=1.0, exporters=exporters) as m:
        for i in range(calls):
            ops.op(torch.tensor([3.0 + i]))  # every call mismatches
    return m.stats()["op"]


def lines(path):
    """The outcome lines (not the header, count records or events)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "outcome" in r]


def test_a_symlink_planted_at_the_journal_path_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    journal = JsonlExporter(str(tmp_path / "j.jsonl"))
    (tmp_path / "j.jsonl").symlink_to(victim)  # planted after start-up
    stats = run([journal], calls=3)
    assert victim.read_text() == "precious\n"
    assert stats.mismatch == 3 and stats.export_errors == 3  # counted, never raised into the job
    with pytest.raises(ValueError, match="not a regular file"):  # there at start-up: refused, naming the path
        JsonlExporter(str(tmp_path / "j.jsonl"))


def test_journal_files_are_private(tmp_path):
    journal = JsonlExporter(str(tmp_path / "j.jsonl"))
    run([journal], calls=1)
    journal.close()
    assert stat.S_IMODE((tmp_path / "j.jsonl").stat().st_mode) == 0o600


@pytest.mark.parametrize("problem", ["writable by others", "a symbolic link", "not a directory"])
def test_a_capture_directory_others_can_reach_is_refused(tmp_path, problem):
    target = tmp_path / "captures"
    if problem == "writable by others":
        target.mkdir()
        target.chmod(0o777)
    elif problem == "a symbolic link":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.write_text("")
    with pytest.raises(ValueError, match=f"capture_dir=.* is not valid: {problem}"):
        JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(target))


def test_a_failed_capture_loses_no_journal_line_and_the_next_gets_a_fresh_name(tmp_path):
    captures = tmp_path / "captures"
    captures.mkdir(mode=0o700)
    for attempt in (1, 2, 3):  # leftovers of a crash, where this process's first captures would go
        (captures / f"op-{os.getpid()}-{attempt:04d}.pt").write_bytes(b"partial")
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), capture_dir=str(captures), max_captures=20)
    stats = run([journal], calls=10)
    journal.close()
    assert len(lines(tmp_path / "j.jsonl")) == 10  # every mismatch journaled
    assert stats.export_errors == 3 and journal.captures_failed == 3
    written = sorted(p.name for p in captures.iterdir() if p.read_bytes() != b"partial")
    assert written == [f"op-{os.getpid()}-{n:04d}.pt" for n in range(4, 11)]


def test_a_deleted_journal_is_reopened_and_a_renamed_one_keeps_its_lines(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = JsonlExporter(str(path))
    run([journal], calls=3)
    path.unlink()
    run([journal], calls=4)
    assert len(lines(path)) == 4  # the lines after the delete are in a new file
    path.rename(tmp_path / "j.jsonl.old")  # logrotate without copytruncate
    run([journal], calls=2)
    journal.close()
    assert len(lines(tmp_path / "j.jsonl.old")) == 4 and len(lines(path)) == 2


WRITER = """
import sys
sys.path.insert(0, {here!r})
from exporters import JsonlExporter
from shadow.core.model.observation import Observation
journal = JsonlExporter({path!r}, max_bytes=40_000, backups=1000)
for i in range({count}):
    journal.export(Observation("op", "mismatch", ("value",), detail="x" * 100, signature=str(i % 50)))
journal.close()
"""


@pytest.mark.slow
def test_several_processes_sharing_one_journal_path_lose_no_line_on_rotation(tmp_path):
    path = tmp_path / "shared.jsonl"
    script = WRITER.format(here=os.path.dirname(HERE), path=str(path), count=3000)
    writers = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(4)]
    assert [w.wait(timeout=300) for w in writers] == [0] * 4
    files = [p for p in tmp_path.iterdir() if p.name != "shared.jsonl.lock"]
    assert len(files) > 10  # it did rotate, many times
    records = [record for p in files for record in lines(p)]
    assert len(records) == 4 * 3000
    # (a file may exceed max_bytes by the lines and count records other processes append while one decides to
    # rotate; a count record of 50 signatures is about 1.5 kB)
    assert all(os.path.getsize(p) <= 40_000 + 4 * 2500 for p in files), [os.path.getsize(p) for p in files]
