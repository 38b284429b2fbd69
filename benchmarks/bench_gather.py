"""What ``npu-shadow run --gather`` gathers: the example training job (DataParallel over 2 emulated npu devices,
torch_npu 2.12.0's own code as legacy where its wheel is cached) run at the launcher's defaults and with
``--gather``, the two in one run: each target's calls and comparisons, the comparisons and the clusters per
process-hour, the job's wall time, and the ETA the verdict gives for ``parallel_apply`` (the process-hours it says
are still needed) with the line that says what would be sooner.

Run: ``python benchmarks/bench_gather.py [--epochs N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from prometheus_client.parser import text_string_to_metric_families

from shadow.core.model import contract

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_dataparallel.py")
TARGETS = ("parallel_apply", "data_parallel", "tensor_type")


def _legacy() -> list[str]:
    from shadow.npu import wheels

    found = wheels.cached_wheel("2.12.0")
    return ["--legacy-from", found] if found else []


def _totals(textfile: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    with open(textfile, encoding="utf-8") as handle:
        for family in text_string_to_metric_families(handle.read()):
            for sample in family.samples:
                target = sample.labels.get("target", "")
                if sample.name == contract.CALLS.series:
                    totals[f"{target} calls"] = totals.get(f"{target} calls", 0) + sample.value
                elif sample.name == contract.COMPARISONS.series:
                    totals[f"{target} compared"] = totals.get(f"{target} compared", 0) + sample.value
                elif sample.name == contract.SKIPPED.series and sample.labels.get("reason") == "budget":
                    totals[f"{target} budget"] = totals.get(f"{target} budget", 0) + sample.value
                elif sample.name == contract.CLUSTERS.series:
                    totals[f"{target} clusters"] = totals.get(f"{target} clusters", 0) + sample.value
                elif sample.name == contract.PROCESS_TIME.series:
                    totals["process seconds"] = totals.get("process seconds", 0) + sample.value
    return totals


def run(preset: list[str], epochs: int, place: str) -> tuple[dict[str, float], float, dict]:
    """One shadowed run of the example: its totals, its wall time, and the verdict's JSON."""
    textfile = os.path.join(place, "metrics.prom")
    command = [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", *_legacy(), *preset, "--textfile",
               textfile, "--", sys.executable, EXAMPLE, "--epochs", str(epochs)]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True)
    wall = time.perf_counter() - started
    verdict = subprocess.run(
        [sys.executable, "-m", "shadow", "verdict", "--metrics-file", textfile, "--format", "json"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    return _totals(textfile), wall, json.loads(verdict.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="epochs of the example (16 steps each)")
    args = parser.parse_args()
    print(f"example job, {args.epochs} epochs, 2 emulated npu devices, DataLoader workers included")
    for name, preset in (("defaults", []), ("--gather", ["--gather"])):
        with tempfile.TemporaryDirectory() as place:
            totals, wall, verdict = run(preset, args.epochs, place)
        hours = totals.get("process seconds", 0) / 3600
        print(f"\n{name}: wall {wall:.1f} s, {hours * 3600:.1f} process-seconds")
        for target in TARGETS:
            calls, compared = totals.get(f"{target} calls", 0), totals.get(f"{target} compared", 0)
            clusters, budget = totals.get(f"{target} clusters", 0), totals.get(f"{target} budget", 0)
            per_hour = compared / hours if hours else 0
            print(f"  {target:<15} {calls:>6.0f} calls  {compared:>6.0f} compared  {budget:>4.0f} skipped for the "
                  f"budget  {per_hour:>9,.0f} comparisons/process-hour  {clusters:.0f} clusters")  # fmt: skip
        (decision,) = [t for t in verdict["targets"] if t["target"] == "parallel_apply"]
        eta = re.search(r"about ([\d.,e+]+) more process-hours", decision["why"])
        print(f"  parallel_apply ETA: {eta.group(1) if eta else '-'} more process-hours ({decision['decision']})")
        for phase in decision["phases"]:
            if phase["sooner"]:
                print(f"  {phase['primary']}: {phase['sooner']}")


if __name__ == "__main__":
    main()
