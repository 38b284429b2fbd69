"""What every source of the verdict's counts shares: the series it counts, the limits it reads within, the one
error it raises (:class:`SourceError`), and a run's selection."""

from __future__ import annotations

import math
from collections.abc import Iterable

from shadow.analysis.evidence import TargetCounts
from shadow.core.model import contract
from shadow.core.model.observation import COMPARED_OUTCOMES, LEGACY, bounded

COMPARISONS = contract.COMPARISONS.series
MISMATCHES = contract.MISMATCHES.series
SHARED = contract.SHARED_DIVERGENCES.series
SKIPPED = contract.SKIPPED.series
CALLS = contract.CALLS.series
CLUSTERS = contract.CLUSTERS.series
CALL_BLOCKS = contract.CALL_BLOCKS.series
PROCESS_TIME = contract.PROCESS_TIME.series
PROCESSES = contract.PROCESSES.series
TRUTH_RUNS = contract.TRUTH_RUNS.series
BACKWARD_RUNS = contract.BACKWARD_RUNS.series
NOISE_CHECKS = contract.NOISE_CHECKS.series
PATCH_CALLS = contract.PATCH_CALLS.series
ROLLBACKS = contract.ROLLBACKS.series
RESETS = contract.RESETS.series
DRILL_ACTIVE = contract.DRILL_ACTIVE.prometheus_name
STARTED = contract.STARTED.prometheus_name
RUN_STARTED = contract.RUN_STARTED.prometheus_name
DRILLED = contract.DRILLED.series
DRILLED_REASONS = contract.DRILLED_REASONS.series
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


def one_job_per_run(commands: dict[str, set[str]], source: str) -> None:
    """Refuse (SourceError) a run whose evidence comes from more than one job: ``commands`` maps each run to the
    command ids its processes reported (:func:`shadow.core.model.run_ids.command_id`). Two jobs given one run id
    by mistake are never pooled as one: a job diverging at 5% beside a clean one would be promoted with it."""
    for run, found in sorted(commands.items()):
        if len(found) > 1:
            raise SourceError(
                f"{source}: run {run or '(unnamed)'} holds evidence of {len(found)} jobs (command ids "
                f"{', '.join(sorted(found)[:4])}: their command lines differ); one run id names one job: give each job "
                "its own (--run-id, NPU_SHADOW_RUN_ID) and decide each with --run"
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


#: The verdict's series by the name a source holds them under.
EVIDENCE = {metric.series: metric for metric in contract.EVIDENCE}


def add_series(counts: dict[str, TargetCounts], name: str, labels: dict[str, str], value: float) -> None:
    """One series as a source holds it (``name``, its ``labels``, its ``value``), into its target's counts: the
    verdict's series (:data:`EVIDENCE`) into the phase its ``primary`` label names (legacy's where it has none: a
    series from before the label), unless a closed label holds a value outside its set; the rollbacks and a
    person's resets into the target's."""
    if name in (ROLLBACKS, RESETS) and value <= 0:
        return
    target = counts.setdefault(labels.get("target", ""), TargetCounts())
    if name == ROLLBACKS:
        target.rollbacks.append(f"{round(value)} by {labels.get('source', '?')} ({ROLLBACKS})")
        target.counted_rollbacks += value
    elif name == RESETS:
        target.counted_resets += value
    elif (metric := EVIDENCE.get(name)) is not None and all(
        labels.get(label) in values for label, values in metric.closed.items()
    ):
        target.add(metric, labels, value, labels.get("primary") or LEGACY)


def _set_aside_drilled(counts: dict[str, TargetCounts], name: str, labels: dict[str, str], value: float) -> None:
    """Comparisons a fire drill that is over marked (``DRILLED``), or their reasons (``DRILLED_REASONS``), taken out
    of the evidence they were counted in: exactly those, never whatever else was counted beside them (a real
    incident during a drill stays evidence). Raises SourceError where a series marks more than was counted."""
    if value <= 0:
        return
    target = counts.setdefault(labels.get("target", ""), TargetCounts())
    phase = target.phase(labels.get("primary") or LEGACY)
    if name == DRILLED:
        signature, outcome = labels.get("signature", ""), labels.get("outcome", "")
        counted = phase.outcomes.get((signature, outcome), 0)
        if value > counted:
            raise SourceError(f"{name}{labels}: {value:g} drilled comparisons, more than the {counted:g} counted")
        phase.outcomes[(signature, outcome)] = counted - value
        target.drill_set_aside += value if outcome in COMPARED_OUTCOMES else 0
    else:
        reason = labels.get("reason", "")
        counted = phase.reasons.get(reason, 0)
        if value > counted:
            raise SourceError(f"{name}{labels}: {value:g} drilled reasons, more than the {counted:g} counted")
        phase.reasons[reason] = counted - value


def mark_drilling(counts: dict[str, TargetCounts], drilled: list[tuple[dict[str, str], float]]) -> None:
    """A fire drill still on: each target's comparisons it injected into (``DRILLED`` series' labels and values),
    so that the drill names only the targets it drilled; -1 for every target (a drill was on, how many it drilled
    is not known) where the source has no such series."""
    if not drilled:
        for entry in counts.values():
            entry.drilled = -1
        return
    for entry in counts.values():
        entry.drilled = 0
    for labels, value in drilled:
        if labels.get("outcome") in COMPARED_OUTCOMES:
            counts.setdefault(labels.get("target", ""), TargetCounts()).drilled += value


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


#: The series a source counts: the verdict's, and the rollbacks and resets.
_COUNTED = (*EVIDENCE, ROLLBACKS, RESETS)


def _honour_resets(counts: dict[str, TargetCounts]) -> dict[str, TargetCounts]:
    """A target whose metrics count as many resets as rollbacks was reset by a person after each: no rollback
    stands (each reset follows a rollback)."""
    for entry in counts.values():
        if entry.counted_rollbacks and entry.counted_resets >= entry.counted_rollbacks:
            entry.rollbacks = [r for r in entry.rollbacks if not r.endswith(f"({ROLLBACKS})")]
            entry.resets.append(f"{round(entry.counted_resets)} by a person ({RESETS})")
    return counts
