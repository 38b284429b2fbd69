"""A journal's files and lines as data: a journal with the files its rotation left, each line a whole record
checked before it is read (a torn line, from a writer killed mid-line or a full disk, skipped and said), and a count
record's tables checked as counts (:mod:`exporters.journal_format`'s schema). :mod:`.journals` counts what these
give."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator

from exporters import journal_format
from shadow.analysis.sources.common import MAX_LINE_BYTES, SourceError, _count, _shown
from shadow.core.model.observation import (
    COMPARED_OUTCOMES,
    DECADE_LIMIT,
    OUTCOMES,
    PRIMARY_SIDES,
)


def journal_records(paths: Iterable[str], torn: list[str] | None = None) -> Iterator[dict]:
    """Every record of the journals, checked, one at a time (bounded memory however long they are).

    A final line without its newline that is not a whole record (a writer killed mid-line, a full disk) is
    skipped; its place is appended to ``torn`` when given."""
    for path in paths:
        try:
            with open(path, "rb") as handle:
                for number, raw in enumerate(iter(lambda h=handle: h.readline(MAX_LINE_BYTES + 1), b""), 1):
                    record = whole_record(raw, f"{path}:{number}", torn)
                    if record is not None:
                        yield record
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc


def rotated_siblings(path: str) -> list[str]:
    """``path`` with the files its rotation left (``path.1`` ... ``path.N``, oldest first, then ``path``)."""
    siblings = []
    index = 1
    while os.path.exists(f"{path}.{index}"):
        siblings.append(f"{path}.{index}")
        index += 1
    return [*reversed(siblings), path]


def with_rotated(paths: Iterable[str]) -> tuple[list[str], list[str]]:
    """(every journal to read: each path with its rotated siblings, oldest first, each once; the siblings added)."""
    given = list(dict.fromkeys(os.fspath(p) for p in paths))
    read, added = [], []
    for path in given:
        for each in rotated_siblings(path) if not _ROTATED.search(path) else [path]:
            if each not in read:
                read.append(each)
                if each not in given:
                    added.append(each)
    return read, added


_ROTATED = re.compile(r"\.\d+$")


def seconds_of(value: object) -> float | None:
    """A record's time as a float, or None where it is no finite number (text, a bool, nan, an integer too large
    for a float: 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


def said(value: object) -> str:
    """A record's value as a message quotes it: JSON, a huge integer by its size."""
    return _shown(value) if isinstance(value, int) and not isinstance(value, bool) else json.dumps(value)


def check_counts(record: dict, where: str) -> dict:
    """A count record's fields, checked: nested maps of strings to whole counts."""
    if not isinstance(record.get("target"), str) or record.get("primary") not in PRIMARY_SIDES:
        raise SourceError(f"{where}: a count record without a target or a known primary")
    timestamp = record.get("timestamp")
    if seconds_of(timestamp) is None:
        raise SourceError(
            f"{where}: a count record whose timestamp is {said(timestamp)}, not a finite number of seconds "
            "(when its comparisons were counted, which the clusters are cut by)"
        )

    def table(name: str, depth: int) -> dict:  # (depth: journal_format.COUNT_TABLES')
        value = record.get(name, {})
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise SourceError(f"{where}: a count record whose {name} is not a map")
        if depth == 2:
            return {k: table_of(v, f"{name}.{k}") for k, v in value.items()}
        return {k: _count(v, f"{where}: {name}.{k}") for k, v in value.items()}

    def table_of(value: object, name: str) -> dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise SourceError(f"{where}: a count record whose {name} is not a map")
        return {k: _count(v, f"{where}: {name}.{k}") for k, v in value.items()}

    tables = {name: table(name, depth) for name, depth in journal_format.COUNT_TABLES.items()}
    for outcomes in tables["outcomes"].values():
        if any(o not in COMPARED_OUTCOMES for o in outcomes):
            raise SourceError(f"{where}: a count record with an unknown outcome")
    for name, (metric, keys) in journal_format.TABLE_SERIES.items():
        for labels in journal_format.table_labels(tables[name], keys) if metric.closed else ():
            unknown = [label for label, values in metric.closed.items() if labels.get(label) not in values]
            if unknown:
                raise SourceError(f"{where}: a count record with an unknown {unknown[0]} in its {name}")
    known = {str(d) for d in range(-DECADE_LIMIT, DECADE_LIMIT + 1)}
    if any(decade not in known for by_decade in tables["truth_decades"].values() for decade in by_decade):
        raise SourceError(f"{where}: a count record with an unknown error decade")
    drilled = _count(record.get("drilled", 0), f"{where}: drilled")
    _check_totals(tables["outcomes"], drilled, where)
    _check_drilled(tables, drilled, where)
    scalars = {  # (those it holds: one without clusters is a process of a version before they were counted)
        name: _count(record[name], f"{where}: {name}", whole=False)
        for name in journal_format.EVIDENCE_SCALARS
        if name in record
    }
    return {**tables, "drilled": drilled, **scalars}


def _check_totals(outcomes: dict, drilled: float, where: str) -> None:
    """A count record's drilled comparisons must be at most its comparisons. (Its calls may lag its comparisons: calls
    are reported each second, comparisons as they end.)"""
    compared = sum(n for by_outcome in outcomes.values() for n in by_outcome.values())
    if drilled > compared:
        raise SourceError(
            f"{where}: drilled: a count record with {drilled:g} drilled comparisons of {compared:g}: not a record "
            "npu-shadow writes"
        )


