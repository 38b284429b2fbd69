"""A job of several processes recording known observations under PROMETHEUS_MULTIPROC_DIR.

Run as a script (the environment variable must be set before prometheus_client is imported):
parent, 2 forked and 2 spawned children each make known calls; the parent then serves the
aggregate and prints the port and every process's own stats as JSON, waiting for 'quit' on stdin.
"""

import json
import multiprocessing
import os
import sys
import types

import faults  # this script's folder is on sys.path
import torch

import shadow
from exporters import PrometheusExporter


def workload(calls: int, results) -> None:
    """Calls of a target that mismatches on every other input; records this process's stats."""
    ops = types.SimpleNamespace(op=faults.scale)
    exporter = PrometheusExporter()
    with shadow.install(
        [shadow.Target("op", ops, "op", faults.scale_wrong)], sample_rate=1.0, exporters=[exporter]
    ) as m:
        for i in range(calls):
            ops.op(torch.tensor([float(i % 4)]))
    s = m.stats()["op"]
    results.put({"pid": os.getpid(), "calls": s.calls, "match": s.match, "mismatch": s.mismatch})


def forked_child(monitor, ops, calls: int, results) -> None:
    """A forked child uses the parent's monitor and exporter, as a DataLoader worker would."""
    for i in range(calls):
        ops.op(torch.tensor([float(i % 4)]))
    monitor.flush()
    s = monitor.stats()["op"]
    results.put({"pid": os.getpid(), "calls": s.calls, "match": s.match, "mismatch": s.mismatch})


def main() -> None:
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    ops = types.SimpleNamespace(op=faults.scale)
    exporter = PrometheusExporter(port=0)
    monitor = shadow.install(
        [shadow.Target("op", ops, "op", faults.scale_wrong)], sample_rate=1.0, exporters=[exporter]
    )
    for i in range(10):
        ops.op(torch.tensor([float(i % 4)]))
    fork, spawn = multiprocessing.get_context("fork"), multiprocessing.get_context("spawn")
    results = fork.Queue()
    spawn_results = spawn.Queue()
    children = [fork.Process(target=forked_child, args=(monitor, ops, 7 + n, results)) for n in range(2)]
    children += [spawn.Process(target=workload, args=(11 + n, spawn_results)) for n in range(2)]
    for child in children:
        child.start()
    reports = [results.get(timeout=120) for _ in range(2)] + [spawn_results.get(timeout=120) for _ in range(2)]
    for child in children:
        child.join(120)
        assert child.exitcode == 0, child.exitcode
    monitor.flush()
    s = monitor.stats()["op"]
    reports.append({"pid": os.getpid(), "calls": s.calls, "match": s.match, "mismatch": s.mismatch})
    print(json.dumps({"port": exporter.port, "reports": reports}), flush=True)
    sys.stdin.readline()  # the test scrapes, then tells us to quit
    monitor.uninstall()
    exporter.close()


if __name__ == "__main__":
    main()
