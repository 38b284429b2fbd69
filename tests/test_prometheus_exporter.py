"""The Prometheus path, scraped over real HTTP."""

import dataclasses
import socket
import threading
import types
import warnings
from http.server import BaseHTTPRequestHandler, HTTPServer

import faults
import pytest
import torch
from metrics_helpers import promtool_check_metrics, samples, scrape, total
from prometheus_client import CollectorRegistry

import shadow
from exporters import PrometheusExporter
from shadow import Target
from shadow.core.model import targets as builtin
from shadow.core.model.observation import COMPARED_OUTCOMES, MISMATCH_REASONS, SKIP_REASONS


@pytest.fixture
def exporter():
    exp = PrometheusExporter(registry=CollectorRegistry(), port=0)
    yield exp
    exp.close()


def test_an_installed_target_shows_its_calls_and_rate_and_nothing_it_has_not_done(exporter):
    """The series budget (docs/fleet.md): a target installed shows its calls at zero and its sample rate; a series
    of comparisons, mismatches, skips, rollbacks appears at its first event, never as a zero for every label value
    it could take."""
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([Target("op", ops, "op", faults.scale)], exporters=[exporter]):
        parsed = samples(scrape(exporter.port))
    assert parsed[("npu_shadow_calls_total", (("primary", "legacy"), ("signature", ""), ("target", "op")))] == 0
    assert parsed[("npu_shadow_sample_rate", (("target", "op"),))] == 0.01
    about_op = {name for name, labels in parsed if ("target", "op") in labels}
    # (the side the caller gets is a gauge per side; prometheus-client adds a counter's _created in one process)
    assert about_op == {
        "npu_shadow_calls_total",
        "npu_shadow_calls_created",
        "npu_shadow_sample_rate",
        "npu_shadow_primary",
    }
    build = [k for k in parsed if k[0] == "npu_shadow_build_info"]
    assert len(build) == 1 and dict(build[0][1])["version"] == shadow.__version__


def test_scraped_counters_equal_the_monitor_stats(exporter, fake_torch_npu):
    ops = types.SimpleNamespace(op=faults.scale)
    targets = [
        Target("op", ops, "op", faults.scale_wrong),  # mismatches whenever an element is > 2
        dataclasses.replace(builtin.tensor_type(), upstream=faults.type_to_half),
    ]
    with shadow.install(targets, sample_rate={"op": 0.5, "tensor_type": 1.0}, seed=3, exporters=[exporter]) as monitor:
        for i in range(200):
            ops.op(torch.tensor([float(i % 4)]))
            x = torch.ones(2)
            x.type(torch.float32 if i % 3 else torch.int64)
            x.type()  # a string: agreement
        monitor.flush()
        stats = monitor.stats()
        parsed = samples(scrape(exporter.port))

    assert stats["op"].mismatch > 0 and stats["op"].match > 0 and stats["tensor_type"].mismatch > 0
    for name, s in stats.items():
        assert total(parsed, "npu_shadow_calls_total", target=name) == s.calls
        for outcome in COMPARED_OUTCOMES:
            assert total(parsed, "npu_shadow_comparisons_total", target=name, outcome=outcome) == getattr(s, outcome)
        assert total(parsed, "npu_shadow_comparisons_total", target=name) == s.compared  # compared calls only
        for reason in MISMATCH_REASONS:
            assert total(parsed, "npu_shadow_mismatches_total", target=name, reason=reason) == s.by_reason.get(
                reason, 0
            )
        for reason in SKIP_REASONS:
            assert total(parsed, "npu_shadow_skipped_total", target=name, reason=reason) == s.by_reason.get(reason, 0)
        assert total(parsed, "npu_shadow_skipped_total", target=name) == s.skipped  # sampled = compared + skipped
        assert total(parsed, "npu_shadow_export_errors_total", target=name) == s.export_errors
        compared_tensors = s.match + s.close + s.mismatch - (200 if name == "tensor_type" else 0)  # x.type(): str
        assert total(parsed, "npu_shadow_abs_error_count", target=name) == compared_tensors
        assert total(parsed, "npu_shadow_shadow_duration_seconds_count", target=name) == s.sampled - s.skipped
        assert total(parsed, "npu_shadow_shadow_seconds_total", target=name) > 0
    signatures = {dict(k[1])["signature"] for k in parsed if k[0] == "npu_shadow_comparisons_total"}
    assert {"dtype/cpu/blocking", "none/cpu/blocking", "call"} <= signatures