def _check_drilled(tables: dict, drilled: float, where: str) -> None:
    """A count record's drilled comparisons are among its comparisons, outcome by outcome and reason by reason, and
    add up to its drilled count."""
    for signature, by_outcome in tables["drilled_outcomes"].items():
        for outcome, value in by_outcome.items():
            if value > tables["outcomes"].get(signature, {}).get(outcome, 0):
                raise SourceError(
                    f"{where}: drilled_outcomes.{signature}.{outcome}: {value:g} drilled comparisons, more than the "
                    "record's comparisons of that outcome: not a record npu-shadow writes"
                )
    for reason, value in tables["drilled_reasons"].items():
        if value > tables["reasons"].get(reason, 0):
            raise SourceError(f"{where}: drilled_reasons.{reason}: {value:g}, more than the record's reasons {reason}")
    marked = sum(n for by_outcome in tables["drilled_outcomes"].values() for n in by_outcome.values())
    if marked > drilled:
        raise SourceError(f"{where}: drilled_outcomes: {marked:g} marked, more than its drilled {drilled:g}")


def check_patch_calls(record: dict, where: str) -> dict:
    """A process's calls of a release's function patches (``"event": "patch_calls"``, cumulative), checked as
    data: {dotted name: whole count}."""
    calls = record.get("calls")
    if not isinstance(calls, dict) or not all(isinstance(k, str) and len(k) <= 256 for k in calls):
        raise SourceError(f"{where}: a patch_calls record whose calls are not a map of patch names")
    return {**record, "calls": {k: _count(v, f"{where}: calls.{k}") for k, v in calls.items()}}


def check_arm(record: dict, where: str) -> dict:
    """A canary A/B iterator record (``"event": "arm"``, :mod:`shadow.core.calls.canary.arms`), checked as data."""

    def cores(value: object) -> bool:
        return isinstance(value, list) and len(value) <= 4096 and all(type(c) is int and c >= 0 for c in value)

    def number(value: object) -> bool:
        return value is None or (type(value) in (int, float) and math.isfinite(value) and value >= 0)

    problems = [
        name
        for name, ok in (
            ("target", isinstance(record.get("target"), str)),
            ("arm", record.get("arm") in PRIMARY_SIDES),
            ("worker_cores", isinstance(record.get("worker_cores"), list) and all(map(cores, record["worker_cores"]))),
            ("caller_cores_before", cores(record.get("caller_cores_before"))),
            ("caller_cores_after", cores(record.get("caller_cores_after"))),
            ("process_cores", cores(record.get("process_cores"))),
            ("first_batch_seconds", number(record.get("first_batch_seconds"))),
            ("batches_per_second", number(record.get("batches_per_second"))),
            ("base_seed", record.get("base_seed") is None or type(record.get("base_seed")) is int),
            ("first_batch_digest", isinstance(record.get("first_batch_digest", ""), str)),
            ("raised", isinstance(record.get("raised", ""), str)),
        )
        if not ok
    ]
    if problems:
        raise SourceError(f"{where}: not a journal line (an arm record whose {problems[0]} is missing or wrong)")
    return record


def whole_record(raw: bytes, where: str, torn: list[str] | None) -> dict | None:
    """The record on one line, checked; None for a blank line. A torn line (a writer killed mid-line, a full disk)
    is skipped, its place appended to ``torn``: the final line without its newline, or a line in the middle that
    begins as a record does (``{``), and the record a restarted writer appended after the tear is read (the earliest
    ``{"`` after which the rest of the line is a whole record). A line that never began as a record is refused."""
    try:
        return record_of(raw, where)
    except SourceError:
        if len(raw) > MAX_LINE_BYTES or not (raw.startswith(b"{") or not raw.endswith(b"\n")) or _is_json(raw):
            raise  # (a whole JSON line that is no record is not a tear: it was written so)
        record = None
        start = raw.find(b'{"', 1)
        while start > 0 and record is None:
            try:
                record = record_of(raw[start:], where)
            except SourceError:
                start = raw.find(b'{"', start + 1)
        if torn is not None:
            torn.append(where)
        return record


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return True


def record_of(raw: bytes, where: str) -> dict | None:
    if len(raw) > MAX_LINE_BYTES:
        raise SourceError(f"{where}: a line longer than {MAX_LINE_BYTES >> 20} MiB: not a journal")
    if not raw.strip():
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SourceError(f"{where}: not a journal line ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(record, dict):
        raise SourceError(f"{where}: not a journal line (a JSON {type(record).__name__})")
    if "event" in record:
        event = record["event"]
        if event not in journal_format.EVENTS:
            raise SourceError(f"{where}: not a journal line (an unknown event)")
        if event in ("journal", "counts"):  # (a process's header; its counts, checked where they are read)
            return record
        if event == "arm":
            return check_arm(record, where)
        if event == "patch_calls":
            return check_patch_calls(record, where)
        if event not in ("rollback", "reset") or not isinstance(record.get("target"), str):
            raise SourceError(f"{where}: not a journal line (an unknown event, or one without its target)")
        if not isinstance(record.get("by"), str):
            raise SourceError(f"{where}: not a journal line (a {event} without who made it: by)")
        return record
    target, outcome = record.get("target"), record.get("outcome")
    signature, reasons = record.get("signature", ""), record.get("reasons", [])
    shared = record.get("shared_divergence")
    if not isinstance(target, str) or outcome not in OUTCOMES or not isinstance(signature, str):
        raise SourceError(f"{where}: not a journal line (target, outcome or signature missing or wrong)")
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise SourceError(f"{where}: not a journal line (reasons must be a list of strings)")
    if shared is not None and not isinstance(shared, str):
        raise SourceError(f"{where}: not a journal line (shared_divergence must be a string)")
    return journal_format.readable(record)
