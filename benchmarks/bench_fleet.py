"""How the verdict's cost grows with a fleet: N simulated jobs of 8 ranks (the launcher's defaults' series, hours of
evidence, one job in ten diverging at 5%, one in seven only minutes old) written into a real Prometheus (promtool's
backfill) and a real VictoriaMetrics (its import API), then the verdict run per run and fleet-wide (every run
pooled, and the patch board) against both.

    python benchmarks/bench_fleet.py --jobs 100 --json fleet-100.json

Writes JSON with ``jobs``, ``series``, ``series_per_job``, ``prometheus_verdict_seconds`` and
``victoriametrics_verdict_seconds`` (one run's verdict, the median of the runs read), the fleet-wide reads' seconds,
``same_decisions`` (every decision alike from both stores), the ingestion's seconds and each store's resident memory
per series. Decisions are at ``--max-rate 0.01`` (a job of 8 ranks and 2 hours holds 960 clusters: enough to
promote at 0.01, not at 0.001). Figures: docs/benchmarks.md, docs/fleet.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from fleet_history import Job, moments, openmetrics_types, timestamped  # noqa: E402
from prometheus_server import prometheus, victoria_metrics, wait_for  # noqa: E402

from shadow.launcher import cli  # noqa: E402

MAX_RATE = "0.01"
EVERYTHING = 'count({__name__=~"npu_shadow_.+"})'


def fleet(jobs: int, hours: float, end: float) -> list[Job]:
    """The simulated jobs, all scraped last at ``end``: one in ten diverging at 5%, one in seven (of the others)
    minutes old."""
    found = []
    for i in range(jobs):
        diverging = 0.05 if i % 10 == 3 else 0.0
        young = i % 7 == 5 and not diverging
        lasted = 0.25 if young else hours
        found.append(Job(f"job{i:05d}", f"run-{i:05d}", lasted, diverging, started=end - lasted * 3600))
    return found


def write_history(jobs: list[Job], end: float, openmetrics: pathlib.Path) -> int:
    """Every job's history into ``openmetrics`` (for promtool); the number of samples."""
    samples = 0
    with open(openmetrics, "w") as out:
        out.write("\n".join(openmetrics_types(jobs[0])) + "\n")
        for job in jobs:
            for line in timestamped(job, "node0", moments(job, end)):
                out.write(line + "\n")
                samples += 1
        out.write("# EOF\n")
    return samples


def import_history(url: str, jobs: list[Job], end: float, batch: int = 20) -> None:
    """Every job's history into VictoriaMetrics through its import API (Prometheus text, times in milliseconds)."""
    for first in range(0, len(jobs), batch):
        lines = [line for job in jobs[first : first + batch] for line in timestamped(job, "node0", moments(job, end),
                                                                                     millis=True)]  # fmt: skip
        request = urllib.request.Request(f"{url}/api/v1/import/prometheus", data="\n".join(lines).encode(),
                                         method="POST")  # fmt: skip
        with urllib.request.urlopen(request, timeout=300):
            pass
    with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/internal/force_flush", timeout=60):
        pass


def resident_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def npu_shadow(*args: str) -> tuple[float, int, dict]:
    """(seconds, exit code, JSON) of one ``npu-shadow`` command run in this process (its queries and decisions, not
    an interpreter's start)."""
    out, said = io.StringIO(), io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(said):
        code = cli.main([*args, "--format", "json"])
    seconds = time.perf_counter() - began
    if code not in (0, 1, 3):
        print(f"npu-shadow {' '.join(args)}: exit {code}: {said.getvalue().strip()[-2000:]}", file=sys.stderr)
    return seconds, code, json.loads(out.getvalue()) if out.getvalue().strip() else {}


