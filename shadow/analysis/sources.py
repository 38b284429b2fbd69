"""Where the verdict's counts come from: a Prometheus server, a saved exposition, or journals.

Sources are data from elsewhere and are checked as such: a source that is not what it claims (binary, not
UTF-8, too large, malformed), or whose counts cannot be counts (negative, fractional where they must be whole,
not finite, beyond what a float counts exactly) raises :class:`SourceError` naming the source and what is wrong.
Reading is bounded in time and memory.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporters import contract
from shadow.analysis import verdict
from shadow.analysis.verdict import TargetCounts
from shadow.core.model.observation import (
    BACKWARD_OUTCOMES,
    COMPARED_OUTCOMES,
    DECADE_LIMIT,
    DIFFERS_IN_FLOAT64,
    DIVERGENT_OUTCOMES,
    LEGACY,
    NEARER,
    OUTCOMES,
    PRIMARY_SIDES,
    Outcome,
    bounded,
    error_decade,
    label_text,
)

COMPARISONS = contract.COMPARISONS.series
MISMATCHES = contract.MISMATCHES.series
SHARED = contract.SHARED_DIVERGENCES.series
SKIPPED = contract.SKIPPED.series
CALLS = contract.CALLS.series
CLUSTERS = contract.CLUSTERS.series
PROCESS_TIME = contract.PROCESS_TIME.series
TRUTH_RUNS = contract.TRUTH_RUNS.series
BACKWARD_RUNS = contract.BACKWARD_RUNS.series
ROLLBACKS = contract.ROLLBACKS.series
RESETS = contract.RESETS.series
DRILL_ACTIVE = contract.DRILL_ACTIVE.prometheus_name
#: The canary A/B's series (shadow.analysis.arms reads them: not comparisons).
ARM_SERIES = (
    contract.ARM_ITERATORS.series,
    contract.ARM_FIRST_BATCH.series,
    contract.ARM_FIRST_BATCHES.series,
)
BUILD_INFO = contract.BUILD_INFO.prometheus_name
#: Comparisons in one process within this many seconds form one cluster (the verdict's clustered bound).
CLUSTER_WINDOW_SECONDS = 60.0
#: A process's wall clock and monotonic clock parting by more than this between two count records is a jump, said.
CLOCK_JUMP_SECONDS = 5.0

#: The most a metrics file, a journal line or a Prometheus answer may hold.
MAX_FILE_BYTES = 64 << 20
MAX_LINE_BYTES = 1 << 20
#: Counts beyond this are not exact in a float: no real counter gets there.
MAX_COUNT = float(2**53)


class SourceError(Exception):
    """A source could not be read; the message says which and why."""


#: How far back an exact Prometheus read looks for a run's last samples (Prometheus keeps 15 days by default).
LOOKBACK = "31d"
_RUN_LABEL = contract.RUN_LABEL


def run_names(runs: Iterable[str], most: int = 8) -> str:
    """Runs as a message lists them ("" is evidence from before runs had ids)."""
    names = [run or "(unnamed)" for run in sorted(runs)]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def select_run(runs: Iterable[str], run: str | None, all_runs: bool, source: str) -> str | None:
    """The run a decision is made on: ``run`` (refused where the source holds none of its evidence), else the only
    run there is; None where the evidence of every run is pooled (``all_runs``, or a source of one run). A source
    holding several runs without one of the two is refused (SourceError), naming them: two runs are never mixed
    unasked."""
    found = set(runs)
    if run is not None:
        if run not in found:
            raise SourceError(f"{source} holds no evidence of run {run!r}; it holds {run_names(found) or 'none'}")
        return run
    if all_runs or len(found) <= 1:
        return None
    raise SourceError(
        f"{source} holds {len(found)} runs: {run_names(found)}; choose one with --run ID, or pool them with --all-runs"
    )


def _shown(value: object) -> str:
    """A value from a source, for a message: a huge integer by its size (its digits could be thousands)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return bounded(repr(value), 80)


def _count(value: object, where: str, whole: bool = True) -> float:
    """A checked count: finite, >= 0, at most MAX_COUNT and (unless ``whole`` is False) an integer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(f"{where}: {_shown(value)} is not a number")
    # (an int past a float's range, 10**400, is compared as an int: never turned into a float that overflows)
    if not (0 <= value <= MAX_COUNT) or (isinstance(value, float) and not math.isfinite(value)):
        raise SourceError(f"{where}: {_shown(value)} cannot be a count (negative, not finite or too large)")
    if whole and value != int(value):
        raise SourceError(f"{where}: {value!r} is not a whole count")
    return float(value)


def _add(counts: dict[str, TargetCounts], name: str, labels: dict[str, str], value: float) -> None:
    if name in (ROLLBACKS, RESETS) and value <= 0:
        return
    target = counts.setdefault(labels.get("target", ""), TargetCounts())
    primary = labels.get("primary") or LEGACY  # (series from before the primary label: legacy's)
    if name == ROLLBACKS:
        target.rollbacks.append(f"{round(value)} by {labels.get('source', '?')} ({ROLLBACKS})")
        target.counted_rollbacks += value
    elif name == RESETS:
        target.counted_resets += value
    elif name == COMPARISONS:
        target.add_outcome(labels.get("signature", ""), labels.get("outcome", ""), value, primary)
    elif name == MISMATCHES:
        target.add_reason(labels.get("reason", ""), value, primary)
    elif name == SKIPPED:
        target.add_skip(labels.get("reason", ""), value, primary, labels.get("signature", ""))
    elif name == CALLS:
        target.add_calls(labels.get("signature", ""), value, primary)
    elif name == CLUSTERS:
        target.add_clusters(value, primary)
    elif name == TRUTH_RUNS:
        if labels.get("nearer") in NEARER:
            target.add_truth(labels.get("signature", ""), labels["nearer"], value, primary)
    elif name == BACKWARD_RUNS:
        if labels.get("outcome") in BACKWARD_OUTCOMES:  # (series from before the outcome label: not evidence)
            target.add_backward(labels.get("signature", ""), labels["outcome"], value, primary)
    else:
        target.add_shared(labels.get("reason", ""), value, primary)


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


_COUNTED = (
    COMPARISONS, MISMATCHES, SHARED, SKIPPED, CALLS, CLUSTERS, ROLLBACKS, RESETS, TRUTH_RUNS, BACKWARD_RUNS,
)  # fmt: skip


def _honour_resets(counts: dict[str, TargetCounts]) -> dict[str, TargetCounts]:
    """A target whose metrics count as many resets as rollbacks was reset by a person after each: no rollback
    stands (each reset follows a rollback)."""
    for entry in counts.values():
        if entry.counted_rollbacks and entry.counted_resets >= entry.counted_rollbacks:
            entry.rollbacks = [r for r in entry.rollbacks if not r.endswith(f"({ROLLBACKS})")]
            entry.resets.append(f"{round(entry.counted_resets)} by a person ({RESETS})")
    return counts


def from_exposition(
    text: str,
    source: str = "exposition",
    run: str | None = None,
    all_runs: bool = False,
    arms: list[tuple[str, dict[str, str], float]] | None = None,
    slices: dict[str, dict[str, TargetCounts]] | None = None,
) -> dict[str, TargetCounts]:
    """Counts from a Prometheus text exposition (a saved scrape, a textfile-collector file): of ``run``, or of the
    one run it holds (see :func:`select_run`). ``arms``, when given, receives the canary A/B's samples (series,
    labels, value); ``slices``, each run's counts where several are pooled (one moment holds no recent window)."""
    counts: dict[str, TargetCounts] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:
        raise SourceError(f"{source}: not a Prometheus text exposition: {exc}") from exc
    runs = {s.labels.get(_RUN_LABEL, "") for family in families for s in family.samples if s.name in _COUNTED}
    chosen = select_run(runs, run, all_runs, source)
    if slices is not None and chosen is None and len(runs) > 1:
        for each in sorted(runs):
            slices[verdict.run_slice(each)] = from_exposition(text, source, each)
    drill = False
    seconds = 0.0
    for family in families:
        for sample in family.samples:
            if chosen is not None and sample.labels.get(_RUN_LABEL, "") != chosen:
                continue
            if sample.name == PROCESS_TIME:
                seconds += _count(sample.value, f"{source}: {sample.name}", whole=False)
            elif sample.name in _COUNTED:
                where = f"{source}: {sample.name}{dict(sample.labels)}"
                _add(counts, sample.name, sample.labels, _count(sample.value, where, whole=sample.name != CLUSTERS))
            elif sample.name == DRILL_ACTIVE and sample.value > 0:
                drill = True
            elif sample.name in ARM_SERIES and arms is not None:
                where = f"{source}: {sample.name}{dict(sample.labels)}"
                arms.append((sample.name, dict(sample.labels), _count(sample.value, where, whole=False)))
    if drill:
        for entry in counts.values():
            entry.drilled = -1
    for entry in counts.values():
        entry.process_seconds = seconds
    return _honour_resets(counts)


