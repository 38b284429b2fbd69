"""What one target counted, and the exporters told of it: its :class:`Record` (the :class:`Tally`, its held value
differences, its log), and the monitor's :class:`Publisher` (the one way the core calls its exporters)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Protocol

from shadow.core.calls.gate.sampling import Sampling
from shadow.core.calls.record import clusters as clustering
from shadow.core.calls.record.exporting import call_hook
from shadow.core.calls.record.held import HeldDifferences
from shadow.core.judging.noise import CHECKS, NOISE_CHECKS, NoiseFloor, evidence_of
from shadow.core.model import contract
from shadow.core.model.observation import (
    DIVERGENT_OUTCOMES,
    LEGACY,
    OUTCOMES,
    Observation,
    Outcome,
    TargetStats,
    within_noise_floor,
)
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.sides import marks
from shadow.core.support import forks

log = logging.getLogger("shadow")

#: The least time between two log lines of one kind of one target's (or of one exporter's failures in one hook).
LOG_INTERVAL_SECONDS = 60.0


#: Records waiting for the exporters at most (a record is an observation's few fields, or a report's counts): past
#: it, the caller delivers them itself.
MAX_WAITING = 4096


class _Waiting(NamedTuple):
    """A record (None: samples alone) and its samples (or what makes them), waiting for the exporters."""

    target: str
    record: Any
    samples: Sequence[contract.Sample] | Callable[[], Sequence[contract.Sample]]
    failed: Callable[[int], None] | None


class Publisher:
    """A monitor's exporters, and what waits for them: the records and samples the core made, queued on the
    caller's thread (no exporter runs there) and handed over by :meth:`deliver` (the reporter's thread each second,
    a flush, a switch of the primary). Every hook is called through
    :func:`shadow.core.calls.record.exporting.call_hook` (a failure is returned, never raised), under the
    ``publishing`` mark (a patched function an exporter calls is not a call of the job's), each failure logged at
    most once a minute per exporter and hook.

    Where an exporter keeps a divergence's evidence (``captures``: the journal's repro captures) every record is
    delivered at once, on the caller's thread: the evidence is the call's tensors, never held for a second. Past
    :data:`MAX_WAITING` waiting records, the caller delivers them itself (exporters slower than the job hold it,
    rather than lose its counts or grow without bound).

    Args:
        exporters: objects with ``export`` or ``record`` (checked by ``install``) and any of the optional hooks.
    """

    def __init__(self, exporters: Sequence[Any] = ()) -> None:
        self.exporters = tuple(exporters)
        self._last_logged: dict[tuple[str, int], float] = {}
        #: Whether an exporter keeps a divergence's evidence (its ``captures``: the journal's repro captures).
        self.wants_evidence = any(getattr(exporter, "captures", False) for exporter in self.exporters)
        self._after_fork_in_child()
        forks.register(self)

    def _after_fork_in_child(self) -> None:  # (what the parent queued is the parent's to deliver)
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._delivering = threading.Lock()

    def record(self, samples: Sequence[contract.Sample] | Callable[[], Sequence[contract.Sample]]) -> None:
        """Queue ``samples`` (or what makes them, called at delivery) for every exporter's ``record``."""
        self._queue(_Waiting("", None, samples, None))

    def export(
        self,
        target: str,
        record: Any,
        samples: Sequence[contract.Sample] | Callable[[], Sequence[contract.Sample]],
        failed: Callable[[int], None] | None = None,
    ) -> None:
        """Queue ``record`` and its ``samples`` for every exporter: the samples first (so a journal's count record
        covers every line before it). An exporter that fails at either is one export error of ``target``'s,
        recorded by every exporter and told to ``failed`` (how many failed)."""
        self._queue(_Waiting(target, record, samples, failed))

    def export_observation(self, target: str, observation: Observation, failed: Callable[[int], None]) -> None:
        """:meth:`export` of an observation with its samples (made at delivery; nothing where there is no
        exporter)."""
        if self.exporters:
            self.export(target, observation, functools.partial(contract.observation_samples, observation), failed)

    def _queue(self, waiting: _Waiting) -> None:
        if not self.exporters:
            return
        self._waiting.append(waiting)
        if self.wants_evidence or len(self._waiting) > MAX_WAITING:
            self.deliver()

    def deliver(self) -> None:
        """Hand every waiting record and sample to the exporters, in the order they were queued (one delivery at a
        time: the reporter's and a flush's never interleave)."""
        with self._delivering:
            if not self._waiting:
                return
            publishing = getattr(marks, "publishing", False)
            try:
                marks.publishing = True
                while self._waiting:
                    self._deliver(self._waiting.popleft())
            finally:
                marks.publishing = publishing

    def _deliver(self, waiting: _Waiting) -> None:
        unmade = False
        try:
            samples = waiting.samples() if callable(waiting.samples) else waiting.samples
        except Exception as exc:  # (ours, on whichever thread delivers: counted as every exporter's failure)
            samples, unmade = (), True
            self._log(self, "record", exc)
        failed = 0
        for exporter in self.exporters:
            failures = self._call(exporter, "record", samples) if samples else 0
            if waiting.record is not None:
                failures += self._call(exporter, "export", waiting.record)
            failed += bool(failures) or unmade
        if failed and waiting.record is not None:
            errors = contract.export_error_samples(waiting.target, failed)
            for exporter in self.exporters:
                self._call(exporter, "record", errors)
            if waiting.failed is not None:
                waiting.failed(failed)

    def each(self, hook: str, *args: Any) -> int:
        """Call ``hook`` on every exporter that has it, now (``flush``, ``close``: after :meth:`deliver`). Returns
        how many failed."""
        publishing = getattr(marks, "publishing", False)
        try:
            marks.publishing = True
            return sum(self._call(exporter, hook, *args) for exporter in self.exporters)
        finally:
            marks.publishing = publishing

    def _call(self, exporter: Any, hook: str, *args: Any) -> int:
        """``exporter.<hook>(*args)``: 1 where it failed (logged), else 0."""
        failure = call_hook(exporter, hook, *args)
        if failure is None:
            return 0
        self._log(exporter, hook, failure)
        return 1

    def _log(self, exporter: Any, hook: str, failure: BaseException) -> None:
        now, key = time.monotonic(), (hook, id(exporter))
        last = self._last_logged.get(key)
        if last is None or now - last >= LOG_INTERVAL_SECONDS:
            self._last_logged[key] = now
            log.warning("npu-shadow: exporter %r failed in %s: %r", exporter, hook, failure)


