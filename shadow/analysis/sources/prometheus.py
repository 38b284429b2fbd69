"""Counts from a Prometheus server: its exact counts over the run, and the run's slices (its last hour, its
drills), each query bounded in time."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from shadow.analysis import verdict
from shadow.analysis.evidence import TargetCounts
from shadow.analysis.sources import promql
from shadow.analysis.sources.common import (
    _RUN_LABEL,
    ARM_SERIES,
    BUILD_INFO,
    CALL_BLOCKS,
    CALLS,
    CLUSTERS,
    COMPARISONS,
    DRILL_ACTIVE,
    DRILLED,
    DRILLED_REASONS,
    LOOKBACK,
    MAX_FILE_BYTES,
    PATCH_CALLS,
    PROCESS_TIME,
    PROCESSES,
    RESETS,
    ROLLBACKS,
    SourceError,
    _count,
    _honour_resets,
    _set_aside_drilled,
    add_series,
    mark_drilling,
    one_job_per_run,
    select_run,
)
from shadow.core.model import contract
from shadow.core.model.observation import label_text


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


def _of_run(selector: str, run: str | None) -> str:
    """``selector`` narrowed to ``run``'s series (unchanged where ``run`` is None)."""
    return selector if run is None else ",".join(filter(None, [selector, f"{_RUN_LABEL}={json.dumps(run)}"]))


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))