def environment_from_exposition(text: str) -> dict[str, set[str]]:
    """What the processes behind an exposition ran ({"torch": {...}, "torch_npu": {...}, "npu-shadow": {...}}),
    from their ``npu_shadow_build_info`` series; {} where there is none (or the text is not an exposition)."""
    found: dict[str, set[str]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == BUILD_INFO and sample.value > 0:
                    for label, field in (
                        ("run", "run"), ("torch", "torch"), ("torch_npu", "torch_npu"), ("version", "npu-shadow")
                    ):  # fmt: skip
                        if sample.labels.get(label):
                            found.setdefault(field, set()).add(label_text(sample.labels[label], 64))
    except Exception:  # (from_exposition says what is wrong with the text)
        return {}
    return found


def _fetch(address: str, timeout: float, said: float | None = None) -> bytes:
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
        raise SourceError(f"{address.split('/api/')[0]} did not answer within {said or timeout:g} s")
    if isinstance(outcome[0], BaseException):
        said = ""
        if isinstance(outcome[0], urllib.error.HTTPError):  # (Prometheus says what it refused, in JSON)
            try:
                said = f" ({json.loads(outcome[0].read(4096)).get('error')})"
            except Exception:
                said = ""
        raise SourceError(f"cannot query {address.split('/api/')[0]}: {outcome[0]}{said}") from outcome[0]
    return outcome[0]


def _query(
    url: str, promql: str, timeout: float, at: float | None = None, matrix: bool = False, said: float | None = None
) -> list[dict]:
    """The result of an instant query (at ``at``, unix seconds, when given): a vector, or with ``matrix`` the raw
    samples of a range selector. ``said``: the time limit a timeout names (the whole read's)."""
    params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
    address = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode(params)}"
    raw = _fetch(address, timeout, said)
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
    key = "values" if matrix else "value"
    if not isinstance(result, list) or not all(
        isinstance(item, dict)
        and isinstance(item.get("metric"), dict)
        and isinstance(item.get(key), list)
        and (matrix or len(item["value"]) == 2)
        for item in result
    ):
        raise SourceError(f"{url} answered success without a {'matrix' if matrix else 'vector'} for {promql}")
    return result


def _number(value: object, where: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SourceError(f"{where}: {value!r} is not a number") from None


def _labels(item: dict) -> dict[str, str]:
    return {str(k): str(v) for k, v in item["metric"].items() if k != "__name__"}


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))


_QUERIES = [
    (COMPARISONS, "target, signature, outcome, primary"),
    (MISMATCHES, "target, reason, primary"),
    (SHARED, "target, reason, primary"),
    (SKIPPED, "target, reason, signature, primary"),
    (CALLS, "target, signature, primary"),
    (CLUSTERS, "target, primary"),
    (ROLLBACKS, "target, source"),
    (RESETS, "target"),
    (TRUTH_RUNS, "target, signature, nearer, primary"),
    (BACKWARD_RUNS, "target, signature, outcome, primary"),
]


class _Deadline:
    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout, self.end = url, timeout, time.monotonic() + timeout

    def left(self) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise SourceError(f"{self.url} did not answer within {self.timeout:g} s")
        return remaining

    def query(self, promql: str, at: float | None = None, matrix: bool = False) -> list[dict]:
        """:func:`_query` within what is left of the read's time."""
        return _query(self.url, promql, self.left(), at, matrix, said=self.timeout)


def _exact(
    url: str, metric: str, selector: str, at: float | None, deadline: _Deadline, whole: bool = True
) -> dict[tuple, float]:
    """Each series' exact count at ``at`` (now where None): its last sample at or before then, with what it had
    counted before each reset added (a process of the run that started again), never an extrapolation. By the
    series' sorted label items."""
    selected = f"{metric}{{{selector}}}[{LOOKBACK}]"
    values = {}
    for item in deadline.query(f"last_over_time({selected})", at):
        labels, where = _labels(item), f"{url}: {metric}{_labels(item)}"
        values[tuple(sorted(labels.items()))] = _count(_number(item["value"][1], where), where, whole)
    for item in deadline.query(f"resets({selected}) > 0", at):
        labels = _labels(item)
        raw = deadline.query(f"{metric}{{{_selector(labels)}}}[{LOOKBACK}]", at, matrix=True)
        for series in raw:
            points = [_number(value, f"{url}: {metric}{labels}") for _, value in series["values"]]
            lost = sum(before for before, after in itertools.pairwise(points) if after < before)
            values[tuple(sorted(_labels(series).items()))] = points[-1] + lost if points else 0.0
    return values


