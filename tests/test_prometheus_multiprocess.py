"""Multiprocess mode: metrics of every process of a job arrive, also after children exited."""

import json
import os
import subprocess
import sys

import pytest
from metrics_helpers import samples, scrape, total

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_parent_forked_and_spawned_children_all_arrive(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    job = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "multiproc_job.py")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = job.stdout.readline()
        assert line, job.stderr.read()[-3000:]
        report = json.loads(line)
        parsed = samples(scrape(report["port"]))  # every child has exited by now
    finally:
        if job.poll() is None:
            job.stdin.write("quit\n")
            job.stdin.flush()
        job.wait(60)
    reports = report["reports"]
    assert len(reports) == 5 and len({r["pid"] for r in reports}) == 5
    expected_calls = 10 + 7 + 8 + 11 + 12
    assert sum(r["calls"] for r in reports) == expected_calls
    assert total(parsed, "npu_shadow_calls_total", target="op") == expected_calls
    for outcome in ("match", "mismatch"):
        assert total(parsed, "npu_shadow_comparisons_total", target="op", outcome=outcome) == sum(
            r[outcome] for r in reports
        )
    assert total(parsed, "npu_shadow_mismatches_total", target="op", reason="value") == sum(
        r["mismatch"] for r in reports
    )
    assert job.returncode == 0