def _counter() -> collections.Counter[str]:
    return collections.Counter()


@dataclasses.dataclass
class Tally:
    """One target's counts (read and written under its experiment's lock).

    Attributes:
        outcomes: observations published, by outcome (skips included).
        reasons: their reasons (a comparison may have several; skips' reasons too).
        shared: divergences legacy and upstream share (the single-device oracle's finding), by reason.
        oracle_runs, backward_runs, backward_skips, truth_runs: the extra runs made (and the backward comparisons
            that could not be made, by reason; the truth runs by which side was nearer).
        noise_checks: runs judged against their noise thresholds, by ``evidence/pair/check``.
        clusters: the process's clusters of comparisons (:mod:`shadow.core.calls.record.clusters`).
        drilled: comparisons a fire drill corrupted.
        signatures_over_cap: calls whose signature counted as "other" (past the cap).
        export_errors: exporters that failed to export an observation.
        settings_failures: torch's global settings that could not be taken or put back.
        shadow_peak_bytes: the most a sampled call's shadow side raised the accelerator's peak allocation.
        skips_unreported: sampled calls skipped in bulk (budget, deadline) since the last report.
        call_blocks_unreported: the blocks of calls begun since the last report, by phase (a rank's share each).
        calls_reported: the calls reported to the exporters so far, by signature (under "" where not guided).
    """

    cluster_share: float | None = 1.0  # (None: the share is asked of torch.distributed as clusters open)
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    reasons: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    shared: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    oracle_runs: int = 0
    backward_runs: int = 0
    backward_skips: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    truth_runs: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    noise_checks: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    clusters: clustering.Clusters = dataclasses.field(init=False)
    drilled: int = 0
    signatures_over_cap: int = 0
    export_errors: int = 0
    settings_failures: int = 0
    shadow_peak_bytes: int = 0
    skips_unreported: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    call_blocks_unreported: collections.Counter[str] = dataclasses.field(default_factory=_counter)
    calls_reported: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # (the window as it is now, not as it was at import: a test sets it)
        self.clusters = clustering.Clusters(clustering.WINDOW_SECONDS, self.cluster_share)

    def fresh(self) -> Tally:
        """A tally at zero with the same cluster share (a forked child's)."""
        return Tally(self.cluster_share)

    def count(self, observation: Observation) -> Observation:
        """Count a published observation; returned with its cluster share where it opens a cluster."""
        # (a drilled comparison is no evidence: it opens no cluster, so setting it aside leaves the clusters exact)
        if observation.outcome != Outcome.SKIPPED.value and not observation.drill:
            if self.clusters.opens(observation.primary, observation.outcome in DIVERGENT_OUTCOMES):
                observation = dataclasses.replace(observation, cluster_share=self.clusters.opened_share)
            self.call_blocks_unreported[observation.primary] += self.clusters.call_block_opened
        self.drilled += observation.drill
        self.outcomes[observation.outcome] += 1
        self.reasons.update(observation.reasons)
        if observation.shared_divergence:
            self.shared[observation.shared_divergence] += 1
        self.backward_runs += observation.backward
        self.shadow_peak_bytes = max(self.shadow_peak_bytes, observation.shadow_peak_bytes)
        if observation.backward_skip:
            self.backward_skips[observation.backward_skip] += 1
        if observation.nearer:
            self.truth_runs[observation.nearer] += 1
        for check in observation.noise_checks:
            self.noise_checks["/".join(check)] += 1
        return observation

    def skip_in_bulk(self, reason: str) -> None:
        """A sampled call skipped without an observation of its own (reported with the next report)."""
        self.outcomes[Outcome.SKIPPED.value] += 1
        self.reasons[reason] += 1
        self.skips_unreported[reason] += 1

    def take_call_blocks(self, primary: str, calls_since: bool) -> collections.Counter[str]:
        """The blocks of calls begun since the last report, by phase, and none from now; ``calls_since``: calls of
        ``primary`` were made since (their block marked now, unless a comparison marked it)."""
        if calls_since:
            self.call_blocks_unreported[primary] += self.clusters.called(primary)
        blocks, self.call_blocks_unreported = self.call_blocks_unreported, collections.Counter()
        return blocks

    def take_unreported_skips(self) -> collections.Counter[str]:
        """The skips in bulk since the last report, and none from now."""
        skipped, self.skips_unreported = self.skips_unreported, collections.Counter()
        return skipped


