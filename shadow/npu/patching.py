"""How legacy patches make themselves known, without the legacy side knowing who listens.

Legacy functions loaded from torch_npu's source carry :data:`LEGACY_ORIGIN_ATTRIBUTE` (the release and path they
came from), so the monitor can say which legacy it shadows. Whoever installs legacy patches after the monitor
(``reference.patch_torch()``, ``torch_npu_source``'s ``patch_torch()``) calls :meth:`Announcer.announce` on
:data:`LEGACY_PATCHED`; the launcher subscribes to it and moves its monitor over the new legacy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

LEGACY_ORIGIN_ATTRIBUTE = "__npu_shadow_legacy_origin__"


class Announcer:
    """A list of listeners called, in subscription order, each time something is announced."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on every announcement from now on (once, however often it subscribes)."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def announce(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


#: Announced after legacy patches were installed over torch's functions.
LEGACY_PATCHED = Announcer()