def decisions(found: dict) -> dict:
    """What a verdict decided, by target (decision, compared, divergent, bounds) and overall."""
    return {"decision": found.get("decision"),
            "targets": {t["target"]: (t["decision"], t["compared"], t["divergent"], t["lower"], t["upper"])
                        for t in found.get("targets", [])}}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10, help="jobs in the fleet (8 ranks each)")
    parser.add_argument("--hours", type=float, default=2.0, help="each job's hours of evidence")
    parser.add_argument("--runs-read", type=int, default=10, help="runs whose own verdict is timed on each store")
    parser.add_argument("--release", default="2.14.0", help="the torch_npu release the patch board reads")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    end = (time.time() - 120) // 60 * 60  # (the fleet's last scrape: two minutes ago, on a minute)
    jobs = fleet(args.jobs, args.hours, end)
    figures: dict = {"jobs": args.jobs, "ranks_per_job": 8, "hours": args.hours, "max_rate": float(MAX_RATE)}
    with tempfile.TemporaryDirectory(prefix="npu-shadow-fleet-") as scratch:
        place = pathlib.Path(scratch)
        for folder in ("prometheus", "victoria-metrics"):
            (place / folder).mkdir()
        began = time.perf_counter()
        figures["samples"] = write_history(jobs, end, place / "history.om")
        figures["history_seconds"] = round(time.perf_counter() - began, 2)
        began = time.perf_counter()
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(place / "history.om"),
                        str(place / "prometheus" / "data")], check=True, capture_output=True, timeout=3600)  # fmt: skip
        figures["prometheus_ingest_seconds"] = round(time.perf_counter() - began, 2)
        (place / "history.om").unlink()
        with prometheus(place / "prometheus", {}, []) as source, victoria_metrics(place / "victoria-metrics") as store:
            began = time.perf_counter()
            import_history(store.url, jobs, end)
            expected = sum(len(job.series(60)) for job in jobs)

            def holds_every_series() -> bool:
                held = store.query(EVERYTHING)
                return bool(held) and next(iter(held.values())) == expected

            wait_for(holds_every_series, "VictoriaMetrics to hold every series", timeout=600, interval=0.5)
            figures["victoriametrics_ingest_seconds"] = round(time.perf_counter() - began, 2)
            series = {name: next(iter(s.query(EVERYTHING).values())) for name, s in
                      (("prometheus", source), ("victoriametrics", store))}  # fmt: skip
            figures["series"] = int(series["prometheus"])
            figures["victoriametrics_series"] = int(series["victoriametrics"])
            figures["series_per_job"] = round(figures["series"] / args.jobs, 1)
            same = figures["series"] == figures["victoriametrics_series"] == expected
            every = max(1, args.jobs // max(1, args.runs_read))
            read = jobs[::every][: args.runs_read]
            per_run: dict[str, list[float]] = {"prometheus": [], "victoriametrics": []}
            decided: dict[str, list[dict]] = {"prometheus": [], "victoriametrics": []}
            for job in read:
                for name, s in (("prometheus", source), ("victoriametrics", store)):
                    seconds, _, found = npu_shadow("verdict", "--prometheus", s.url, "--run", job.run,
                                                   "--max-rate", MAX_RATE, "--timeout", "600")  # fmt: skip
                    per_run[name].append(seconds)
                    decided[name].append(decisions(found))
            same = same and decided["prometheus"] == decided["victoriametrics"]
            for name, s in (("prometheus", source), ("victoriametrics", store)):
                figures[f"{name}_verdict_seconds"] = round(statistics.median(per_run[name]), 3)
                seconds, _, found = npu_shadow("verdict", "--prometheus", s.url, "--all-runs", "--max-rate", MAX_RATE,
                                               "--timeout", "3600")  # fmt: skip
                figures[f"{name}_fleet_verdict_seconds"] = round(seconds, 2)
                decided[name].append(decisions(found))
                seconds, _, board = npu_shadow("census", args.release, "--prometheus", s.url, "--timeout", "3600")
                figures[f"{name}_patch_board_seconds"] = round(seconds, 2)
                decided[name].append({p["name"]: (p["calls"], p["decision"]) for p in board.get("patches", [])})
                figures[f"{name}_resident_bytes"] = resident_bytes(s.pid)
                figures[f"{name}_bytes_per_series"] = round(figures[f"{name}_resident_bytes"] / figures["series"])
            figures["same_decisions"] = bool(same and decided["prometheus"] == decided["victoriametrics"])
            by_run = [d["targets"].get("tensor_type", ("absent",))[0] for d in decided["prometheus"][: len(read)]]
            figures["runs_read"] = len(read)
            figures["run_decisions"] = {kind: by_run.count(kind) for kind in sorted(set(by_run))}
            figures["fleet_decision"] = decided["prometheus"][len(read)]["targets"].get("tensor_type", ("absent",))[0]
    print(json.dumps(figures, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["same_decisions"] else 1


if __name__ == "__main__":
    sys.exit(main())
