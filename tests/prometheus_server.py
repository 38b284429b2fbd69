"""A real Prometheus server for end-to-end tests: started on 127.0.0.1 with a temp dir, stopped after."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def consecutive_free_ports(count: int = 2) -> int:
    """A port p such that p .. p + count - 1 are free now (one per local rank)."""
    for _ in range(100):
        base = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for offset in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", base + offset))
            except OSError:
                continue
        return base
    raise RuntimeError("no consecutive free ports found")


def wait_for(condition, what: str, timeout: float = 90.0, interval: float = 0.05):
    """``condition()``'s first true value, polled every ``interval`` s; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


class PrometheusServer:
    def __init__(self, url: str, pid: int | None = None) -> None:
        self.url = url
        #: The server's process (its memory is measured by benchmarks/bench_fleet.py).
        self.pid = pid

    def get(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            return json.load(response)

    def query(self, promql: str) -> dict[tuple, float]:
        """{sorted label items (without __name__): value} of an instant query."""
        result = self.get("/api/v1/query", query=promql)["data"]["result"]
        return {
            tuple(sorted((k, v) for k, v in item["metric"].items() if k != "__name__")): float(item["value"][1])
            for item in result
        }

    def alerts(self) -> list[dict]:
        return self.get("/api/v1/alerts")["data"]["alerts"]

    def wait_for(self, condition, what: str, timeout: float = 90.0):
        return wait_for(condition, what, timeout, interval=0.5)


@contextlib.contextmanager
def prometheus(
    tmp_path,
    scrape_jobs: dict[str, int],
    rule_files: list[str],
    alertmanager: str | None = None,
    honor_labels: tuple[str, ...] = (),
    remote_write: str | None = None,
    metrics_paths: dict[str, str] | None = None,
) -> Iterator[PrometheusServer]:
    """Run Prometheus scraping ``{job: port}`` every second (at ``metrics_paths[job]`` where given) and evaluating
    ``rule_files`` every second; alerts go to ``alertmanager`` (host:port) when given; the jobs in ``honor_labels``
    keep their samples' own labels (a Pushgateway's); every sample is also sent to ``remote_write`` (a URL) within a
    second when given."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": rule_files,
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                "honor_labels": job in honor_labels,
                "metrics_path": (metrics_paths or {}).get(job, "/metrics"),
            }
            for job, port in scrape_jobs.items()
        ],
    }  # fmt: skip
    if remote_write:
        config["remote_write"] = [{"url": remote_write, "queue_config": {"batch_send_deadline": "1s"}}]
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with process(tmp_path, "prometheus", argv, f"http://127.0.0.1:{port}/-/ready") as child:
        yield PrometheusServer(f"http://127.0.0.1:{port}", child.pid)


@contextlib.contextmanager
def victoria_metrics(tmp_path) -> Iterator[PrometheusServer]:
    """Run VictoriaMetrics (single node, Debian's ``victoria-metrics``) on 127.0.0.1 with its data in ``tmp_path``:
    Prometheus' remote_write at ``{url}/api/v1/write``, its query API at ``{url}/api/v1/query``; every sample it
    holds is queried at once (no latency offset, no cache of earlier answers)."""
    binary = shutil.which("victoria-metrics")
    if binary is None:
        pytest.skip("victoria-metrics not installed (apt-get install victoria-metrics)")
    port = free_port()
    argv = [
        binary,
        f"-storageDataPath={tmp_path / 'victoria-metrics'}",
        f"-httpListenAddr=127.0.0.1:{port}",
        "-retentionPeriod=100y",
        "-search.latencyOffset=0s",
        "-search.disableCache",
        "-search.maxQueryLen=1048576",  # (the promotion rules' bounds are longer than its default 16 KiB)
        "-search.maxUniqueTimeseries=10000000",  # (a fleet's every series in one query: benchmarks/bench_fleet.py)
        "-loggerLevel=ERROR",
    ]
    with process(tmp_path, "victoria-metrics", argv, f"http://127.0.0.1:{port}/health") as child:
        yield PrometheusServer(f"http://127.0.0.1:{port}", child.pid)


def backfill(data: pathlib.Path, samples: dict[str, list[tuple[dict[str, str], list[tuple[float, float]]]]]) -> None:
    """Write history into a Prometheus data directory before the server starts (``promtool tsdb
    create-blocks-from openmetrics``): ``samples`` maps each series name to its (labels, [(unix time, value)])."""
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    lines = []
    for name, series in samples.items():
        family = name.removesuffix("_total")
        lines.append(f"# TYPE {family} {'counter' if name.endswith('_total') else 'gauge'}")
        for labels, points in series:
            rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            lines += [f"{name}{{{rendered}}} {value!r} {moment:.3f}" for moment, value in points]
    source = data.parent / "backfill.om"
    source.write_text("\n".join(lines) + "\n# EOF\n")
    data.mkdir(parents=True, exist_ok=True)
    subprocess.run([binary, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip


@contextlib.contextmanager
def process(
    tmp_path, name: str, argv: list[str], ready_url: str, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """A server process (Alertmanager, a Pushgateway, a receiver) on 127.0.0.1 with its log in ``tmp_path``, ready
    when ``ready_url`` answers; stopped after."""
    log_path = tmp_path / f"{name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:

        def ready():
            if child.poll() is not None:
                raise AssertionError(f"{name} exited: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(ready_url, timeout=2) as response:
                    return response.status < 500
            except urllib.error.HTTPError as exc:
                return exc.code < 500
            except OSError:
                return False

        PrometheusServer("").wait_for(ready, f"{name} to be ready", timeout=60)
        if child.poll() is not None:  # (another server answered on its port: ours could not bind it)
            raise AssertionError(f"{name} exited: {log_path.read_text()[-2000:]}")
        yield child
    finally:
        child.terminate()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(15)
        log.close()
