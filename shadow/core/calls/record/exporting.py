"""The exporter protocol: the four hooks the core calls on an exporter, and the one place that calls them.

The core turns what it counts into the metric contract's samples once (:mod:`shadow.core.model.contract`), and
hands them to every exporter's ``record``; what needs a line of its own (an observation, a rollback or reset, a
canary A/B's iterator) goes to ``export`` as a record. A backend that only keeps counts (Prometheus, OpenTelemetry)
has ``record`` alone; one that keeps lines (the journal) has both. Every call of a hook goes through
:func:`call_hook`, which never lets an exporter's failure (any exception, SystemExit included; KeyboardInterrupt
excepted) reach the job: it is returned for the caller to count and log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from shadow.core.model.contract import Sample


class Exporter(Protocol):
    """What the core calls on an exporter: ``export`` or ``record`` (or both); the others are optional."""

    #: Optional: True where the exporter keeps a divergence's evidence (repro captures): a sampled call then reads
    #: its comparison at once, never deferred (the evidence is the call's tensors).
    captures: bool

    def export(self, record: Any) -> None:
        """A record: an :class:`~shadow.core.model.observation.Observation` (one sampled call's), a
        :class:`~shadow.core.model.observation.Switched` (a rollback, or a person's reset), or a canary A/B's
        iterator (``shadow.core.calls.canary.arms.ArmRun``). Its samples were recorded just before."""

    def record(self, samples: Sequence[Sample]) -> None:
        """Samples of the contract's series (:data:`~shadow.core.model.contract.Sample`: a counter's increment, a
        histogram's observation, a gauge's value): what a record, the calls since the last report, the process's
        time or the target's installation and primary add up to."""

    def flush(self) -> None:
        """Write out what is buffered (the monitor's flush: at exit, at uninstall)."""

    def close(self) -> None:
        """Release files, sockets and servers (the launcher calls it when its settings change)."""


#: Every hook, in the order of the protocol above.
HOOKS = ("export", "record", "flush", "close")


def call_hook(exporter: Any, hook: str, *args: Any) -> BaseException | None:
    """Call ``exporter.<hook>(*args)`` if the exporter has that hook. Returns what it raised, or None."""
    if hook not in HOOKS:
        raise ValueError(f"{hook!r} is not an exporter hook; the hooks are {HOOKS}")
    try:
        method = getattr(exporter, hook, None)
        if method is not None:
            method(*args)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return exc
    return None


def check(exporter: Any, where: str) -> None:
    """Raise ValueError unless ``exporter`` has a callable ``export`` or ``record`` (looking them up may not raise
    either)."""
    try:
        hooks = [getattr(exporter, hook, None) for hook in ("export", "record")]
    except Exception as exc:
        raise ValueError(f"{where}: {type(exporter).__name__} raised looking up its hooks: {exc!r}") from None
    if not any(callable(hook) for hook in hooks):
        raise ValueError(f"{where}: {exporter!r} has neither an export(record) nor a record(samples) method")