#: The series read, each summed by the labels its counts are kept by: the verdict's, with their target and primary
#: (:data:`shadow.core.model.contract.EVIDENCE`), then the rollbacks and a person's resets.
_QUERIES = [(metric.series, ", ".join(("target", *keys, "primary"))) for metric, keys in contract.EVIDENCE.items()] + [
    (ROLLBACKS, "target, source"),
    (RESETS, "target"),
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
    finish = None
    if recent > 0:  # (the run's own last part: up to its last sample, never up to the reader's now)
        within = _of_run(selector, chosen)
        finish = _last_sample(url, within, end, deadline)
    for seconds in verdict.recent_windows(recent) if finish is not None else ():
        if start is None or start < finish - seconds:
            found[verdict.recent_slice(seconds)] = from_prometheus(
                url, None, selector, deadline.left(), chosen, True, finish - seconds, finish
            )
    if chosen is None and len(runs) > 1:
        for each in sorted(runs):
            found[verdict.run_slice(each)] = from_prometheus(
                url, None, selector, deadline.left(), each, False, start, end
            )
    return found


#: The first looks for a run's last sample (:func:`_last_sample`), nearest first: (how far back, at what step). A
#: run scraped in the last hour is found by the first, whose cost does not grow with the store's history.
_END_LOOKS = (("1h", 60), ("1d", 300), (LOOKBACK, 300))


def _last_sample(url: str, selector: str, end: float | None, deadline: _Deadline) -> float | None:
    """When the run (the series ``selector`` names) was last scraped, at or before ``end`` (now where None): the end
    of its own last hour, which a run that ended hours before the read must not take from the reader's clock. None
    where it has no sample in :data:`LOOKBACK`. A subquery finds the last sample's time within a step, looking back
    an hour first, then a day, then the lookback (each step sees the samples of the lookback before it; one that went
    stale at the run's end is seen by an earlier step, so the sample found is less than two steps before the last),
    then the raw samples from there give it exactly."""
    for back, step in _END_LOOKS:
        coarse = deadline.query(f"max(max_over_time(timestamp({CALLS}{{{selector}}})[{back}:{step}s]))", end)
        if coarse:
            break
    else:
        return None
    found = _number(coarse[0]["value"][1], f"{url}: the last sample's time")
    span = 2 * step + 60
    at = found + span if end is None else min(found + span, end)
    raw = deadline.query(f"{CALLS}{{{selector}}}[{span}s]", at, matrix=True)
    moments = [_number(moment, f"{url}: a sample's time") for series in raw for moment, _ in series["values"]]
    return max([found, *moments])


def _exact_between(
    url: str,
    metric: str,
    selector: str,
    start: float | None,
    end: float | None,
    deadline: _Deadline,
    whole: bool | None = None,
) -> dict[tuple, float]:
    """Each series' exact count from ``start`` to ``end`` (:func:`_exact`; ``whole``: counts, not seconds or a
    rank's share of a cluster)."""
    if whole is None:
        whole = metric not in (CLUSTERS, CALL_BLOCKS, PROCESS_TIME)
    series = _exact(url, metric, selector, end, deadline, whole)
    if start is not None:
        before = _exact(url, metric, selector, start, deadline, whole)
        series = {key: value - before.get(key, 0.0) for key, value in series.items()}
    return series


def _counted(
    url: str, selector: str, window: str | None, start: float | None, end: float | None, deadline: _Deadline
) -> dict[str, TargetCounts]:
    """Each target's counts (:data:`_QUERIES`) from ``start`` to ``end``, or their ``increase()`` over ``window``; a
    rollback and its resets whole, whatever the range (a rollback no person reset holds over any window a reader
    picks)."""
    counts: dict[str, TargetCounts] = {}
    for metric, by in _QUERIES:
        if metric in (ROLLBACKS, RESETS):
            series = _exact(url, metric, selector, end, deadline)
        elif window:
            series = _increases(url, metric, by, selector, window, deadline)
        else:
            series = _exact_between(url, metric, selector, start, end, deadline)
        for key, value in series.items():
            labels = dict(key)
            # increase() extrapolates to the window's edges: fractional there, never negative
            shares = metric in (CLUSTERS, CALL_BLOCKS)  # (a rank's share of a block each: fractions)
            value = _count(value, f"{url}: {metric}{labels}", whole=window is None and not shares)
            add_series(counts, metric, labels, value if shares else float(round(value)))
    return counts


def _patch_calls(
    url: str, selector: str, start: float | None, end: float | None, deadline: _Deadline
) -> dict[str, float]:
    """The calls of each function patch of the release from ``start`` to ``end`` (``npu_shadow_patch_calls_total``,
    every process of the run together)."""
    found: dict[str, float] = {}
    for key, value in _exact_between(url, PATCH_CALLS, selector, start, end, deadline).items():
        patch = dict(key).get("patch", "")
        found[patch] = found.get(patch, 0.0) + _count(value, f"{url}: {PATCH_CALLS}{dict(key)}")
    return found


def patch_calls_from_prometheus(url: str, selector: str = "", timeout: float = 30) -> dict[str, float]:
    """The calls of each function patch of the release, every run the server holds together (the patch board's
    calls where no comparison is there to decide on); raises SourceError."""
    return _patch_calls(url, selector, None, None, _Deadline(url, timeout))


def _drilling(url: str, selector: str, end: float | None, deadline: _Deadline) -> bool:
    """Whether a fire drill is still on at ``end`` in some process of the run: its drill gauge's last sample."""
    found = deadline.query(f"last_over_time({DRILL_ACTIVE}{{{selector}}}[{LOOKBACK}]) > 0", end)
    return bool(found)


def _drills(
    url: str,
    selector: str,
    start: float | None,
    end: float | None,
    deadline: _Deadline,
    counts: dict[str, TargetCounts],
    drilling: bool,
) -> None:
    """A fire drill still on is rehearsed (its comparisons count, each target's drilled ones named:
    :func:`mark_drilling`); one that is over has exactly the comparisons it marked set aside
    (:func:`_set_aside_drilled`)."""
    if drilling:
        found = _exact_between(url, DRILLED, selector, start, end, deadline).items()
        mark_drilling(counts, [(dict(key), _count(value, f"{url}: {DRILLED}{dict(key)}")) for key, value in found])
        return
    for metric in (DRILLED, DRILLED_REASONS):
        for key, value in _exact_between(url, metric, selector, start, end, deadline).items():
            labels = dict(key)
            _set_aside_drilled(counts, metric, labels, _count(value, f"{url}: {metric}{labels}"))
    for entry in counts.values():
        entry.drilled = 0


def _commands(selector: str, end: float | None, deadline: _Deadline) -> dict[str, set[str]]:
    """The command ids the run's processes reported (``npu_shadow_build_info``), by run."""
    promql = f"count by ({_RUN_LABEL}, command) (last_over_time({BUILD_INFO}{{{selector}}}[{LOOKBACK}]))"
    found: dict[str, set[str]] = {}
    for item in deadline.query(promql, end):
        command = str(item["metric"].get("command", ""))
        if command:
            found.setdefault(str(item["metric"].get(_RUN_LABEL, "")), set()).add(command[:64])
    return found


def _increases(url: str, metric: str, by: str, selector: str, window: str, deadline: _Deadline) -> dict[tuple, float]:
    """Each series' ``increase()`` over the ``window`` before now (a series new in it counted from zero:
    :func:`shadow.analysis.sources.promql.increase`), summed by the labels ``by``."""
    query = f"sum by ({by}) ({promql.increase(f'{metric}{{{selector}}}', window)})"
    return {
        tuple(sorted(_labels(item).items())): _number(item["value"][1], f"{url}: {metric}{_labels(item)}")
        for item in deadline.query(query)
    }


def _environment(selector: str, end: float | None, deadline: _Deadline) -> dict[str, set[str]]:
    """What the run's processes ran, from their ``npu_shadow_build_info`` series: run, torch, torch_npu and
    npu-shadow versions."""
    fields = {"run": "run", "torch": "torch", "torch_npu": "torch_npu", "version": "npu-shadow"}
    promql = f"count by ({', '.join(fields)}) (last_over_time({BUILD_INFO}{{{selector}}}[{LOOKBACK}]) > 0)"
    found: dict[str, set[str]] = {}
    for item in deadline.query(promql, end):
        for label, field in fields.items():
            value = str(item["metric"].get(label, ""))
            if value:
                found.setdefault(field, set()).add(label_text(value, 64))
    return found


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
    environment: dict[str, set[str]] | None = None,
    patches: dict[str, float] | None = None,
) -> dict[str, TargetCounts]:
    """Counts from a Prometheus server, of ``run`` or of the one run it holds (:func:`select_run`; the runs seen in
    the last :data:`LOOKBACK`): each counter's exact value at ``end`` (default now; its last sample at or before,
    resets counted, so a run that has ended is read as it ended), less its value at ``start`` where given.
    ``window`` (e.g. '6h') instead takes ``increase()`` over the window before now, an extrapolation kept for
    dashboards' sake. ``selector`` narrows the series, e.g. 'job="train"'. All queries together take at most
    ``timeout`` seconds. ``arms``, when given, receives the canary A/B's series (series, labels, value).
    ``slices``, when given, receives the counts of the last ``recent`` seconds before ``end`` (where the range
    read is longer) and, where several runs are pooled, of each run (:func:`shadow.analysis.verdict.decide`).
    ``environment``, when given, receives what the run's processes ran (their ``npu_shadow_build_info``);
    ``patches``, the calls of each function patch of the release (``npu_shadow_patch_calls_total``)."""
    deadline = _Deadline(url, timeout)
    # (a run asked for is looked up alone: one run's read costs the same however many runs the store holds)
    asked = _of_run(selector, run)
    runs = _runs(url, asked, end, deadline, window or LOOKBACK)
    if run is not None and run not in runs:  # (the refusal names the runs it does hold)
        runs = _runs(url, selector, end, deadline, window or LOOKBACK)
    chosen = select_run(runs, run, all_runs, f"{url}{f' ({selector})' if selector else ''}")
    if slices is not None and not window:
        slices.update(_prometheus_slices(url, selector, deadline, runs, chosen, start, end, recent))
    if chosen is not None:
        selector = _of_run(selector, chosen)
    if not window:
        one_job_per_run(_commands(selector, end, deadline), url)
    if environment is not None:
        environment.update(_environment(selector, end, deadline))
    drilling = False if window else _drilling(url, selector, end, deadline)
    counts = _counted(url, selector, window, start, end, deadline)
    if not counts:
        raise SourceError(f"{url} has no {COMPARISONS} series{f' matching {selector}' if selector else ''}")
    for metric in ARM_SERIES if arms is not None and not window else ():
        series = _exact_between(url, metric, selector, start, end, deadline, whole=False)
        arms.extend((metric, dict(key), value) for key, value in series.items())  # type: ignore[union-attr]
    if patches is not None and not window:
        patches.update(_patch_calls(url, selector, start, end, deadline))
    if not window:
        _drills(url, selector, start, end, deadline, counts, drilling)
        each = _exact_between(url, PROCESS_TIME, selector, start, end, deadline)
        processes = _exact(url, PROCESSES, selector, end, deadline)  # (every process of the run, whatever the range)
        for entry in counts.values():
            entry.process_seconds = max(sum(each.values()), 0.0)
            entry.processes = round(sum(processes.values()))
    return _honour_resets(counts)
