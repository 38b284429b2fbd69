"""`npu-shadow verdict` on sources that are not what they claim: exit 2 naming the source, in bounded time."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from test_verdict import run_verdict

GOOD = """# TYPE npu_shadow_comparisons_total counter
npu_shadow_comparisons_total{target="op",outcome="match",signature="call"} 8000
npu_shadow_comparisons_total{target="op",outcome="mismatch",signature="call"} 50
# TYPE npu_shadow_mismatches_total counter
npu_shadow_mismatches_total{target="op",reason="value"} 50
"""


def assert_source_error(done, *words):
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\x89PNG\r\n\x1a\n\0\0\0", ["binary data"]),
        (GOOD.encode("utf-16"), ["binary data"]),
        ("npu_shadow_comparisons_total{target=\"op\",outcome=\"match\",signature=\"é\"} 1\n".encode("latin-1"),
         ["not UTF-8"]),
        (GOOD.replace("8000", "NaN").encode(), ["cannot be a count"]),
        (GOOD.replace("8000", "+Inf").encode(), ["cannot be a count"]),
        (GOOD.replace("8000", "1e300").encode(), ["cannot be a count"]),
        (GOOD.replace("mismatch\",signature=\"call\"} 50", "mismatch\",signature=\"call\"} -50").encode(),
         ["cannot be a count"]),
        (GOOD.replace("8000", "7999.5").encode(), ["not a whole count"]),
        (b"this is not an exposition {{{\n", ["not a Prometheus text exposition"]),
    ],
    ids=["binary", "utf-16", "latin-1", "nan", "inf", "huge", "negative", "fractional", "garbage"],
)  # fmt: skip
def test_bad_metrics_files_exit_2_naming_the_file(tmp_path, content, words):
    path = tmp_path / "scrape.prom"
    path.write_bytes(content)
    assert_source_error(run_verdict("--metrics-file", str(path)), str(path), *words)


def test_a_negative_mismatch_series_is_not_evidence_of_promotion(tmp_path):
    """The reproduction: 8000 matches, 50 mismatches and a mismatch series of -50 gave promote, exit 0."""
    path = tmp_path / "scrape.prom"
    path.write_text(GOOD + 'npu_shadow_comparisons_total{target="op",outcome="mismatch",signature="other"} -50\n')
    assert_source_error(run_verdict("--metrics-file", str(path)), "-50")


def test_an_endless_file_is_refused_in_bounded_time_and_memory():
    assert_source_error(run_verdict("--metrics-file", "/dev/zero"), "/dev/zero")


@pytest.mark.parametrize(
    "line, words",
    [
        (b"\x00\x01\x02\xff\xfe binary\n", ["not a journal line"]),
        (b"[" * 100000 + b"]" * 100000 + b"\n", ["not a journal line"]),
        (b'{"target": "op", "outcome": "maybe", "signature": "call"}\n', ["not a journal line"]),
        (b'["op", "match"]\n', ["not a journal line"]),
        (b'{"target": "op", "outcome": "match", "signature": "call", "reasons": "value"}\n', ["reasons"]),
    ],
    ids=["binary", "deeply-nested", "unknown-outcome", "not-an-object", "reasons-not-a-list"],
)
def test_bad_journals_exit_2_naming_the_line(tmp_path, line, words):
    path = tmp_path / "j.jsonl"
    first = b'{"target": "op", "outcome": "match", "signature": "call", "reasons": [], "host": "h", "pid": 1}\n'
    path.write_bytes(first + line)
    assert_source_error(run_verdict("--journal", str(path)), f"{path}:2", *words)


class FakePrometheus:
    """An HTTP server on 127.0.0.1 answering every query with one canned body (rollbacks, counter resets and the
    time of the run's last sample: none)."""

    def __init__(self, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                none = b'{"status": "success", "data": {"resultType": "vector", "result": []}}'
                no_drill = b'{"status": "success", "data": {"resultType": "matrix", "result": []}}'
                if "drill_active" in self.path:
                    self.wfile.write(no_drill)
                elif "timestamp" in self.path or "drilled" in self.path:  # (no last sample, no drill marks)
                    self.wfile.write(none)
                else:
                    absent = ("rollbacks", "resets", "skip")  # (no rollback, no call skipped)
                    self.wfile.write(none if any(name in self.path for name in absent) else body)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_port}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def vector(value):
    return json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"target": "op", "outcome": "match", "signature": "call"}, "value": [1, value]}]}}
    ).encode()  # fmt: skip


@pytest.mark.parametrize(
    "body, words",
    [
        (b"[1,2]", ["not a Prometheus API object"]),
        (b'{"status": "success", "data": {"resultType": "vector", "result": []}}', ["has no"]),
        (b'{"status": "success"}', ["without a vector"]),
        (vector("NaN"), ["cannot be a count"]),
        (vector(""), ["not a number"]),
        (vector("-3"), ["cannot be a count"]),
        (b"<html>busy</html>", ["did not answer JSON"]),
        (b"[" * 100000, ["did not answer JSON"]),
    ],
    ids=["list", "no-data", "no-result", "nan", "empty", "negative", "html", "deep"],
)
def test_bad_prometheus_answers_exit_2_naming_the_server(body, words):
    with FakePrometheus(body) as url:
        assert_source_error(run_verdict("--prometheus", url), url, *words)


def test_a_good_answer_still_decides():
    with FakePrometheus(vector("5000")) as url:
        done = run_verdict("--prometheus", url)
    assert done.returncode == 0 and "promote" in done.stdout, done.stdout + done.stderr


def test_count_records_that_go_backwards_are_refused(tmp_path):
    import journals

    records = [
        journals.counts({"call": {"match": 100}}, timestamp=1),
        journals.counts({"call": {"match": 40}}, timestamp=2),
    ]
    path = journals.write(tmp_path / "j.jsonl", records, all_outcomes=False)
    assert_source_error(run_verdict("--journal", str(path)), f"{path}:3", "counts only grow")
    bad = journals.counts({"call": {"match": -1}})
    assert_source_error(run_verdict("--journal", str(journals.write(tmp_path / "k.jsonl", [bad]))), "cannot be a count")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("calls", {"call": 10**400}, ["calls.call", "cannot be a count"]),
        ("outcomes", {"call": {"match": 10**400}}, ["outcomes.call.match", "cannot be a count"]),
        ("drilled", 101, ["drilled:", "101 drilled comparisons of 100"]),
    ],
    ids=["huge-calls", "huge-outcome", "more-drilled-than-compared"],
)
def test_count_records_that_cannot_be_are_refused_naming_the_field(tmp_path, field, value, words):
    import journals

    record = journals.counts({"call": {"match": 100}}, calls={"call": 200}, skipped={"call": {"budget": 10}})
    record[field] = value
    path = journals.write(tmp_path / "j.jsonl", [record])
    done = run_verdict("--journal", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert all(word in done.stderr for word in words), done.stderr
