"""What one target counted, and the exporters told of it: its tally, its held value differences, its log."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from shadow.core.calls.gate.sampling import Sampling
from shadow.core.calls.record import clusters
from shadow.core.calls.record.held import HeldDifferences
from shadow.core.calls.record.publisher import Publisher
from shadow.core.calls.record.tally import Tally
from shadow.core.judging.noise import NoiseFloor
from shadow.core.model.observation import OUTCOMES, Observation, Outcome, TargetStats, within_noise_floor
from shadow.core.runs.global_state import TorchGlobals

log = logging.getLogger("shadow")

#: The least time between two log lines of one kind of one target's.
LOG_INTERVAL_SECONDS = 60.0


class Record:
    """One target's record.

    Args:
        target: the target's name.
        publisher: the monitor's exporters.
        lock: the experiment's lock (the tally is read and written under it).
    """

    def __init__(self, target: str, publisher: Publisher, lock: threading.Lock) -> None:
        self.target, self.publisher, self._lock = target, publisher, lock
        self.tally = Tally(clusters.cluster_share())
        self.held = HeldDifferences()
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

    def put_back(self, settings: TorchGlobals) -> bool:
        """Write back a snapshot of torch's global settings; whatever cannot be is counted and logged, never raised
        (each setting is written on its own, so the others still are). Whether all of them were."""
        try:
            settings.restore()
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

    def publish(
        self, observation: Observation, noise: NoiseFloor, report: Callable[[], None], judged: bool = False
    ) -> None:
        """Count an observation and export it (the calls so far reported first, by ``report``). A value difference
        the noise floor cannot judge yet is held instead; after an A/A run, the held ones of its signature are
        judged again by ``noise`` (``judged``: this is one of them)."""
        if observation.noise_pending:
            if self.held.hold(observation):
                return
            observation = unjudged(observation)
        with self._lock:
            observation = self.tally.count(observation)
        report()
        failed = self.publisher.export(self.target, observation)
        if failed:
            self.add("export_errors", failed)
        if observation.aa and not judged and len(self.held):
            for held, is_noise, test in self.held.judged(observation.signature, noise):
                found = within_noise_floor(held, test) if is_noise else held
                found = dataclasses.replace(found, noise_pending=False, noise_test=test, leaf_errors=())
                self.publish(found, noise, report, True)

    def release_held(self, noise: NoiseFloor, report: Callable[[], None]) -> None:
        """Publish the value differences still held as skips (reason noise_pending): the floor never had the A/A
        runs to judge them."""
        for observation in self.held.release():
            self.publish(unjudged(observation), noise, report, True)

    def report_calls(self, counted: Callable[[], dict[str, int]]) -> None:
        """Tell exporters how many calls passed since the last report (``counted()``, called under the lock: by
        signature, or under ""), and how many sampled calls were skipped in bulk."""
        with self._lock:
            now = counted()
            reported = self.tally.calls_reported
            deltas = {signature: calls - reported.get(signature, 0) for signature, calls in now.items()}
            self.tally.calls_reported = dict(now)
            skipped = self.tally.take_unreported_skips()
        for signature, delta in deltas.items():
            if delta:
                self.publisher.each("record_calls", self.target, delta, signature)
        for reason, count in skipped.items():
            self.publisher.each("record_skips", self.target, reason, count)

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
                clusters=tally.clusters.count,
                drilled=tally.drilled,
                signatures_over_cap=tally.signatures_over_cap,
                export_errors=tally.export_errors,
                settings_failures=tally.settings_failures,
            )

    def after_fork(self, lock: threading.Lock) -> None:
        """A forked child's: its counts start at zero, whole (the parent's are the parent's)."""
        self._lock = lock
        self.tally = self.tally.fresh()
        self.held = HeldDifferences()


def unjudged(observation: Observation) -> Observation:
    """A held value difference the noise floor never judged, as the skip it then is."""
    return Observation(
        observation.target, Outcome.SKIPPED, ("noise_pending",), signature=observation.signature,
        detail=observation.noise_test, timestamp=observation.timestamp, primary=observation.primary,
    )  # fmt: skip
