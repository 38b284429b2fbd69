"""Where the verdict's counts come from: a Prometheus server, a saved exposition, or journals.

Sources are data from elsewhere and are checked as such: a source that is not what it claims (binary, not
UTF-8, too large, malformed), or whose counts cannot be counts (negative, fractional where they must be whole,
not finite, beyond what a float counts exactly) raises :class:`SourceError` naming the source and what is wrong.
Reading is bounded in time and memory.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporters import contract
from shadow.analysis.verdict import TargetCounts
from shadow.core.observation import OUTCOMES, Outcome

COMPARISONS = contract.COMPARISONS.series
MISMATCHES = contract.MISMATCHES.series
SHARED = contract.SHARED_DIVERGENCES.series
SKIPPED = contract.SKIPPED.series
CALLS = contract.CALLS.series
DRILL_ACTIVE = contract.DRILL_ACTIVE.prometheus_name
#: Comparisons in one process within this many seconds form one cluster (the verdict's clustered bound).
CLUSTER_WINDOW_SECONDS = 60.0

#: The most a metrics file, a journal line or a Prometheus answer may hold.
MAX_FILE_BYTES = 64 << 20
MAX_LINE_BYTES = 1 << 20
#: Counts beyond this are not exact in a float: no real counter gets there.
MAX_COUNT = float(2**53)


class SourceError(Exception):
    """A source could not be read; the message says which and why."""


def _count(value: object, where: str, whole: bool = True) -> float:
    """A checked count: finite, >= 0, at most MAX_COUNT and (unless ``whole`` is False) an integer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(f"{where}: {value!r} is not a number")
    if not math.isfinite(value) or value < 0 or value > MAX_COUNT:
        raise SourceError(f"{where}: {value!r} cannot be a count (negative, not finite or too large)")
    if whole and value != int(value):
        raise SourceError(f"{where}: {value!r} is not a whole count")
    return float(value)


def _add(counts: dict[str, TargetCounts], name: str, labels: dict[str, str], value: float) -> None:
    target = counts.setdefault(labels.get("target", ""), TargetCounts())
    if name == COMPARISONS:
        target.add_outcome(labels.get("signature", ""), labels.get("outcome", ""), value)
    elif name == MISMATCHES:
        target.add_reason(labels.get("reason", ""), value)
    elif name == SKIPPED:
        target.add_skip(labels.get("reason", ""), value)
    elif name == CALLS:
        target.add_calls(labels.get("signature", ""), value)
    else:
        target.add_shared(labels.get("reason", ""), value)


