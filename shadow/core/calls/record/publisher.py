"""The exporters of a monitor, and the one way the core calls them."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from shadow.core.calls.record.exporting import call_hook
from shadow.core.runs.sides import marks

log = logging.getLogger("shadow")

#: The least time between two log lines of one exporter's failures in one hook.
LOG_INTERVAL_SECONDS = 60.0


class Publisher:
    """A monitor's exporters, called through :func:`shadow.core.calls.record.exporting.call_hook` (a failure is
    returned, never
    raised), under the ``publishing`` mark (a patched function an exporter calls is not a call of the job's), each
    failure logged at most once a minute per exporter and hook.

    Args:
        exporters: objects with ``export`` (checked by ``install``) and any of the optional hooks.
    """

    def __init__(self, exporters: Sequence[Any] = ()) -> None:
        self.exporters = tuple(exporters)
        self._last_logged: dict[tuple[str, int], float] = {}

    def each(self, hook: str, *args: Any) -> int:
        """Call ``hook`` on every exporter that has it. Returns how many failed."""
        publishing = getattr(marks, "publishing", False)
        failed = 0
        try:
            marks.publishing = True
            for exporter in self.exporters:
                failure = call_hook(exporter, hook, *args)
                if failure is not None:
                    failed += 1
                    self._log(exporter, hook, failure)
        finally:
            marks.publishing = publishing
        return failed

    def export(self, target: str, observation: Any) -> int:
        """Export an observation; each exporter that failed is told to the others (``record_export_error``).
        Returns how many failed."""
        failed = self.each("export", observation)
        for _ in range(failed):
            self.each("record_export_error", target)
        return failed

    def _log(self, exporter: Any, hook: str, failure: BaseException) -> None:
        now, key = time.monotonic(), (hook, id(exporter))
        last = self._last_logged.get(key)
        if last is None or now - last >= LOG_INTERVAL_SECONDS:
            self._last_logged[key] = now
            log.warning("npu-shadow: exporter %r failed in %s: %r", exporter, hook, failure)