@pytest.mark.slow
def test_exposition_passes_promtool_check_metrics(exporter):
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([Target("op", ops, "op", faults.scale_wrong)], sample_rate=1.0, exporters=[exporter]):
        for i in range(5):
            ops.op(torch.tensor([float(i)]))
        text = scrape(exporter.port)
    checked = promtool_check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_busy_port_warns_and_the_job_goes_on():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.warns(RuntimeWarning, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            exporter = PrometheusExporter(registry=CollectorRegistry(), port=port)
    assert exporter.server is None and exporter.port is None
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([Target("op", ops, "op", faults.scale)], sample_rate=1.0, exporters=[exporter]) as monitor:
        assert torch.equal(ops.op(torch.ones(1)), torch.full((1,), 2.0))
    assert monitor.stats()["op"].match == 1


def test_textfile_and_pushgateway(tmp_path):
    exporter = PrometheusExporter(registry=CollectorRegistry())
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([Target("op", ops, "op", faults.scale)], sample_rate=1.0, exporters=[exporter]):
        ops.op(torch.ones(1))
    path = tmp_path / "npu_shadow.prom"
    exporter.write_textfile(str(path))
    assert total(samples(path.read_text()), "npu_shadow_comparisons_total", target="op", outcome="match") == 1

    received = {}

    class Gateway(BaseHTTPRequestHandler):
        def do_PUT(self):
            received["path"] = self.path
            received["body"] = self.rfile.read(int(self.headers["Content-Length"])).decode()
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        exporter.push_to_gateway(f"127.0.0.1:{server.server_port}", job="train")
    finally:
        thread.join(10)
        server.server_close()
    assert received["path"] == "/metrics/job/train"
    assert "npu_shadow_calls_total" in received["body"]


def test_exporter_failure_is_counted_as_export_skip(exporter):
    class Broken:
        def export(self, observation):
            raise OSError("No space left on device")

    ops = types.SimpleNamespace(op=faults.scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with shadow.install(
            [Target("op", ops, "op", faults.scale)], sample_rate=1.0, exporters=[exporter, Broken()]
        ) as monitor:
            for _ in range(3):
                ops.op(torch.ones(1))
    parsed = samples(scrape(exporter.port))
    assert monitor.stats()["op"].export_errors == 3
    assert total(parsed, "npu_shadow_export_errors_total", target="op") == 3
    assert total(parsed, "npu_shadow_skipped_total", target="op") == 0  # an exporter's failure skips no call


@pytest.mark.slow
def test_tls_options_reach_the_endpoint(tmp_path):
    import shutil
    import ssl
    import subprocess
    import urllib.request

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    exporter = PrometheusExporter(registry=CollectorRegistry(), port=0, certfile=str(cert), keyfile=str(key))
    try:
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{exporter.port}/metrics", context=context, timeout=10) as r:
            assert "npu_shadow_build_info" in r.read().decode()
        with pytest.raises(OSError):  # plain HTTP is refused by a TLS endpoint
            scrape(exporter.port)
    finally:
        exporter.close()


_SERVE_WITH_FEW_DESCRIPTORS = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
from prometheus_client import CollectorRegistry, Counter
from exporters.prometheus import serve_registry
registry = CollectorRegistry()
Counter("final", "the job's final count", registry=registry).inc(7)
server = serve_registry(registry, 0, "127.0.0.1")
print(server.server_port, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_half_open_connections_never_keep_a_real_scrape_out():
    """Connections that never send a request (139 of them kept --linger's final scrape out: each held a descriptor
    for good) are closed after REQUEST_SECONDS, so a scrape behind them is answered."""
    import subprocess
    import sys
    import time
    import urllib.request

    server = subprocess.Popen([sys.executable, "-c", _SERVE_WITH_FEW_DESCRIPTORS], stdout=subprocess.PIPE, text=True)
    held = []
    try:
        port = int(server.stdout.readline())
        for _ in range(139):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        started = time.monotonic()
        body = ""
        while not body and time.monotonic() - started < 60:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            except OSError:
                time.sleep(0.5)
        assert "final_total 7.0" in body
    finally:
        for connection in held:
            connection.close()
        server.kill()
        server.wait()


def test_a_client_that_drips_its_request_is_cut_off_at_the_requests_deadline():
    """A timeout per read let a client that sends a byte every 0.4 s hold its thread and descriptor for good (each
    read came within its timeout): the whole request has REQUEST_SECONDS, and the connection is closed while the
    client is still dripping."""
    from exporters.prometheus import serve_registry

    server = serve_registry(CollectorRegistry(), 0, "127.0.0.1")
    try:
        client = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 64
        closed_after = None
        for sent in range(len(request)):
            try:
                client.sendall(request[sent : sent + 1])
                client.settimeout(0.4)
                if client.recv(1024) == b"":
                    closed_after = sent
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_after = sent
                break
        assert closed_after is not None  # (before the client sent its whole request)
    finally:
        client.close()
        server.shutdown()


def test_a_linger_says_whether_a_signal_or_the_grace_period_ended_it():
    from shadow.launcher import linger

    registry = CollectorRegistry()
    assert linger.wait_for_scrapes([registry], 0.05, lambda timeout: False).how == "timeout"
    assert linger.wait_for_scrapes([registry], 60, lambda timeout: True).how == "signal"
    scraper = threading.Timer(0.05, lambda: list(registry.collect()))
    scraper.start()
    assert linger.wait_for_scrapes([registry], 60, lambda timeout: threading.Event().wait(timeout)).how == "scraped"