def read_text(path: str, limit: int = MAX_FILE_BYTES) -> str:
    """A text file of at most ``limit`` bytes, UTF-8, without NUL bytes; else SourceError."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise SourceError(f"{path} is larger than {limit >> 20} MiB: not a metrics file")
    if b"\0" in data:
        raise SourceError(f"{path} holds binary data (NUL bytes): not a text exposition")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text: {exc}") from exc


def from_exposition(text: str, source: str = "exposition") -> dict[str, TargetCounts]:
    """Counts from a Prometheus text exposition (a saved scrape, a textfile-collector file)."""
    counts: dict[str, TargetCounts] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:
        raise SourceError(f"{source}: not a Prometheus text exposition: {exc}") from exc
    drill = False
    for family in families:
        for sample in family.samples:
            if sample.name in (COMPARISONS, MISMATCHES, SHARED, SKIPPED, CALLS):
                where = f"{source}: {sample.name}{dict(sample.labels)}"
                _add(counts, sample.name, sample.labels, _count(sample.value, where))
            elif sample.name == DRILL_ACTIVE and sample.value > 0:
                drill = True
    if drill:
        for entry in counts.values():
            entry.drilled = -1
    return counts


def _fetch(address: str, timeout: float) -> bytes:
    """The body at ``address``, in at most ``timeout`` seconds however slowly the server answers (a server that
    trickles a byte at a time is given up on, not waited for). Raises SourceError."""
    outcome: list[Any] = []

    def fetch() -> None:
        try:
            with urllib.request.urlopen(address, timeout=timeout) as response:
                outcome.append(response.read(MAX_FILE_BYTES + 1))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=fetch, name="npu-shadow-query", daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:  # (the daemon thread is abandoned: it ends with its socket's timeout, or with the process)
        raise SourceError(f"{address.split('/api/')[0]} did not answer within {timeout:g} s")
    if isinstance(outcome[0], BaseException):
        raise SourceError(f"cannot query {address.split('/api/')[0]}: {outcome[0]}") from outcome[0]
    return outcome[0]


def _query(url: str, promql: str, timeout: float) -> list[dict]:
    address = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    raw = _fetch(address, timeout)
    if len(raw) > MAX_FILE_BYTES:
        raise SourceError(f"{url} answered more than {MAX_FILE_BYTES >> 20} MiB")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise SourceError(f"{url} did not answer JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise SourceError(f"{url} answered {type(body).__name__}, not a Prometheus API object")
    if body.get("status") != "success":
        raise SourceError(f"{url} answered {body.get('errorType')}: {body.get('error')}")
    data = body.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or not all(
        isinstance(item, dict)
        and isinstance(item.get("metric"), dict)
        and isinstance(item.get("value"), list)
        and len(item["value"]) == 2
        for item in result
    ):
        raise SourceError(f"{url} answered success without a vector of samples for {promql}")
    return result


def from_prometheus(
    url: str, window: str | None = None, selector: str = "", timeout: float = 30
) -> dict[str, TargetCounts]:
    """Counts from a Prometheus server: increases over ``window`` (e.g. '6h'), or the counters' current
    values when no window is given; ``selector`` narrows the series, e.g. 'job="train"'. All queries together
    take at most ``timeout`` seconds."""

    def series(metric: str) -> str:
        selected = f"{metric}{{{selector}}}"
        return f"increase({selected}[{window}])" if window else selected

    counts: dict[str, TargetCounts] = {}
    queries = [
        (COMPARISONS, "target, signature, outcome"),
        (MISMATCHES, "target, reason"),
        (SHARED, "target, reason"),
        (SKIPPED, "target, reason"),
        (CALLS, "target, signature"),
    ]
    deadline = time.monotonic() + timeout
    for metric, by in queries:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SourceError(f"{url} did not answer within {timeout:g} s")
        for item in _query(url, f"sum by ({by}) ({series(metric)})", remaining):
            labels = {str(k): str(v) for k, v in item["metric"].items()}
            where = f"{url}: {metric}{labels}"
            try:
                value = float(item["value"][1])
            except (TypeError, ValueError):
                raise SourceError(f"{where}: {item['value'][1]!r} is not a number") from None
            # increase() extrapolates to the window's edges: fractional there, never negative
            value = _count(value, where, whole=window is None)
            _add(counts, metric, labels, float(round(value)))
    if not counts:
        raise SourceError(f"{url} has no {COMPARISONS} series{f' matching {selector}' if selector else ''}")
    return counts


def journal_records(paths: Iterable[str], torn: list[str] | None = None) -> Iterator[dict]:
    """Every record of the journals, checked, one at a time (bounded memory however long they are).

    A final line without its newline that is not a whole record (a writer killed mid-line, a full disk) is
    skipped; its place is appended to ``torn`` when given."""
    for path in paths:
        try:
            with open(path, "rb") as handle:
                for number, raw in enumerate(iter(lambda h=handle: h.readline(MAX_LINE_BYTES + 1), b""), 1):
                    where = f"{path}:{number}"
                    try:
                        record = _journal_record(raw, where)
                    except SourceError:
                        if raw.endswith(b"\n") or len(raw) > MAX_LINE_BYTES:
                            raise
                        if torn is not None:
                            torn.append(where)
                        continue
                    if record is not None:
                        yield record
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc


def clustering(window: float) -> str:
    """How :func:`add_record` forms clusters, as the verdict says it."""
    return f"process x {window:g} s windows" if window > 0 else "process"


def add_record(counts: dict[str, TargetCounts], record: dict, window: float = CLUSTER_WINDOW_SECONDS) -> None:
    """Count one journal record, in its cluster: its process (host, pid) and ``window`` seconds of its time."""
    entry = counts.setdefault(record["target"], TargetCounts())
    if record.get("event") == "rollback":
        entry.rollbacks.append(str(record["by"]))
        return
    entry.add_outcome(record.get("signature", ""), record["outcome"], 1)
    if record.get("drill") is True:
        entry.drilled += 1
    timestamp, pid = record.get("timestamp"), record.get("pid")
    if isinstance(timestamp, (int, float)) and math.isfinite(timestamp) and pid is not None:
        slot = int(timestamp // window) if window > 0 else 0
        entry.add_to_cluster((record.get("host"), pid, slot), record["outcome"])
        entry.clustering = clustering(window)
    for reason in record.get("reasons", []):
        if record["outcome"] == Outcome.SKIPPED:
            entry.add_skip(reason, 1)
        else:
            entry.add_reason(reason, 1)
    if record.get("shared_divergence"):
        entry.add_shared(record["shared_divergence"], 1)


def from_journal(
    paths: Iterable[str], torn: list[str] | None = None, window: float = CLUSTER_WINDOW_SECONDS
) -> dict[str, TargetCounts]:
    """Counts from JSONL journals, with each comparison's cluster (process and ``window`` seconds). Journals hold
    matches only when written with ``all_outcomes=True``; a torn final line is skipped (see
    :func:`journal_records`)."""
    counts: dict[str, TargetCounts] = {}
    for record in journal_records(paths, torn):
        add_record(counts, record, window)
    return counts


def _journal_record(raw: bytes, where: str) -> dict | None:
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
    if "event" in record:  # (a rollback: when the switch made legacy the primary, and who threw it)
        if (
            record["event"] != "rollback"
            or not isinstance(record.get("target"), str)
            or not isinstance(record.get("by"), str)
        ):
            raise SourceError(f"{where}: not a journal line (an event other than a rollback, or without target/by)")
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
    return record