def _prometheus_slices(
    url: str,
    selector: str,
    deadline: _Deadline,
    runs: set[str],
    chosen: str | None,
    start: float | None,
    end: float | None,
    recent: float,
) -> dict[str, dict[str, TargetCounts]]:
    """The recent window's counts (where the range read is longer) and each run's where several are pooled, read
    within what is left of the one timeout."""
    found = {}
    finish = time.time() if end is None else end
    if recent > 0 and (start is None or start < finish - recent):
        found[verdict.recent_slice(recent)] = from_prometheus(
            url, None, selector, deadline.left(), chosen, True, finish - recent, finish
        )
    if chosen is None and len(runs) > 1:
        for each in sorted(runs):
            found[verdict.run_slice(each)] = from_prometheus(
                url, None, selector, deadline.left(), each, False, start, end
            )
    return found


def _exact_between(
    url: str,
    metric: str,
    selector: str,
    start: float | None,
    end: float | None,
    deadline: _Deadline,
    spans: list[tuple[float | None, float]],
    set_aside: dict[str, float],
    whole: bool | None = None,
) -> dict[tuple, float]:
    """Each series' exact count from ``start`` to ``end`` (:func:`_exact`; ``whole``: counts, not seconds or a
    rank's share of a cluster), less what it counted in each fire drill's span (the comparisons set aside added to
    ``set_aside`` by target)."""
    if whole is None:
        whole = metric not in (CLUSTERS, PROCESS_TIME)
    series = _exact(url, metric, selector, end, deadline, whole)
    if start is not None:
        before = _exact(url, metric, selector, start, deadline, whole)
        series = {key: value - before.get(key, 0.0) for key, value in series.items()}
    for on, off in spans if metric not in (ROLLBACKS, RESETS) else ():
        drilled = _counted_between(url, metric, selector, on, off, deadline, whole)
        series = {key: max(value - drilled.get(key, 0.0), 0.0) for key, value in series.items()}
        for key, value in drilled.items() if metric == COMPARISONS else ():
            labels = dict(key)
            if labels.get("outcome") in COMPARED_OUTCOMES:
                set_aside[labels.get("target", "")] = set_aside.get(labels.get("target", ""), 0.0) + value
    return series


def _drill_spans(
    url: str, selector: str, start: float | None, end: float | None, deadline: _Deadline
) -> tuple[list[tuple[float | None, float]], bool]:
    """The fire drills in the read's span, from the history of their gauge (any process of the run): (spans
    that are over, each from the last sample without a drill before it (None: from the start) to the first
    sample without one after it; whether a drill is still active at the end). A span's counts are the drill's
    and whatever else was counted meanwhile: set aside whole, the evidence outside it decides."""
    raw = deadline.query(f"{DRILL_ACTIVE}{{{selector}}}[{LOOKBACK}]", end, matrix=True)
    spans: list[tuple[float | None, float]] = []
    drilling = False
    for series in raw:
        on = start
        active = False
        for moment, value in series["values"]:
            when = _number(moment, f"{url}: {DRILL_ACTIVE}")
            if start is not None and when < start:
                continue
            if _number(value, f"{url}: {DRILL_ACTIVE}") > 0:
                active = True
            elif active:
                spans.append((on, when))
                active, on = False, when
            else:
                on = when
        drilling = drilling or active
    merged: list[tuple[float | None, float]] = []
    for on, off in sorted(spans, key=lambda span: -math.inf if span[0] is None else span[0]):
        if merged and (on is None or on < merged[-1][1]):
            merged[-1] = (merged[-1][0], max(merged[-1][1], off))
        else:
            merged.append((on, off))
    return merged, drilling


def _counted_between(
    url: str, metric: str, selector: str, on: float | None, off: float, deadline: _Deadline, whole: bool
) -> dict[tuple, float]:
    """Each series' count from ``on`` (None: from its start) to ``off``, exactly (:func:`_exact`)."""
    after = _exact(url, metric, selector, off, deadline, whole)
    before = _exact(url, metric, selector, on, deadline, whole) if on is not None else {}
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _runs(url: str, selector: str, at: float | None, deadline: _Deadline, lookback: str = LOOKBACK) -> set[str]:
    promql = f"count by ({_RUN_LABEL}) (last_over_time({CALLS}{{{selector}}}[{lookback}]))"
    return {str(item["metric"].get(_RUN_LABEL, "")) for item in deadline.query(promql, at)}


def from_prometheus(
    url: str,
    window: str | None = None,
    selector: str = "",
    timeout: float = 30,
    run: str | None = None,
    all_runs: bool = False,
    start: float | None = None,
    end: float | None = None,
    arms: list[tuple[str, dict[str, str], float]] | None = None,
    recent: float = 0.0,
    slices: dict[str, dict[str, TargetCounts]] | None = None,
) -> dict[str, TargetCounts]:
    """Counts from a Prometheus server, of ``run`` or of the one run it holds (:func:`select_run`; the runs seen in
    the last :data:`LOOKBACK`): each counter's exact value at ``end`` (default now; its last sample at or before,
    resets counted, so a run that has ended is read as it ended), less its value at ``start`` where given.
    ``window`` (e.g. '6h') instead takes ``increase()`` over the window before now, an extrapolation kept for
    dashboards' sake. ``selector`` narrows the series, e.g. 'job="train"'. All queries together take at most
    ``timeout`` seconds. ``arms``, when given, receives the canary A/B's series (series, labels, value).
    ``slices``, when given, receives the counts of the last ``recent`` seconds before ``end`` (where the range
    read is longer) and, where several runs are pooled, of each run (:func:`shadow.analysis.verdict.decide`)."""
    deadline = _Deadline(url, timeout)
    runs = _runs(url, selector, end, deadline, window or LOOKBACK)
    chosen = select_run(runs, run, all_runs, f"{url}{f' ({selector})' if selector else ''}")
    if slices is not None and not window:
        slices.update(_prometheus_slices(url, selector, deadline, runs, chosen, start, end, recent))
    if chosen is not None:
        selector = ",".join(filter(None, [selector, f"{_RUN_LABEL}={json.dumps(chosen)}"]))
    counts: dict[str, TargetCounts] = {}
    spans, drilling = ([], False) if window else _drill_spans(url, selector, start, end, deadline)
    set_aside: dict[str, float] = {}
    for metric, by in _QUERIES:
        if window:
            promql = f"sum by ({by}) (increase({metric}{{{selector}}}[{window}]))"
            series = {
                tuple(sorted(_labels(item).items())): _number(item["value"][1], f"{url}: {metric}{_labels(item)}")
                for item in deadline.query(promql)
            }
        else:
            series = _exact_between(url, metric, selector, start, end, deadline, spans, set_aside)
        for key, value in series.items():
            labels = dict(key)
            # increase() extrapolates to the window's edges: fractional there, never negative
            value = _count(value, f"{url}: {metric}{labels}", whole=window is None and metric != CLUSTERS)
            _add(counts, metric, labels, value if metric == CLUSTERS else float(round(value)))
    if not counts:
        raise SourceError(f"{url} has no {COMPARISONS} series{f' matching {selector}' if selector else ''}")
    for metric in ARM_SERIES if arms is not None and not window else ():
        series = _exact_between(url, metric, selector, start, end, deadline, [], {}, whole=False)
        arms.extend((metric, dict(key), value) for key, value in series.items())  # type: ignore[union-attr]
    for target, entry in counts.items():
        entry.drilled = -1 if drilling else 0
        entry.drill_set_aside = 0.0 if drilling else set_aside.get(target, 0.0)
    if not window:
        seconds = sum(_exact_between(url, PROCESS_TIME, selector, start, end, deadline, [], {}).values())
        for entry in counts.values():
            entry.process_seconds = max(seconds, 0.0)
    return _honour_resets(counts)


