"""One error policy for a sampled call's shadow side: what a failure in each of its guarded steps becomes.

The monitor's failures are never a side's outcome and never the job's problem. A step whose failure loses the
whole call (telling whether it can run twice, its plan, the isolation of the shadow run, a target's snapshot, the
shadow side as a whole) skips the call with the reason ``comparator`` (counted); a step whose failure loses its own
finding alone (an extra run, the module state of a capture) says so in the log, at most once a minute per kind.
Every guarded step reads its row here (:func:`failed`)."""

from __future__ import annotations

import dataclasses

from shadow.core.calls.record.record import Record


class IsolationFailed(RuntimeError):
    """Setting up or undoing the shadow run's isolation, or taking its snapshot, failed: this tool's (or the
    target's) fault, the call skipped as "comparator" (never compared as the shadow side's exception)."""


@dataclasses.dataclass(frozen=True)
class Guard:
    """What a failure of one step becomes: the log line (``%r``: the failure) and, where it loses the whole call,
    the skip reason."""

    message: str
    skip: str = ""


#: Every guarded step of the shadow side, by name (the extra runs' names are their slots').
GUARDS: dict[str, Guard] = {
    "admission": Guard("telling whether the call can run twice failed: %r", skip="comparator"),
    "plan": Guard("planning the shadow side failed: %r", skip="comparator"),
    "isolation": Guard("the shadow run's isolation failed: %r", skip="comparator"),
    "shadow_side": Guard("the shadow side failed: %r", skip="comparator"),
    "aa": Guard("A/A run failed: %r"),
    "oracle": Guard("single-device oracle failed: %r"),
    "backward": Guard("backward comparison failed: %r"),
    "truth": Guard("float64 truth run failed: %r"),
    "state_dict": Guard("module state for the capture failed: %r"),
}


def failed(record: Record, step: str, failure: BaseException) -> str:
    """A failure of ``step``, as its guard says: logged (at most once a minute per step); the skip reason of the
    call where the failure loses it ("" where it loses the step's finding alone)."""
    guard = GUARDS[step]
    record.log_limited(step, guard.message, failure)
    return guard.skip
