"""Counts from a saved Prometheus text exposition (a scrape, a textfile-collector file)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from shadow.analysis import verdict
from shadow.analysis.evidence import TargetCounts
from shadow.analysis.sources.common import (
    _COUNTED,
    _RUN_LABEL,
    ARM_SERIES,
    BUILD_INFO,
    CALL_BLOCKS,
    CLUSTERS,
    DRILL_ACTIVE,
    DRILLED,
    DRILLED_REASONS,
    PATCH_CALLS,
    PROCESS_TIME,
    PROCESSES,
    RUN_STARTED,
    STARTED,
    SourceError,
    _count,
    _honour_resets,
    _set_aside_drilled,
    add_series,
    mark_drilling,
    one_job_per_run,
    select_run,
)
from shadow.core.model.observation import (
    label_text,
)

#: How much later than its run the processes of a metrics file may begin and still be its first (a launcher's own
#: set-up, a pod scheduled after the time its spec names): later, the run had processes the file never saw.
START_SLACK_SECONDS = 300.0


def from_exposition(
    text: str,
    source: str = "exposition",
    run: str | None = None,
    all_runs: bool = False,
    arms: list[tuple[str, dict[str, str], float]] | None = None,
    slices: dict[str, dict[str, TargetCounts]] | None = None,
    patches: dict[str, float] | None = None,
) -> dict[str, TargetCounts]:
    """Counts from a Prometheus text exposition (a saved scrape, a textfile-collector file): of ``run``, or of the
    one run it holds (see :func:`select_run`). ``arms``, when given, receives the canary A/B's samples (series,
    labels, value); ``slices``, each run's counts where several are pooled (one moment holds no recent window);
    ``patches``, the calls of each function patch of the release (``npu_shadow_patch_calls_total``)."""
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
    moment = _Moment()
    drilled: list[tuple[str, dict[str, str], float]] = []
    for family in families:
        for sample in family.samples:
            if (chosen is not None and sample.labels.get(_RUN_LABEL, "") != chosen) or moment.read(sample, source):
                continue
            if sample.name == PATCH_CALLS and patches is not None:
                patch = sample.labels.get("patch", "")
                patches[patch] = patches.get(patch, 0.0) + _count(sample.value, f"{source}: {sample.name}")
            elif sample.name in _COUNTED:
                where = f"{source}: {sample.name}{dict(sample.labels)}"
                whole = sample.name not in (CLUSTERS, CALL_BLOCKS)
                add_series(counts, sample.name, sample.labels, _count(sample.value, where, whole=whole))
            elif sample.name == DRILL_ACTIVE and sample.value > 0:
                drill = True
            elif sample.name in (DRILLED, DRILLED_REASONS):
                where = f"{source}: {sample.name}{dict(sample.labels)}"
                drilled.append((sample.name, dict(sample.labels), _count(sample.value, where)))
            elif sample.name in ARM_SERIES and arms is not None:
                where = f"{source}: {sample.name}{dict(sample.labels)}"
                arms.append((sample.name, dict(sample.labels), _count(sample.value, where, whole=False)))
    if drill:
        mark_drilling(counts, [(labels, value) for name, labels, value in drilled if name == DRILLED])
    else:  # (a drill that is over: exactly the comparisons it marked are set aside)
        for name, labels, value in drilled:
            _set_aside_drilled(counts, name, labels, value)
    one_job_per_run(moment.commands, source)
    for entry in counts.values():
        moment.describe(entry)
    return _honour_resets(counts)


@dataclasses.dataclass
class _Moment:
    """What one moment of a run's metrics says of the processes behind it, beside their counts: their time, their
    jobs' commands, the launcher's restarts, and when they and their run began."""

    seconds: float = 0.0
    processes: float = 0.0
    commands: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    restarted: int = 0
    began: dict[str, float] = dataclasses.field(default_factory=dict)  # (the earliest of each series)

    def read(self, sample: Any, source: str) -> bool:
        """Take ``sample`` where it is one of these; whether it was."""
        if sample.name == PROCESS_TIME:
            self.seconds += _count(sample.value, f"{source}: {sample.name}", whole=False)
        elif sample.name == PROCESSES:
            self.processes += _count(sample.value, f"{source}: {sample.name}")
        elif sample.name == BUILD_INFO and sample.value > 0:
            if sample.labels.get("command"):
                run = sample.labels.get(_RUN_LABEL, "")
                self.commands.setdefault(run, set()).add(label_text(sample.labels["command"], 64))
            restart = sample.labels.get("restart", "")
            self.restarted = max(self.restarted, int(restart) if restart.isascii() and restart.isdigit() else 0)
        elif sample.name in (STARTED, RUN_STARTED) and math.isfinite(sample.value) and sample.value > 0:
            self.began[sample.name] = min(self.began.get(sample.name, math.inf), sample.value)
        else:
            return sample.name == BUILD_INFO
        return True

    def describe(self, entry: TargetCounts) -> None:
        """Say on a target's counts what this moment holds of its run."""
        unseen = self.began.get(STARTED, 0.0) - self.began.get(RUN_STARTED, math.inf)
        entry.process_seconds = self.seconds
        entry.processes = round(self.processes)
        entry.restarted = self.restarted
        entry.unseen_before = unseen if unseen > START_SLACK_SECONDS else 0.0


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
