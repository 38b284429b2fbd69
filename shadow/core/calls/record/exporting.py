"""The exporter protocol: every hook the core calls on an exporter, and the one place that calls them.

An exporter is any object with ``export``; the other hooks are optional and looked up by name. Every call of
a hook goes through :func:`call_hook`, which never lets an exporter's failure (any exception, SystemExit
included; KeyboardInterrupt excepted) reach the job: it is returned for the caller to count and log.
"""

from __future__ import annotations

from typing import Any, Protocol

from shadow.core.model.observation import Observation


class Exporter(Protocol):
    """What the core calls on an exporter. Only ``export`` is required."""

    def export(self, observation: Observation) -> None:
        """One sampled call's observation."""

    #: Optional: True where the exporter keeps a divergence's evidence (repro captures): a sampled call then reads
    #: its comparison at once, never deferred (the evidence is the call's tensors).
    captures: bool

    # ------------------------------------------------------------------ optional hooks

    def register(self, target: str, sample_rate: float) -> None:
        """At install: show the target installed (its calls at zero) and record its sample rate."""

    def record_calls(self, target: str, calls: int, signature: str = "") -> None:
        """Calls of the target (sampled or not) since the last report; for a coverage-guided target, by
        ``signature`` (passed only then: the calls of all signatures add up to the target's)."""

    def record_call_blocks(self, target: str, primary: str, blocks: float) -> None:
        """The target's calls (``primary`` the side the caller got) began a block of process time: ``blocks`` is
        what it counts as (a rank's share; :meth:`shadow.core.calls.record.clusters.Clusters.called`)."""

    def record_skips(self, target: str, reason: str, count: int) -> None:
        """Sampled calls skipped in bulk, without an observation each (the overhead budget)."""

    def set_primary(self, target: str, side: str) -> None:
        """The side whose result the caller gets for ``target`` ('legacy' or 'upstream'): at install, and at a
        rollback."""

    def record_rollback(self, target: str, by: str) -> None:
        """The rollback switch made legacy the primary of ``target``; ``by`` says who or what threw it
        ("http:<requester>", "file:<path>", "api:<caller>")."""

    def record_reset(self, target: str, by: str) -> None:
        """A person reset ``target``'s primary after a rollback (the verdict sets evidence before it aside)."""

    def record_time(self, seconds: float) -> None:
        """Seconds of this process's time under the monitor since the last report (each second, and at flush):
        what the verdict turns into "how much more running it takes"."""

    def record_patch_calls(self, patch: str, calls: int) -> None:
        """The job's calls of a release's function patch (by its dotted name) since the last report
        (:mod:`shadow.core.calls.patch_calls`)."""

    def flush(self) -> None:
        """Write out what is buffered (the monitor's flush: at exit, at uninstall)."""

    def record_export_error(self, target: str) -> None:
        """Another exporter failed to export one of the target's observations."""

    def set_drill(self, active: bool) -> None:
        """A fire drill is (or is no longer) injecting synthetic divergence."""

    def close(self) -> None:
        """Release files, sockets and servers (the launcher calls it when its settings change)."""

    def export_arm(self, run: Any) -> None:
        """One iterator of a canary A/B, built by one arm (a ``shadow.core.calls.canary.arms.ArmRun``)."""


#: Every hook, in the order of the protocol above.
HOOKS = (
    "export",
    "register",
    "record_calls",
    "record_call_blocks",
    "record_skips",
    "set_primary",
    "record_rollback",
    "record_reset",
    "record_time",
    "record_patch_calls",
    "flush",
    "record_export_error",
    "set_drill",
    "close",
    "export_arm",
)


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
    """Raise ValueError unless ``exporter`` has a callable ``export`` (looking it up may not raise either)."""
    try:
        export = getattr(exporter, "export", None)
    except Exception as exc:
        raise ValueError(f"{where}: {type(exporter).__name__} raised looking up export: {exc!r}") from None
    if not callable(export):
        raise ValueError(f"{where}: {exporter!r} has no export(observation) method")
