"""Replay runs nothing a capture asks for: captures travel, and are data, never code."""

import os
import subprocess
import sys

import pytest
import torch

from exporters import capture as capture_format

HERE = os.path.dirname(__file__)


def save(tmp_path, **fields):
    data = {"format": 1, "target": "custom", "outcome": "mismatch", "signature": "s", "detail": "d", **fields}
    path = tmp_path / "evil.pt"
    torch.save(data, path)
    return path


def replay(path, *options, cwd):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "shadow", "replay", str(path), *options],
        capture_output=True, text=True, env=env, timeout=120, cwd=cwd,
    )  # fmt: skip


EVIL = {"args": ["touch pwned"], "kwargs": {}, "legacy_fn": "os:system", "upstream_fn": "os:system"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [
        EVIL,  # a custom target naming its own functions
        {**EVIL, "target": "tensor_type"},  # a built-in naming other functions: they are ignored
        {**EVIL, "target": "tensor_type", "args": [{"class": "os:system"}, "touch pwned"]},  # a class leaf
        {**EVIL, "target": "tensor_type", "args": [torch.ones(1), {"class": "subprocess:getoutput"}]},
    ],
    ids=["custom-names-functions", "builtin-names-functions", "class-leaf-os-system", "class-leaf-subprocess"],
)
def test_a_capture_naming_functions_runs_nothing_of_them(tmp_path, fields):
    done = replay(save(tmp_path, **fields), cwd=tmp_path)
    assert not (tmp_path / "pwned").exists()
    if fields.get("target", "custom") == "custom" or any(isinstance(a, dict) for a in fields["args"]):
        assert done.returncode == 2, done.stdout + done.stderr
        assert "refused" in done.stderr


@pytest.mark.slow
def test_a_custom_capture_needs_its_functions_on_the_command_line(tmp_path):
    done = replay(save(tmp_path, **EVIL), cwd=tmp_path)
    assert done.returncode == 2 and "--legacy MODULE:FUNCTION" in done.stderr and "os:system" in done.stderr
    given = replay(save(tmp_path, **{**EVIL, "args": [torch.ones(2)]}), "--legacy", "faults:scale",
                   "--upstream", "faults:scale", cwd=tmp_path)  # fmt: skip
    assert given.returncode == 0 and "replayed: match" in given.stdout, given.stderr
    builtin = replay(save(tmp_path, **{**EVIL, "target": "tensor_type"}), "--legacy", "faults:scale", cwd=tmp_path)
    assert builtin.returncode == 2 and "built-in target" in builtin.stderr


@pytest.mark.slow
def test_class_leaves_resolve_to_tensor_types_only(tmp_path):
    path = save(tmp_path, **{**EVIL, "target": "tensor_type", "args": [torch.ones(2), {"class": "torch:HalfTensor"}]})
    done = replay(path, cwd=tmp_path)
    assert done.returncode == 0 and "replayed: match" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "data",
    [{"format": 1}, {"format": 1, "target": 3}, {"format": 1, "target": "custom", "outcome": "m", "signature": "s",
                                                  "detail": "d", "args": "x", "kwargs": {}}],
    ids=["format-only", "target-not-a-string", "args-not-a-list"],
)  # fmt: skip
def test_malformed_captures_exit_2_saying_what_is_wrong(tmp_path, data):
    path = tmp_path / "bad.pt"
    torch.save(data, path)
    done = replay(path, cwd=tmp_path)
    assert done.returncode == 2 and "malformed capture" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_both_sides_raising_is_reported_as_such_not_as_a_match(tmp_path):
    path = save(tmp_path, **{**EVIL, "args": ["not", "fitting", "arguments"]})
    done = replay(path, "--legacy", "faults:scale", "--upstream", "faults:scale", cwd=tmp_path)
    assert "both sides raised (the same exception)" in done.stdout and "TypeError" in done.stdout, done.stdout
    assert "replayed: match" not in done.stdout


def test_the_engine_and_replay_share_one_rule_for_exceptions():
    import importlib

    compare, findings, replay = (
        importlib.import_module(m)
        for m in ("shadow.core.judging.compare", "shadow.core.calls.sampled.findings", "shadow.analysis.replay")
    )
    assert findings.compare_exceptions is replay.compare_exceptions is compare.compare_exceptions
    assert compare.compare_exceptions(TypeError("a"), TypeError("a")).outcome == "match"
    assert compare.compare_exceptions(TypeError("a"), TypeError("b")).outcome == "close"
    assert compare.compare_exceptions(TypeError("a"), ValueError("a")).reasons == ("exception",)
    assert compare.compare_exceptions(None, ValueError("a")).outcome == "error"
    assert capture_format.FORMAT == 1


def test_a_capture_that_would_inflate_past_its_bound_is_refused(tmp_path, monkeypatch):
    path = save(tmp_path, args=[torch.zeros(1 << 19)], kwargs={})  # (2 MiB of records once read)
    monkeypatch.setattr(capture_format, "MAX_INFLATED_BYTES", 1 << 20)
    with pytest.raises(ValueError, match=r"would take 2 MiB once read \(at most 1 MiB\)"):
        capture_format.load(str(path))
    monkeypatch.setattr(capture_format, "MAX_INFLATED_BYTES", 4 << 20)
    assert capture_format.load(str(path))["args"][0].numel() == 1 << 19


@pytest.mark.slow
def test_a_deflated_capture_is_refused_before_it_is_inflated(tmp_path):
    import zipfile

    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        with archive.open("archive/data/0", "w", force_zip64=True) as entry:
            chunk = bytes(1 << 24)
            for _ in range(20):  # 320 MiB of zeros: about 320 KiB deflated
                entry.write(chunk)
    assert path.stat().st_size < 2 << 20
    done = replay(path, cwd=tmp_path)
    assert done.returncode == 2 and "once read" in done.stderr, done.stderr


@pytest.mark.slow
def test_replay_never_opens_a_fifo_or_a_symlink(tmp_path):
    fifo = tmp_path / "capture.pt"
    os.mkfifo(fifo)
    done = replay(fifo, cwd=tmp_path)  # (would block forever on a FIFO no one writes)
    assert done.returncode == 2 and "not a regular file" in done.stderr, done.stderr
    link = tmp_path / "link.pt"
    link.symlink_to(save(tmp_path, args=[], kwargs={}))
    done = replay(link, cwd=tmp_path)
    assert done.returncode == 2 and "cannot open" in done.stderr, done.stderr


@pytest.mark.slow
def test_a_captures_escape_sequences_never_reach_the_terminal(tmp_path):
    detail = "\x1b]0;owned\x07\x1b[2J"  # (a terminal title, then a cleared screen)
    path = save(tmp_path, target="tensor_type", detail=detail, args=[torch.ones(2), "torch.HalfTensor"], kwargs={})
    done = replay(path, cwd=tmp_path)
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b]0;owned\\x07" in done.stdout, done.stdout
