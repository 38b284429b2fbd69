"""How long `npu-shadow verdict` takes on a journal of many comparisons (goal: 10,000,000 in under 30 s).

Writes a journal as the journal exporter writes it with ``all_outcomes=True`` (every comparison a line, each
process's header, a count record every 100,000 comparisons as the 10 s cadence gives at 10,000 comparisons a
second), then times reading it and deciding. Run: ``python benchmarks/bench_verdict.py [--comparisons N]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from exporters import JsonlExporter
from shadow.analysis import decisions, sources, verdict
from shadow.core.model.observation import Observation

GOAL_SECONDS = 30.0


def write_journal(path: str, comparisons: int, processes: int, every: int = 100_000) -> None:
    """``comparisons`` match lines over ``processes`` processes, with their headers and count records."""
    per_process = comparisons // processes
    start = time.time()
    with open(path, "w") as handle:
        for index in range(processes):
            exporter = JsonlExporter(os.path.join(os.path.dirname(path), f"scratch-{index}.jsonl"), all_outcomes=True)
            exporter.pid, exporter.stream = 10_000 + index, f"{index:016x}"
            line = exporter._line(Observation("op", "match", signature="call", timestamp=start, numel=4), None)
            handle.write(f'{{"event":"journal","all_outcomes":true,"timestamp":{start},{exporter._process()}\n')
            written = 0
            while written < per_process:
                block = min(every, per_process - written)
                handle.write(line * block)
                written += block
                handle.write(
                    f'{{"event":"counts","target":"op","primary":"legacy","outcomes":{{"call":{{"match":{written}}}}},'
                    f'"skipped":{{}},"reasons":{{}},"shared":{{}},"calls":{{"":{written}}},"drilled":0,'
                    f'"timestamp":{start + written / 10_000},{exporter._process()}\n'
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comparisons", type=int, default=10_000_000)
    parser.add_argument("--processes", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "journal.jsonl")
        write_journal(path, args.comparisons, args.processes)
        size = os.path.getsize(path)
        start = time.perf_counter()
        counts = sources.from_journal([path])
        decision = verdict.decide("op", counts["op"], decisions.DEFAULT_MAX_RATE)
        seconds = time.perf_counter() - start
    assert decision.compared == args.comparisons // args.processes * args.processes
    print(
        f"verdict on a journal of {decision.compared:,} comparisons ({size / 2**30:.2f} GiB, {args.processes} "
        f"processes): {seconds:.1f} s (goal < {GOAL_SECONDS:g} s) -> {decision.decision}, "
        f"{decision.clusters:,} clusters"
    )


if __name__ == "__main__":
    main()