#: Observations a target keeps deferred at most (each holds a comparison's few statistics): past it, the oldest is
#: read, waiting for the device.
MAX_DEFERRED = 64


class Deferred(Protocol):
    """An observation the device has not finished comparing
    (:class:`~shadow.core.calls.sampled.shadow_side.DeferredObservation`)."""

    def ready(self) -> bool:
        """Whether the device finished the comparison (never waits)."""

    def observation(self) -> Observation:
        """The observation, once read (waiting for the device where it has not finished)."""

    def failed(self, failure: BaseException) -> Observation:
        """The observation of a comparison whose reading failed."""


class Record:
    """One target's record.

    Args:
        target: the target's name.
        publisher: the monitor's exporters.
        lock: the experiment's lock (the tally is read and written under it).
        counted: the calls to report, taken under the lock (:meth:`Sampling.counted`; ``flush``: the open gate's
            too).
        primary: the side whose result the caller gets now (the experiment sets it at a switch, under the lock):
            the phase the calls and the skips in bulk are counted in.
    """

    def __init__(
        self,
        target: str,
        publisher: Publisher,
        lock: threading.Lock,
        counted: Callable[[bool], dict[str, Any]],
        primary: str = LEGACY,
    ) -> None:
        self.target, self.publisher, self._lock, self._counted = target, publisher, lock, counted
        self.primary = primary
        self.tally = Tally(clustering.cluster_share())
        self.held = HeldDifferences()
        #: Observations whose comparison the device had not finished when their call returned, oldest first.
        self.deferred: collections.deque[tuple[Deferred, NoiseFloor]] = collections.deque()
        #: Signatures whose forward reads its own graph: their shadow runs keep their activations.
        self.keeps_activations: set[str] = set()
        self._last_logged: dict[str, float] = {}

    def log_limited(self, kind: str, message: str, *args: Any) -> None:
        """Log a warning about this target, at most once a minute per ``kind``."""
        now = time.monotonic()
        last = self._last_logged.get(kind)
        if last is None or now - last >= LOG_INTERVAL_SECONDS:
            self._last_logged[kind] = now
            log.warning("npu-shadow [%s]: " + message, self.target, *args)

    def add(self, count: str, value: int = 1) -> None:
        """Add to one of the tally's plain counts (``oracle_runs``, ``settings_failures``, ...)."""
        with self._lock:
            setattr(self.tally, count, getattr(self.tally, count) + value)

    def put_back(self, settings: TorchGlobals, written: Collection[str] = ()) -> bool:
        """Write back a snapshot of torch's global settings (its thread-local ones, and the process-wide ones the
        tool's own runs ``written``: :meth:`TorchGlobals.restore`); whatever cannot be is counted and logged, never
        raised (each setting is written on its own, so the others still are). Whether all of them were."""
        try:
            settings.restore(written)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.settings_failed(exc)
            return False
        return True

    def settings_failed(self, failure: BaseException) -> None:
        """Torch's global settings could not be taken or put back: counted, logged."""
        self.add("settings_failures")
        self.log_limited("settings", "global settings could not be taken or put back: %r", failure)

    def skip_in_bulk(self, reason: str) -> None:
        with self._lock:
            self.tally.skip_in_bulk(reason)

    def publish(self, observation: Observation, noise: NoiseFloor, judged: bool = False) -> None:
        """Count an observation and export it (the calls so far reported first). A value difference
        the noise floor cannot judge yet is held instead; after an A/A run, the held ones of its signature are
        judged again by ``noise`` (``judged``: this is one of them)."""
        if observation.noise_pending:
            if self.held.hold(observation):
                return
            observation = unjudged(observation)
        with self._lock:
            observation = self.tally.count(observation)
        compared = observation.outcome != Outcome.SKIPPED.value and not observation.drill  # (its block marked)
        self.report_calls(primary=observation.primary, marked=compared)
        self.publisher.export_observation(self.target, observation, self._export_failed)
        if (observation.aa or observation.backward) and not judged and len(self.held):  # (a floor grew)
            for held, check, test in self.held.judged(observation.signature, noise):
                found = within_noise_floor(held, test) if check in NOISE_CHECKS else held
                counted = check if check in CHECKS else ""
                which = "grad_noise_check" if evidence_of(held.leaf_errors) == "gradients" else "noise_check"
                found = dataclasses.replace(
                    found, noise_pending=False, noise_test=test, leaf_errors=(), **{which: counted}
                )
                self.publish(found, noise, True)

    def _export_failed(self, exporters: int) -> None:
        self.add("export_errors", exporters)

    def defer(self, deferred: Deferred, noise: NoiseFloor) -> None:
        """Publish ``deferred``'s observation once its comparison is read: at a later sampled call, the reporter's
        tick or a flush (:meth:`finish_deferred`). At most ``MAX_DEFERRED`` wait; the oldest is read (waiting for
        the device) to make room."""
        with self._lock:
            self.deferred.append((deferred, noise))
            full = len(self.deferred) > MAX_DEFERRED
        if full:
            self.finish_deferred(wait=True, at_most=1)

    def finish_deferred(self, wait: bool = False, at_most: int | None = None) -> None:
        """Publish the deferred observations whose comparisons the devices finished, oldest first (``wait``: every
        one, waiting for the devices; ``at_most``: no more than that many). Reading one that fails is a
        ``comparator`` skip, never the caller's problem."""
        done = 0
        while at_most is None or done < at_most:
            with self._lock:
                if not self.deferred or not (wait or self.deferred[0][0].ready()):
                    return
                deferred, noise = self.deferred.popleft()
            try:
                observation = deferred.observation()
            except Exception as exc:  # (ours to count: the call returned long ago)
                observation = deferred.failed(exc)
            self.publish(observation, noise)
            done += 1

    def release_held(self, noise: NoiseFloor) -> None:
        """Publish the value differences still held as skips (reason noise_pending): the floor never had the A/A
        runs to judge them."""
        for observation in self.held.release():
            self.publish(unjudged(observation), noise, True)

    def report_calls(self, flush: bool = False, primary: str = LEGACY, marked: bool = False) -> None:
        """Tell exporters how many calls passed since the last report (by signature, or under ""), the blocks of
        calls they began (:meth:`~shadow.core.calls.record.clusters.Clusters.called`: ``primary``'s, unless a
        comparison just ``marked`` it), and how many sampled calls were skipped in bulk (``flush``: a guided target's
        open gate's calls too)."""
        with self._lock:
            now = self._counted(flush)
            reported = self.tally.calls_reported
            deltas = {signature: calls - reported.get(signature, 0) for signature, calls in now.items()}
            self.tally.calls_reported = dict(now)
            skipped = self.tally.take_unreported_skips()
            blocks = self.tally.take_call_blocks(primary, any(deltas.values()) and not marked)
            phase = self.primary
        if self.publisher.exporters:
            self.publisher.record(functools.partial(_report_samples, self.target, deltas, blocks, skipped, phase))

    def stats(self, sampling: Sampling, primary: str, rolled_back_by: str | None) -> TargetStats:
        """A consistent snapshot of the target's counts."""
        with self._lock:
            tally = self.tally
            outcomes = dict(tally.outcomes)
            return TargetStats(
                calls=sampling.calls(),
                signature_calls=sampling.signature_calls(),
                primary=primary,
                rolled_back_by=rolled_back_by or "",
                sampled=sum(outcomes.values()),
                **{outcome: outcomes.get(outcome, 0) for outcome in OUTCOMES},
                by_reason=dict(tally.reasons),
                shared_divergences=dict(tally.shared),
                oracle_runs=tally.oracle_runs,
                backward_runs=tally.backward_runs,
                noise_pending=len(self.held),
                backward_skips=dict(tally.backward_skips),
                truth_runs=dict(tally.truth_runs),
                noise_checks=dict(tally.noise_checks),
                clusters=tally.clusters.count,
                drilled=tally.drilled,
                signatures_over_cap=tally.signatures_over_cap,
                export_errors=tally.export_errors,
                settings_failures=tally.settings_failures,
                shadow_peak_bytes=tally.shadow_peak_bytes,
            )

    def after_fork(self, lock: threading.Lock) -> None:
        """A forked child's: its counts start at zero, whole (the parent's are the parent's)."""
        self._lock = lock
        self.tally = self.tally.fresh()
        self.held = HeldDifferences()
        self.deferred = collections.deque()


def _report_samples(
    target: str, deltas: dict[str, int], blocks: dict[str, float], skipped: dict[str, int], phase: str
) -> list[contract.Sample]:
    """A report's samples: the calls since the last one (by signature, in ``phase``), the blocks they began (by
    side) and the sampled calls skipped in bulk (by reason)."""
    samples: list[contract.Sample] = []
    for signature, delta in deltas.items():
        samples += contract.call_samples(target, delta, signature, phase) if delta else ()
    for side, value in blocks.items():
        samples += contract.call_block_samples(target, side, value)
    for reason, count in skipped.items():
        samples += contract.skip_samples(target, reason, count, phase)
    return samples


def unjudged(observation: Observation) -> Observation:
    """A held value difference the noise floor never judged, as the skip it then is."""
    return Observation(
        observation.target, Outcome.SKIPPED, ("noise_pending",), signature=observation.signature,
        detail=observation.noise_test, timestamp=observation.timestamp, primary=observation.primary,
    )  # fmt: skip