def journal_records(paths: Iterable[str], torn: list[str] | None = None) -> Iterator[dict]:
    """Every record of the journals, checked, one at a time (bounded memory however long they are).

    A final line without its newline that is not a whole record (a writer killed mid-line, a full disk) is
    skipped; its place is appended to ``torn`` when given."""
    for path in paths:
        try:
            with open(path, "rb") as handle:
                for number, raw in enumerate(iter(lambda h=handle: h.readline(MAX_LINE_BYTES + 1), b""), 1):
                    record = _whole_record(raw, f"{path}:{number}", torn)
                    if record is not None:
                        yield record
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc


def clustering(window: float) -> str:
    """How journals' comparisons are clustered, as the verdict says it."""
    return f"process x {window:g} s blocks from its start" if window > 0 else "process"


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
#: An outcome line as the journal exporter frames it: its process is read without parsing the line (fast path).
_OUTCOME_START = b'{"time":'
_PROCESS_FIELDS = re.compile(rb',"host":("(?:[^"\\]|\\.)*"|null),"pid":(\d+),"stream":"([0-9a-f]*)"')


@dataclasses.dataclass
class _Phase:
    """One (target, primary) of one process stream."""

    counts: dict | None = None  # the last count record (cumulative)
    baseline: dict | None = None  # the count record at its target's last reset (set aside)
    intervals: list = dataclasses.field(default_factory=list)  # (timestamp, compared, divergent)
    previous: tuple[float, float] = (0.0, 0.0)  # cumulative (compared, divergent) at the last count record
    #: Its count records since its target's last reset as (wall time, counts), oldest first, those before the
    #: reader's recent window dropped as reading goes (all but the last of them: the window's baseline).
    history: collections.deque = dataclasses.field(default_factory=collections.deque)
    #: A fire drill's span in it: the count record before its drilled count first grew (None: from the start) and
    #: the last one where it grew, with their times.
    drill_before: tuple[float, dict] | None = None
    drill_last: tuple[float, dict] | None = None
    at: float = -math.inf  # (the last count record's time)


@dataclasses.dataclass
class _Tail:
    """The lines of one (target, primary) after a process's last count record, counted: bounded memory however
    many (their times by the second)."""

    outcomes: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, outcome)
    skipped: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, reason)
    reasons: dict[tuple[str, bool], float] = dataclasses.field(default_factory=dict)  # (reason, divergent line)
    shared: dict[str, float] = dataclasses.field(default_factory=dict)
    drilled: dict[bool, float] = dataclasses.field(default_factory=dict)  # divergent line -> drilled lines
    truth: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, nearer)
    truth_decades: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, decade)
    backward: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (signature, found)
    seconds: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # second -> [compared, divergent]
    lines: int = 0

    def add(self, record: dict) -> None:
        self.lines += 1
        signature, outcome = record.get("signature", ""), record["outcome"]
        if outcome == Outcome.SKIPPED:
            for reason in record.get("reasons", []):
                self.skipped[(signature, reason)] = self.skipped.get((signature, reason), 0) + 1
            return
        divergent = outcome in DIVERGENT_OUTCOMES
        self.outcomes[(signature, outcome)] = self.outcomes.get((signature, outcome), 0) + 1
        for reason in record.get("reasons", []):
            self.reasons[(reason, divergent)] = self.reasons.get((reason, divergent), 0) + 1
        if record.get("shared_divergence"):
            self.shared[record["shared_divergence"]] = self.shared.get(record["shared_divergence"], 0) + 1
        if record.get("drill") is True:
            self.drilled[divergent] = self.drilled.get(divergent, 0) + 1
        if record.get("backward") is True:
            found = "mismatch" if "grad" in record.get("reasons", []) else "match"
            self.backward[(signature, found)] = self.backward.get((signature, found), 0) + 1
        nearer = record.get("nearer")
        if nearer in NEARER:
            self.truth[(signature, nearer)] = self.truth.get((signature, nearer), 0) + 1
            errors = record.get("legacy_truth_error"), record.get("upstream_truth_error")
            numbers = all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in errors)
            if numbers and nearer != DIFFERS_IN_FLOAT64:  # (errors against two runs: no ratio)
                decade = error_decade(*errors)
                if decade is not None:
                    key = (signature, str(decade))
                    self.truth_decades[key] = self.truth_decades.get(key, 0) + 1
        timestamp = record.get("timestamp")
        second = int(timestamp) if isinstance(timestamp, (int, float)) and math.isfinite(timestamp) else 0
        counts = self.seconds.setdefault(second, [0.0, 0.0])
        counts[0] += 1
        counts[1] += divergent