@pytest.mark.slow
def test_a_multiprocess_directory_others_can_write_is_refused_by_the_library(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    script = (
        "from exporters import PrometheusExporter\n"
        "try:\n    PrometheusExporter()\nexcept ValueError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)},
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
    )  # fmt: skip
    assert f"PROMETHEUS_MULTIPROC_DIR='{shared}' is not valid: writable by others" in done.stdout, done.stderr


SIGNATURE_WRITER = """
import os, sys
from exporters import PrometheusExporter
from shadow.core.model import contract
exporter = PrometheusExporter()
for index in range(60):
    exporter.record(contract.call_samples("op", 2, f"process{sys.argv[1]}-signature{index:02d}", "legacy"))
"""


@pytest.mark.slow
def test_one_endpoint_shows_at_most_the_signature_cap_however_many_processes_write(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters.prometheus import SignatureCappedCollector
    from shadow.core.calls.gate.coverage import MAX_SIGNATURES

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for process in range(3):  # 180 signature values in all, 60 each (within each process's own cap)
        done = subprocess.run(
            [sys.executable, "-c", SIGNATURE_WRITER, str(process)], env=env, cwd=os.path.dirname(HERE),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    registry = CollectorRegistry()
    SignatureCappedCollector(registry, path=str(tmp_path))
    parsed = samples(generate_latest(registry).decode())
    signatures = {dict(items)["signature"] for name, items in parsed if name == "npu_shadow_calls_total"}
    assert len(signatures) == MAX_SIGNATURES + 1 and "other" in signatures
    assert total(parsed, "npu_shadow_calls_total", target="op") == 3 * 60 * 2  # (none lost: folded into other)
    assert total(parsed, "npu_shadow_calls_total", target="op", signature="other") == (180 - MAX_SIGNATURES) * 2
    again = samples(generate_latest(registry).decode())  # (the same series at the next scrape)
    assert {dict(items)["signature"] for name, items in again if name == "npu_shadow_calls_total"} == signatures


@pytest.mark.slow
def test_a_torn_value_file_leaves_out_that_file_never_the_scrape_nor_a_traceback(tmp_path):
    """A value file torn by a process killed while it grew it (or a stranger's *.db) made every scrape of the job's
    endpoint fail (HTTP 500) and print a traceback on the job's stderr. It is left out, said once, and the other
    processes' values are served."""
    import urllib.request

    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_server import free_port

    good = MmapedDict(str(tmp_path / "counter_1.db"))
    good.write_value(json.dumps(["npu_shadow_calls", "npu_shadow_calls_total", {"target": "op"}, "calls"]), 7.0, 0.0)
    good.close()
    (tmp_path / "counter_4242.db").write_bytes(b"\x10\x00\x00\x00torn-by-a-kill" * 3)
    (tmp_path / "gauge.db").write_bytes(b"")
    port = free_port()
    serve = (
        "import sys\n"
        "from shadow.launcher.linger import serve_rank\n"
        "serve_rank(sys.argv[1], int(sys.argv[2]), '127.0.0.1')\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", serve, str(tmp_path), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert job.stdout.readline() == "up\n"
        bodies = [urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode() for _ in "ab"]
    finally:
        _, err = job.communicate("", timeout=60)
    assert all('npu_shadow_calls_total{target="op"} 7.0' in body for body in bodies), bodies[0]
    assert "Traceback" not in err and err.count("cannot be read, left out") == 2, err  # (once each: two files)


def test_ranks_exporting_on_their_own_show_at_most_the_cap_between_them(tmp_path, monkeypatch):
    """Twelve ranks, each with its own endpoint or Pushgateway group, each with 100 signatures of its own: what they
    show together (a Pushgateway holds every group) is at most the cap and ``other``, none of their calls lost."""
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters import PrometheusExporter, signatures
    from shadow.core.calls.gate.coverage import MAX_SIGNATURES
    from shadow.core.model import contract
    from shadow.launcher.bootstrap import npu_shadow_boot as boot

    assert signatures.SHARED_DIR_VARIABLE == boot.METRICS_DIR
    shared = tmp_path / "metrics"
    shared.mkdir(mode=0o700)
    monkeypatch.setenv(boot.METRICS_DIR, str(shared))
    shown, calls = set(), 0
    for rank in range(12):
        exporter = PrometheusExporter(registry=CollectorRegistry())
        for index in range(MAX_SIGNATURES):
            exporter.record(contract.call_samples("op", 1, f"rank{rank}-signature{index:03d}", "legacy"))
        parsed = samples(generate_latest(exporter.registry).decode())
        shown |= {dict(items)["signature"] for name, items in parsed if name == "npu_shadow_calls_total"}
        calls += total(parsed, "npu_shadow_calls_total", target="op")
    assert len(shown - {""}) == MAX_SIGNATURES + 1 and "other" in shown
    assert calls == 12 * MAX_SIGNATURES


def test_a_rank_never_finds_a_signature_slot_another_has_made_but_not_written(tmp_path):
    """Rank A is slow between making its slot and writing its value (held there on purpose); rank B admits the same
    value meanwhile: B never reads an empty slot as another value's, so the value holds one slot, not two."""
    import hashlib
    import time

    from exporters.signatures import JobSignatures

    slow = os.fork()
    if slow == 0:
        try:
            real = os.fdopen

            def fdopen(*args, **kwargs):  # (rank A, held between making a file and writing it)
                time.sleep(1.0)
                return real(*args, **kwargs)

            os.fdopen = fdopen
            JobSignatures(str(tmp_path)).admit("torch_save", "dest=path")
        finally:
            os._exit(0)
    folder = tmp_path / "signatures" / hashlib.sha256(b"torch_save").hexdigest()[:16]
    deadline = time.monotonic() + 30
    while not any(folder.glob("*")) and time.monotonic() < deadline:  # (rank A has begun: a file is there)
        time.sleep(0.01)
    assert JobSignatures(str(tmp_path)).admit("torch_save", "dest=path") == "dest=path"
    os.waitpid(slow, 0)
    assert sorted(path.read_text() for path in folder.glob("slot-*")) == ["dest=path"]


def test_a_fifo_among_the_signature_slots_never_blocks_a_rank(tmp_path):
    import hashlib
    import threading

    from exporters.signatures import JobSignatures

    folder = tmp_path / "signatures" / hashlib.sha256(b"op").hexdigest()[:16]
    folder.mkdir(parents=True)
    os.mkfifo(folder / "slot-0")
    found: list = []
    admitting = threading.Thread(target=lambda: found.append(JobSignatures(str(tmp_path)).admit("op", "sig")))
    admitting.daemon = True
    admitting.start()
    admitting.join(30)
    assert found == ["sig"] and (folder / "slot-1").read_text() == "sig"
