"""Journals written by hand, in the format the journal exporter writes: each process's lines begin with its header
(whether it wrote every outcome), every record carries its process (host, pid, stream), and count records say
what a process counted so far (cumulative)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping


def process(pid: int = 1, host: str = "h") -> dict:
    return {"host": host, "pid": pid, "stream": f"s{host}{pid}"}


def header(pid: int = 1, host: str = "h", all_outcomes: bool = True, timestamp: float = 0.0) -> dict:
    return {"event": "journal", "all_outcomes": all_outcomes, "timestamp": timestamp, **process(pid, host)}


def line(
    outcome: str = "match",
    target: str = "op",
    signature: str = "call",
    reasons: Iterable[str] = (),
    timestamp: float = 0.0,
    pid: int = 1,
    host: str = "h",
    primary: str = "legacy",
    **fields: object,
) -> dict:
    """One outcome line."""
    return {
        "target": target,
        "outcome": outcome,
        "signature": signature,
        "reasons": list(reasons) or (["value"] if outcome == "mismatch" else []),
        "timestamp": timestamp,
        "primary": primary,
        **fields,
        **process(pid, host),
    }


def counts(
    outcomes: Mapping[str, Mapping[str, int]],
    target: str = "op",
    primary: str = "legacy",
    calls: Mapping[str, int] | None = None,
    skipped: Mapping[str, Mapping[str, int]] | None = None,
    reasons: Mapping[str, int] | None = None,
    timestamp: float = 0.0,
    pid: int = 1,
    host: str = "h",
) -> dict:
    """A count record: everything the process counted so far for one target and primary."""
    if reasons is None:
        reasons = {}
        for by_outcome in outcomes.values():
            if by_outcome.get("mismatch"):
                reasons["value"] = reasons.get("value", 0) + by_outcome["mismatch"]
    return {
        "event": "counts",
        "target": target,
        "primary": primary,
        "outcomes": {s: dict(o) for s, o in outcomes.items()},
        "skipped": {s: dict(r) for s, r in (skipped or {}).items()},
        "reasons": dict(reasons),
        "shared": {},
        "calls": dict(calls or {}),
        "drilled": 0,
        "timestamp": timestamp,
        **process(pid, host),
    }


def write(path: pathlib.Path, records: Iterable[dict], all_outcomes: bool = True) -> pathlib.Path:
    """The records, each process's header first (at its earliest timestamp)."""
    records = list(records)
    starts: dict[tuple, float] = {}
    for record in records:
        key = (record["host"], record["pid"])
        starts[key] = min(starts.get(key, record.get("timestamp", 0.0)), record.get("timestamp", 0.0))
    heads = [header(pid, host, all_outcomes, start) for (host, pid), start in starts.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*heads, *records]))
    return path