@dataclasses.dataclass
class _Stream:
    """One process's writing (host, pid, stream): whether it writes every outcome, its count records, its events,
    the lines after its last count record."""

    where: str
    all_outcomes: bool | None = None
    start: float | None = None
    last: float | None = None
    phases: dict[tuple[str, str], _Phase] = dataclasses.field(default_factory=dict)
    events: list[dict] = dataclasses.field(default_factory=list)  # rollbacks and resets, in order
    #: Where its unparsed lines after the last count record begin, file by file (path, offset, line number): read
    #: again at the end, so that lines a count record covers are never parsed and memory stays bounded.
    marks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    folded: dict[tuple[str, str], _Tail] = dataclasses.field(default_factory=dict)  # tail lines counted
    counted: bool = False  # has count records
    tail_timed: bool = False  # the times of the lines after its last count record are in its phases' intervals
    run: str = ""  # the run its records name ("": before runs had ids)
    arms: list[dict] = dataclasses.field(
        default_factory=list
    )  # its canary A/B's iterators (shadow.core.calls.canary.arms)
    #: Its count records' monotonic clock (``mono``) and wall clock at the first and the last of them: its clusters
    #: follow the monotonic clock, which no wall-clock jump moves.
    mono_start: float | None = None
    clock: tuple[float, float] | None = None  # (wall, mono) of the last count record
    jumps: list[str] = dataclasses.field(default_factory=list)  # the wall clock's jumps, said

    def see(self, timestamp: object) -> None:
        if isinstance(timestamp, (int, float)) and math.isfinite(timestamp):
            self.start = timestamp if self.start is None else min(self.start, timestamp)
            self.last = timestamp if self.last is None else max(self.last, timestamp)

    def process_time(self, record: dict, where: str) -> float:
        """Where a count record falls on the process's own time: its monotonic clock where the record has one
        (a jump of the wall clock between two records is said, and adds no time), else its timestamp."""
        wall, mono = record["timestamp"], record.get("mono")
        if mono is None:
            return wall
        if isinstance(mono, bool) or not isinstance(mono, (int, float)) or not math.isfinite(mono):
            raise SourceError(f"{where}: a count record whose mono is {json.dumps(mono)}, not a finite number")
        if self.clock is not None:
            jump = (wall - self.clock[0]) - (mono - self.clock[1])
            if abs(jump) > CLOCK_JUMP_SECONDS:
                self.jumps.append(f"{where}: the wall clock jumped {jump:+.0f} s (clusters follow the monotonic clock)")
        self.clock = (wall, mono)
        self.mono_start = mono if self.mono_start is None else min(self.mono_start, mono)
        return mono

    def on_process_time(self, wall: float) -> float:
        """A wall-clock time (an outcome line after the last count record) on the process's own time."""
        return wall if self.clock is None else self.clock[1] + (wall - self.clock[0])

    @property
    def origin(self) -> float | None:
        """The start of the process's own time: its first monotonic reading, else its first timestamp."""
        return self.mono_start if self.mono_start is not None else self.start

    @property
    def seconds(self) -> float:
        """How long the process ran, on its own time."""
        if self.mono_start is not None and self.clock is not None:
            return self.clock[1] - self.mono_start
        return self.last - self.start if self.start is not None and self.last is not None else 0.0


def _compared(counts: dict) -> tuple[float, float]:
    compared = divergent = 0.0
    for by_outcome in counts.get("outcomes", {}).values():
        for outcome, value in by_outcome.items():
            compared += value if outcome in COMPARED_OUTCOMES else 0
            divergent += value if outcome in DIVERGENT_OUTCOMES else 0
    return compared, divergent


def _check_counts(record: dict, where: str) -> dict:
    """A count record's fields, checked: nested maps of strings to whole counts."""
    if not isinstance(record.get("target"), str) or record.get("primary") not in PRIMARY_SIDES:
        raise SourceError(f"{where}: a count record without a target or a known primary")
    timestamp = record.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
        raise SourceError(
            f"{where}: a count record whose timestamp is {json.dumps(timestamp)}, not a finite number of seconds "
            "(when its comparisons were counted, which the clusters are cut by)"
        )

    def table(name: str, depth: int) -> dict:
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

    for outcomes in (table("outcomes", 2)).values():
        if any(o not in COMPARED_OUTCOMES for o in outcomes):
            raise SourceError(f"{where}: a count record with an unknown outcome")
    truth, decades, backward = table("truth", 2), table("truth_decades", 2), table("backward", 2)
    if any(found not in BACKWARD_OUTCOMES for by_found in backward.values() for found in by_found):
        raise SourceError(f"{where}: a count record with an unknown backward outcome")
    if any(side not in NEARER for by_side in truth.values() for side in by_side):
        raise SourceError(f"{where}: a count record with an unknown side nearer the truth")
    known = {str(d) for d in range(-DECADE_LIMIT, DECADE_LIMIT + 1)}
    if any(decade not in known for by_decade in decades.values() for decade in by_decade):
        raise SourceError(f"{where}: a count record with an unknown error decade")
    outcomes, skipped, calls = table("outcomes", 2), table("skipped", 2), table("calls", 1)
    drilled = _count(record.get("drilled", 0), f"{where}: drilled")
    _check_totals(outcomes, drilled, where)
    return {
        "outcomes": outcomes,
        "skipped": skipped,
        "reasons": table("reasons", 1),
        "shared": table("shared", 1),
        "calls": calls,
        "drilled": drilled,
        "truth": truth,
        "truth_decades": decades,
        "backward": backward,
        **({"clusters": _count(record["clusters"], f"{where}: clusters", whole=False)} if "clusters" in record else {}),
    }


def _check_totals(outcomes: dict, drilled: float, where: str) -> None:
    """A count record's drilled comparisons must be at most its comparisons. (Its calls may lag its comparisons: calls
    are reported each second, comparisons as they end.)"""
    compared = sum(n for by_outcome in outcomes.values() for n in by_outcome.values())
    if drilled > compared:
        raise SourceError(
            f"{where}: drilled: a count record with {drilled:g} drilled comparisons of {compared:g}: not a record "
            "npu-shadow writes"
        )


def _minus(now: dict, base: dict | None) -> dict:
    """Count record ``now`` less ``base`` (the evidence after a reset)."""
    if base is None:
        return now

    def less(a: dict, b: dict) -> dict:
        return {k: (less(v, b.get(k, {})) if isinstance(v, dict) else v - b.get(k, 0)) for k, v in a.items()}

    return {k: (less(v, base.get(k, {})) if isinstance(v, dict) else v - base.get(k, 0)) for k, v in now.items()}


