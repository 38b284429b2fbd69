"""The fleet: a job's series within its budget at the launcher's defaults (docs/fleet.md), and the fleet-wide store
(VictoriaMetrics fed by Prometheus' remote_write) deciding as the Prometheus that fed it."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
from commands import npu_shadow, npu_shadow_here
from prometheus_client.parser import text_string_to_metric_families
from torch_npu_wheels import wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The most series one job may export at the launcher's defaults (docs/fleet.md: the series budget).
SERIES_BUDGET = 250


def series_of(text: str) -> collections.Counter:
    """The series of an exposition, counted by sample name (a histogram's every bucket, sum and count is one)."""
    found: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] += 1
    return found


@pytest.mark.slow
def test_the_example_job_exports_at_most_its_series_budget_at_the_launchers_defaults(tmp_path):
    """The example on 2 emulated npus, legacy from torch_npu 2.14.0, one epoch, at the launcher's defaults: 778 series
    when every series was created at zero for every label value it could take; at most 250 now, with every target's
    calls and the comparisons it made there."""
    textfile = tmp_path / "metrics.prom"
    done = npu_shadow(
        "run",
        "--emulate-npu",
        "2",
        "--legacy-from",
        wheel("2.14.0"),
        "--textfile",
        str(textfile),
        "--linger",
        "0",
        "--",
        sys.executable,
        "examples/train_dataparallel.py",
        "--epochs",
        "1",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = series_of(textfile.read_text())
    assert sum(found.values()) <= SERIES_BUDGET, found.most_common()
    targets = {
        s.labels["target"]
        for f in text_string_to_metric_families(textfile.read_text())
        for s in f.samples
        if s.name == "npu_shadow_calls_total"
    }
    compared = {
        s.labels["target"]
        for f in text_string_to_metric_families(textfile.read_text())
        for s in f.samples
        if s.name == "npu_shadow_comparisons_total" and s.value > 0
    }
    assert len(targets) >= 10 and {"tensor_type", "data_parallel", "parallel_apply"} <= compared
    # (nothing it did not do: no mismatch, skip, rollback or shared divergence series for a job that had none)
    assert not {"npu_shadow_mismatches_total", "npu_shadow_rollbacks_total", "npu_shadow_resets_total"} & set(found)


def _serve(expositions: dict[str, str]):
    """An HTTP server on 127.0.0.1 answering ``/<name>`` with ``expositions[name]`` (each job's endpoint)."""
    import http.server
    import threading

    class Endpoint(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = expositions.get(self.path.lstrip("/"), "").encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _npu_shadow_json(*args: str) -> tuple[int, dict]:
    """The exit code and JSON of ``npu-shadow ARGS --format json``, run in this process: what the stores answer is
    the subject here."""
    import json

    done = npu_shadow_here(*args, "--format", "json")
    assert done.returncode in (0, 1, 3), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def _answer(server, expr: str) -> dict:
    """An instant query's answer (:meth:`PrometheusServer.query`), its error said with the expression."""
    import urllib.error

    try:
        return server.query(expr)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{server.url} refused {expr}: {exc.read()[:1000]!r}") from None


def _decisions(found: dict) -> dict:
    """What a verdict decided: overall, and per target its decision, counts and bounds."""
    targets = {t["target"]: (t["decision"], t["compared"], t["divergent"], t["lower"], t["upper"])
               for t in found["targets"]}  # fmt: skip
    return {"decision": found["decision"], "targets": targets}


@pytest.mark.slow
@pytest.mark.e2e
def test_victoria_metrics_fed_by_remote_write_decides_as_the_prometheus_that_fed_it(tmp_path):
    """Three jobs of 8 ranks scraped by a real Prometheus that remote_writes every sample to a real VictoriaMetrics:
    the verdict of each run, the patch board, every recording rule and every dashboard query give the same answers
    from both stores (the rules' ranges aside, which VictoriaMetrics does not extrapolate: there, both answer)."""
    import math
    import time

    from fleet_history import CALLED, Job, exposition
    from prometheus_server import prometheus, victoria_metrics, wait_for

    from dashboards import grafana_dashboard, rules

    now = time.time()
    jobs = [
        Job("clean", "run-clean", 3.0, started=now - 3 * 3600),
        Job("diverging", "run-diverging", 3.0, diverging=0.05, started=now - 3 * 3600),
        Job("young", "run-young", 0.1, started=now - 360),
    ]
    server = _serve({job.name: exposition(job, job.hours * 3600) for job in jobs})
    port = server.server_address[1]
    (tmp_path / "vm").mkdir()
    (tmp_path / "prom").mkdir()
    try:
        with victoria_metrics(tmp_path / "vm") as store, prometheus(
            tmp_path / "prom", {job.name: port for job in jobs}, [str(rules.RULES_PATH)],
            remote_write=f"{store.url}/api/v1/write", metrics_paths={job.name: f"/{job.name}" for job in jobs},
        ) as source:  # fmt: skip
            everything = 'count({__name__=~"npu_shadow_.+"})'
            series = sum(len(job.series(60)) for job in jobs)

            def both_hold_every_series():
                held = [s.query(everything) for s in (source, store)]
                return all(h and next(iter(h.values())) == series for h in held)

            wait_for(both_hold_every_series, "both stores to hold every series", timeout=120, interval=0.5)
            by_run = {}
            for job in jobs:
                decided = [_npu_shadow_json("verdict", "--prometheus", s.url, "--run", job.run, "--max-rate", "0.01")
                           for s in (source, store)]  # fmt: skip
                assert decided[0][0] == decided[1][0]
                assert _decisions(decided[0][1]) == _decisions(decided[1][1]), job
                by_run[job.name] = _decisions(decided[1][1])
            called_targets = {name: {t: d[0] for t, d in found["targets"].items() if t in CALLED}
                              for name, found in by_run.items()}  # fmt: skip
            assert called_targets == {"clean": dict.fromkeys(CALLED, "promote"),
                                      "diverging": dict.fromkeys(CALLED, "rollback"),
                                      "young": dict.fromkeys(CALLED, "inconclusive")}  # fmt: skip
            boards = [_npu_shadow_json("census", wheel("2.14.0"), "--prometheus", s.url)[1] for s in (source, store)]
            assert boards[0] == boards[1]
            called = {p["name"]: p for p in boards[1]["patches"] if p["calls"]}
            assert called["torch.Tensor.__repr__"]["calls"] == sum(round(8 * 2 * job.hours * 60) for job in jobs)
            assert called["torch.load"]["decision"] == "no evidence"  # (torch_load never compared)
            assert called["torch.serialization._save"]["decision"] == "rollback"  # (every run pooled: one diverges)
            # every recording rule, alert and dashboard query answers in both; those without a range the same
            expressions = [r["expr"] for g in rules.rule_groups()["groups"] for r in g["rules"]]
            board = __import__("json").loads(grafana_dashboard.DASHBOARD_PATH.read_text())
            for expr in grafana_dashboard.expressions(board):
                expressions.append(
                    expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
                    .replace('"$job"', '".*"').replace('"$run"', '".*"').replace('"$target"', '".*"')
                )  # fmt: skip
            for expr in expressions:
                answers = [_answer(s, expr) for s in (source, store)]
                if "[" in expr or "offset" in expr:
                    continue
                assert answers[0].keys() == answers[1].keys(), expr
                for key, value in answers[0].items():
                    assert math.isclose(value, answers[1][key], rel_tol=1e-9, abs_tol=1e-12), (expr, key)
            patch_board = [e for e in expressions if "patch_calls" in e]
            assert source.query(patch_board[0]) == store.query(patch_board[0]) != {}
            # (vmalert, VictoriaMetrics' rule evaluator in a fleet without a Prometheus per node, takes the rule file)
            checked = subprocess.run(["vmalert", "-dryRun", f"-rule={rules.RULES_PATH}"], capture_output=True,
                                     text=True, timeout=60)  # fmt: skip
            assert checked.returncode == 0, checked.stderr[-2000:]
    finally:
        server.shutdown()