class JournalReader:
    """Counts from JSONL journals, complete: every comparison of every process is counted, from its count records
    (cumulative, so a rotated-away file or a lost line loses no count) and the lines it wrote after its last one;
    a process that did not write every outcome and left lines after its last count record (killed before its
    final flush) has those lines' divergences counted as comparisons whose matches are not known. A process whose
    completeness cannot be told (no count record, no header saying it wrote every outcome) is refused.

    Each comparison's cluster is its process, in blocks of ``window`` seconds counted from the process's own first
    record (0: the whole process), a run of blocks with divergences kept whole (one incident). Evidence from before
    a target's last reset (after a rollback) is set aside."""

    def __init__(self, window: float = CLUSTER_WINDOW_SECONDS, run: str | None = None, recent: float = 0.0) -> None:
        # (a window can only widen the bound: one shorter than the default would count more clusters, more
        # evidence, from the same comparisons; 0 is the widest, a cluster per process)
        self.window = window if window == 0 else max(window, CLUSTER_WINDOW_SECONDS)
        #: Count only the processes of this run (None: every process read).
        self.run = run
        #: The length of the recent window :meth:`counts` can be asked for (seconds of wall time before the last
        #: record read; 0: none is kept), and the last record's time.
        self.recent = recent
        self.latest: float | None = None
        self.earliest = math.inf
        #: By target: the last count record's time where a drill grew, and where comparisons grew without one.
        self.drilled_until: dict[str, float] = {}
        self.clean_until: dict[str, float] = {}
        self.streams: dict[tuple, _Stream] = {}
        self._located: dict[bytes, _Stream] = {}  # an outcome line's process fields -> its process's stream
        self.torn: list[str] = []
        self.lines = 0

    def read(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._read_file(path)

    def runs(self) -> set[str]:
        """The runs of the processes read ("" for a process from before runs had ids)."""
        return {stream.run for stream in self.streams.values()}

    def arm_runs(self) -> list[dict]:
        """The canary A/B iterator records (``"event": "arm"``) of the processes counted, oldest first."""
        found = [r for s in self.streams.values() if self.run is None or s.run == self.run for r in s.arms]
        return sorted(found, key=lambda r: r.get("timestamp") if isinstance(r.get("timestamp"), (int, float)) else 0)

    def _read_file(self, path: str, only: _Stream | None = None, start: tuple[int, int] = (0, 0)) -> None:
        """Read one journal from ``start`` (offset, line number). An outcome line framed as the journal exporter
        frames it is only located (its process read from its last fields); everything else is parsed. With
        ``only``: the second reading of one process's tail, whose outcome lines are counted now."""
        offset, number = start
        located = self._located  # process fields (bytes) -> stream
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                readline = handle.readline
                while raw := readline(MAX_LINE_BYTES + 1):
                    number += 1
                    at, offset = offset, offset + len(raw)
                    if raw.startswith(_OUTCOME_START) and raw.endswith(b"\n"):
                        fields = raw[raw.rfind(b',"host":') :]
                        stream = located.get(fields) or self._locate(fields, f"{path}:{number}")
                        if stream is not None:
                            if only is stream:
                                self._count_tail_line(stream, raw, f"{path}:{number}")
                            elif only is None and path not in stream.marks:
                                stream.marks[path] = (at, number - 1)
                            continue
                    if only is not None:
                        continue
                    where = f"{path}:{number}"
                    record = _whole_record(raw, where, self.torn)
                    if record is not None:
                        self._add(record, where)
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if only is None:
            self.lines += number - start[1]

    def _locate(self, fields: bytes, where: str) -> _Stream | None:
        """The process whose last fields an outcome line ends with (never inside a string: the exporter escapes
        quotes), or None where they are not as the exporter writes them."""
        found = _PROCESS_FIELDS.match(fields)
        if found is None:
            return None
        try:
            host = json.loads(found[1])
        except ValueError:
            return None
        stream = self._located[fields] = self._stream((host, int(found[2]), found[3].decode()), where)
        return stream

    def _count_tail_line(self, stream: _Stream, raw: bytes, where: str) -> None:
        record = _journal_record(raw, where)
        if record is not None and "event" not in record:
            stream.see(record.get("timestamp"))
            primary = record.get("primary") if record.get("primary") in PRIMARY_SIDES else LEGACY
            stream.folded.setdefault((record["target"], primary), _Tail()).add(record)

    def _stream(self, key: tuple, where: str) -> _Stream:
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = _Stream(where)
        return stream

    @staticmethod
    def _key(record: dict, where: str) -> tuple:
        pid = record.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise SourceError(
                f"{where}: a record without its process (pid): which process's counts it belongs to, and its "
                "cluster, cannot be told"
            )
        host, stream = record.get("host"), record.get("stream", "")
        if not (host is None or isinstance(host, str)) or not isinstance(stream, str):
            raise SourceError(f"{where}: a record whose host or stream is not a string")
        return (host, pid, stream)

    def _add(self, record: dict, where: str) -> None:
        stream = self._stream(self._key(record, where), where)
        stream.see(record.get("timestamp"))
        if isinstance(record.get("run"), str):
            stream.run = record["run"]
        event = record.get("event")
        if event == "journal":
            stream.all_outcomes = record.get("all_outcomes") is True
        elif event == "counts":
            stream.counted = True
            stream.marks.clear()  # (a count record covers every line before it: see the journal exporter)
            stream.folded.clear()
            counts = _check_counts(record, where)
            phase = stream.phases.setdefault((record["target"], record["primary"]), _Phase())
            self._mark_drill(phase, record, counts)
            phase.counts, phase.at = counts, record["timestamp"]
            compared, divergent = _compared(_minus(counts, phase.baseline))
            before = phase.previous
            if compared < before[0] or divergent < before[1]:
                raise SourceError(f"{where}: a count record below the process's earlier one (counts only grow)")
            phase.previous = (compared, divergent)
            at = stream.process_time(record, where)
            if compared - before[0] > 0:
                phase.intervals.append((at, compared - before[0], divergent - before[1]))
            if self.recent > 0:
                self._keep(phase, record["timestamp"], counts)
        elif event == "arm":
            stream.arms.append(record)
        elif event in ("rollback", "reset"):
            stream.events.append(record)
            if event == "reset":
                for (target, _), phase in stream.phases.items():
                    if target == record["target"] and phase.counts is not None:
                        phase.baseline = phase.counts
                        phase.previous = (0.0, 0.0)
                        phase.intervals.clear()
                        phase.history.clear()
                        phase.drill_before = phase.drill_last = None
        else:  # an outcome line not framed as the exporter frames it: counted now, forgotten at a count record
            stream.see(record.get("timestamp"))
            primary = record.get("primary") if record.get("primary") in PRIMARY_SIDES else LEGACY
            stream.folded.setdefault((record["target"], primary), _Tail()).add(record)

    def _mark_drill(self, phase: _Phase, record: dict, counts: dict) -> None:
        """Follow a fire drill by its own marks (the drilled count of count records): the span it drilled in,
        and per target the last time a drill grew and the last time comparisons grew without one."""
        target, timestamp = record["target"], record["timestamp"]
        previous = phase.counts or {}
        drilled = counts["drilled"] - previous.get("drilled", 0)
        compared = _compared(counts)[0] - _compared(previous)[0] if previous else _compared(counts)[0]
        if drilled > 0:
            if phase.drill_last is None:
                phase.drill_before = (phase.at, phase.counts) if phase.counts is not None else None
            phase.drill_last = (timestamp, counts)
            self.drilled_until[target] = max(self.drilled_until.get(target, -math.inf), timestamp)
        elif compared > 0:
            self.clean_until[target] = max(self.clean_until.get(target, -math.inf), timestamp)

    def drill_over(self, target: str) -> bool:
        """Whether a fire drill of ``target`` is over: comparisons without one were counted after its last."""
        return self.clean_until.get(target, -math.inf) > self.drilled_until.get(target, math.inf)

    def slices(self) -> dict[str, dict[str, TargetCounts]]:
        """The slices of the evidence read, by name (:func:`shadow.analysis.verdict.decide`): the recent window
        where the count records span more than it, and each run where several are pooled."""
        found = {}
        if self.recent > 0 and self.latest is not None and self.earliest < self.latest - self.recent:
            found[verdict.recent_slice(self.recent)] = self.counts(recent=True)
        runs = self.runs()
        if self.run is None and len(runs) > 1:
            for each in sorted(runs):
                found[verdict.run_slice(each)] = self.counts(run=each)
        return found

    def _keep(self, phase: _Phase, timestamp: float, counts: dict) -> None:
        """Keep a count record for the recent window; drop those no window ending at the latest record can
        start after (the last of them stays: it is where such a window starts)."""
        self.latest = timestamp if self.latest is None else max(self.latest, timestamp)
        self.earliest = min(self.earliest, timestamp)
        history = phase.history
        history.append((timestamp, counts))
        cutoff = self.latest - self.recent
        while len(history) > 1 and history[1][0] <= cutoff:
            history.popleft()

    def _fold(self, stream: _Stream) -> None:
        """Count the framed outcome lines after the process's last count record: read again from where they
        begin."""
        marks, stream.marks = stream.marks, {}
        for path, start in marks.items():
            self._read_file(path, only=stream, start=start)

    def counts(self, recent: bool = False, run: str | None = None) -> dict[str, TargetCounts]:
        """The counts of every target, by phase, with clusters; refuses (SourceError) what cannot be counted.
        ``recent``: only those of the last :attr:`recent` seconds before the latest count record (each process's
        counts less those of its last count record at or before the window's start; the lines after its last
        count record all count). ``run``: only that run's processes (else the reader's :attr:`run`, or all)."""
        counts: dict[str, TargetCounts] = {}
        seconds = 0.0  # (the processes' time, first record to last: the evidence rate's denominator)
        run = self.run if run is None else run
        since = self.latest - self.recent if recent and self.latest is not None else None
        for stream in self.streams.values():
            self._fold(stream)
            for (target, _), tail in stream.folded.items():
                if sum(tail.drilled.values()):  # (a drill in its last lines: drilling to the end)
                    self.drilled_until[target] = math.inf
        for key, stream in self.streams.items():
            if run is not None and stream.run != run:
                continue
            if not stream.counted and stream.all_outcomes is not True and stream.folded:
                raise SourceError(
                    f"{stream.where}: process {key[0]}/{key[1]} wrote outcome lines but no count record and no header "
                    "saying it wrote every outcome: its matches are not known, so no rate can be computed from it "
                    "(journals of npu-shadow before count records; write them with all_outcomes=True)"
                )
            _add_stream(self, counts, key, stream, since)
            seconds += stream.seconds
        for entry in counts.values():
            entry.process_seconds = seconds
        return counts


def _add_stream(
    reader: JournalReader, counts: dict[str, TargetCounts], key: tuple, stream: _Stream, since: float | None
) -> None:
    """One process's evidence added to ``counts``: its rollbacks and resets, its count records (less what came
    before the recent window's start, a reset, a fire drill that is over), the lines after its last count record,
    and its clusters."""
    _add_events(counts, stream)
    _add_records(reader, counts, stream, since)
    _add_tails(counts, key, stream)
    _add_clusters(reader, counts, key, stream, since)


def _add_events(counts: dict[str, TargetCounts], stream: _Stream) -> None:
    """The process's rollbacks (those after a target's last reset) and resets."""
    last_reset: dict[str, int] = {}
    for index, event in enumerate(stream.events):
        if event["event"] == "reset":
            last_reset[event["target"]] = index
    for index, event in enumerate(stream.events):
        entry = counts.setdefault(event["target"], TargetCounts())
        said = f"{event['by']} at {event.get('time', '?')}"
        if event["event"] == "reset":
            entry.resets.append(said)
        elif index > last_reset.get(event["target"], -1):
            entry.rollbacks.append(said)


def _add_records(reader: JournalReader, counts: dict[str, TargetCounts], stream: _Stream, since: float | None) -> None:
    """The process's count records: each phase's last, less its baseline (a reset's, or the recent window's start)
    and a fire drill's span where the drill is over."""
    for (target, primary), phase in stream.phases.items():
        entry = counts.setdefault(target, TargetCounts())
        if phase.counts is None:
            continue
        baseline, baseline_at = phase.baseline, -math.inf
        before = [(t, c) for t, c in phase.history if t <= since] if since is not None else []
        if before:
            baseline_at, baseline = before[-1]  # (the window's start: what came before is not recent)
        elif phase.baseline is not None:
            entry.set_aside += _compared(phase.baseline)[0]
        evidence = _minus(phase.counts, baseline)
        if phase.drill_last is not None and reader.drill_over(target) and phase.drill_last[0] > baseline_at:
            start = phase.drill_before if phase.drill_before and phase.drill_before[0] > baseline_at else None
            drilled = _minus(phase.drill_last[1], start[1] if start else baseline)
            evidence = _minus(evidence, drilled)
            entry.drill_set_aside += _compared(drilled)[0]
        _add_counts(entry, primary, evidence)


def _add_tails(counts: dict[str, TargetCounts], key: tuple, stream: _Stream) -> None:
    """The lines after the process's last count record (their clusters not known), and their times."""
    complete_tail = stream.all_outcomes is True
    for (target, primary), tail in stream.folded.items():
        entry = counts.setdefault(target, TargetCounts())
        _add_tail(entry, primary, tail, complete_tail)
        entry.clusters_not_counted(primary)  # (lines after its last count record: their clusters not known)
        phase = stream.phases.setdefault((target, primary), _Phase())
        for second, (compared, divergent) in tail.seconds.items() if not stream.tail_timed else ():
            counted = compared if complete_tail else divergent  # (incomplete: only the divergences count)
            if counted:
                phase.intervals.append((stream.on_process_time(float(second)), counted, divergent))
        if not complete_tail and any(o in DIVERGENT_OUTCOMES for (_, o) in tail.outcomes):
            entry.notes.append(
                f"process {key[0]}/{key[1]} left {tail.lines} lines after its last count record (it did not "
                "exit cleanly): their divergences count as comparisons whose matches are not known"
            )
    stream.tail_timed = True  # (its tail's times are in its intervals: once, however often it is counted)


def _add_clusters(
    reader: JournalReader, counts: dict[str, TargetCounts], key: tuple, stream: _Stream, since: float | None
) -> None:
    """The process's clusters: its comparisons in blocks of the reader's window on its own time (those of the
    recent window where ``since`` is given), and the clock jumps said."""
    start = -math.inf if since is None else stream.on_process_time(since)
    for (target, primary), phase in stream.phases.items():
        entry = counts.setdefault(target, TargetCounts())
        entry.clustering = clustering(reader.window)
        recent = [i for i in phase.intervals if i[0] > start]
        for block, (compared, divergent) in enumerate(_blocks(recent, stream.origin, reader.window)):
            entry.add_to_cluster((*key, block), compared, divergent, primary)
        for jump in stream.jumps[:3]:
            if jump not in entry.notes:
                entry.notes.append(jump)


def _add_counts(entry: TargetCounts, primary: str, counts: dict) -> None:
    for signature, by_outcome in counts["outcomes"].items():
        for outcome, value in by_outcome.items():
            entry.add_outcome(signature, outcome, value, primary)
    for signature, by_reason in counts["skipped"].items():
        for reason, value in by_reason.items():
            entry.add_skip(reason, value, primary, signature)
    for reason, value in counts["reasons"].items():
        entry.add_reason(reason, value, primary)
    for reason, value in counts["shared"].items():
        entry.add_shared(reason, value, primary)
    for signature, value in counts["calls"].items():
        entry.add_calls(signature, value, primary)
    entry.drilled += counts["drilled"]
    if "clusters" in counts:
        entry.add_clusters(counts["clusters"], primary)
    elif _compared(counts)[0]:
        entry.clusters_not_counted(primary)  # (a process of a version before clusters were counted)
    for signature, by_side in counts.get("truth", {}).items():
        for side, value in by_side.items():
            entry.add_truth(signature, side, value, primary)
    for signature, by_decade in counts.get("truth_decades", {}).items():
        for decade, value in by_decade.items():
            entry.add_truth_decade(signature, int(decade), value, primary)
    for signature, by_found in counts.get("backward", {}).items():
        for found, value in by_found.items():
            entry.add_backward(signature, found, value, primary)


def _add_tail(entry: TargetCounts, primary: str, tail: _Tail, complete: bool) -> None:
    """A process's lines after its last count record: all of them where it wrote every outcome; else skips and
    divergences only (comparisons whose matches are not known: never counted as agreement)."""
    for (signature, reason), value in tail.skipped.items():
        entry.add_skip(reason, value, primary, signature)
    for (signature, outcome), value in tail.outcomes.items():
        if complete:
            entry.add_outcome(signature, outcome, value, primary)
        elif outcome in DIVERGENT_OUTCOMES:
            phase = entry.phase(primary)
            phase.unmatched[signature] = phase.unmatched.get(signature, 0) + value
    for (reason, divergent), value in tail.reasons.items():
        if complete or divergent:
            entry.add_reason(reason, value, primary)
    for reason, value in tail.shared.items():
        entry.add_shared(reason, value, primary)
    for (signature, side), value in tail.truth.items():  # (truth runs are of value differences: all lines)
        entry.add_truth(signature, side, value, primary)
    for (signature, decade), value in tail.truth_decades.items():
        entry.add_truth_decade(signature, int(decade), value, primary)
    for (signature, found), value in tail.backward.items():
        if complete:  # (a gradient match not written as a line is not known: never counted as agreement)
            entry.add_backward(signature, found, value, primary)
        elif found == "mismatch":
            phase = entry.phase(primary)
            phase.backward_unmatched[signature] = phase.backward_unmatched.get(signature, 0) + value
    entry.drilled += sum(v for divergent, v in tail.drilled.items() if complete or divergent)


def _blocks(intervals: list, start: float | None, window: float) -> list[tuple[float, float]]:
    """(compared, divergent) per block: ``window`` seconds counted from the process's start; a block that ends
    in divergence runs on while divergence does (an incident is never cut)."""
    blocks: list[list[float]] = []
    origin = start or 0.0
    current = None
    diverging = False
    for timestamp, compared, divergent in sorted(intervals, key=lambda i: i[0]):
        cell = int((timestamp - origin) // window) if window > 0 else 0
        if current is None or (cell != current and not (diverging and divergent > 0)):
            blocks.append([0.0, 0.0])
            current = cell
        blocks[-1][0] += compared
        blocks[-1][1] += divergent
        diverging = divergent > 0
    return [(c, d) for c, d in blocks]


def from_journal(
    paths: Iterable[str],
    torn: list[str] | None = None,
    window: float = CLUSTER_WINDOW_SECONDS,
    run: str | None = None,
    all_runs: bool = False,
    arms: list[dict] | None = None,
    recent: float = 0.0,
    slices: dict[str, dict[str, TargetCounts]] | None = None,
) -> dict[str, TargetCounts]:
    """Counts from JSONL journals and their rotated siblings (see :class:`JournalReader`), of ``run`` or of the one
    run they hold (:func:`select_run`); a torn final line is skipped (its place appended to ``torn`` when
    given). ``arms``, when given, receives the run's canary A/B iterator records. ``slices``, when given,
    receives the counts of the last ``recent`` seconds (where the evidence spans more) and, where several runs are
    pooled, of each run (:func:`shadow.analysis.verdict.decide`)."""
    reader = JournalReader(window, recent=recent if slices is not None else 0.0)
    read, added = with_rotated(paths)
    reader.read(read)
    reader.run = select_run(reader.runs(), run, all_runs, "the journals")
    if torn is not None:
        torn.extend(reader.torn)
    if arms is not None:
        arms.extend(reader.arm_runs())
    counts = reader.counts()
    if slices is not None:
        slices.update(reader.slices())
    if added:
        for entry in counts.values():
            entry.notes.append(f"read with the rotated files beside them: {', '.join(added)}")
    return counts


def _check_arm(record: dict, where: str) -> dict:
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


def _whole_record(raw: bytes, where: str, torn: list[str] | None) -> dict | None:
    """The record on one line, checked; None for a blank line. A torn line (a writer killed mid-line, a full disk)
    is skipped, its place appended to ``torn``: the final line without its newline, or a line in the middle that
    begins as a record does (``{``), and the record a restarted writer appended after the tear is read (the earliest
    ``{"`` after which the rest of the line is a whole record). A line that never began as a record is refused."""
    try:
        return _journal_record(raw, where)
    except SourceError:
        if len(raw) > MAX_LINE_BYTES or not (raw.startswith(b"{") or not raw.endswith(b"\n")) or _is_json(raw):
            raise  # (a whole JSON line that is no record is not a tear: it was written so)
        record = None
        start = raw.find(b'{"', 1)
        while start > 0 and record is None:
            try:
                record = _journal_record(raw[start:], where)
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
    if "event" in record:
        event = record["event"]
        if event in ("journal", "counts"):  # (a process's header; its counts, checked where they are read)
            return record
        if event == "arm":
            return _check_arm(record, where)
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
    return record
