"""How legacy patches make themselves known, without the legacy side knowing who listens.

Legacy functions loaded from torch_npu's source carry :data:`LEGACY_ORIGIN_ATTRIBUTE` (the release and path they
came from), so the monitor can say which legacy it shadows. Whoever installs legacy patches after the monitor
(``reference.patch_torch()``, ``torch_npu_source``'s ``patch_torch()``) calls :meth:`Announcer.announce` on
:data:`LEGACY_PATCHED`; the launcher subscribes to it and moves its monitor over the new legacy. They install with
:func:`replace`, which remembers what each patch replaced: upstream's function, where torch has no other name for
it (``Module.to``, the DataLoader iterator's ``__init__``), found by :func:`upstream_of`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any

LEGACY_ORIGIN_ATTRIBUTE = "__npu_shadow_legacy_origin__"

_MISSING = object()

#: What the first legacy patch of ``(owner, attribute)`` replaced, by ``(id(owner), attribute)``: upstream's.
_REPLACED: dict[tuple[int, str], Any] = {}


@dataclasses.dataclass
class Patches:
    """What :func:`replace` replaced, so that :meth:`undo` can put it back."""

    saved: list[tuple[Any, str, Any]]

    def undo(self) -> None:
        for owner, name, original in reversed(self.saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved.clear()


def replace(replacements: Iterable[tuple[Any, str, Any]]) -> Patches:
    """``setattr(owner, attribute, value)`` for each replacement, remembering what was there (for :meth:`Patches.undo`
    and, the first time an attribute is patched, for :func:`upstream_of`)."""
    saved = []
    for owner, name, value in replacements:
        before = vars(owner).get(name, _MISSING)
        saved.append((owner, name, before))
        if before is not _MISSING and getattr(before, LEGACY_ORIGIN_ATTRIBUTE, None) is None:
            _REPLACED.setdefault((id(owner), name), before)
        setattr(owner, name, value)
    return Patches(saved)


def upstream_of(owner: Any, attribute: str) -> Any | None:
    """What the first legacy patch installed with :func:`replace` on ``owner.attribute`` replaced, or None."""
    return _REPLACED.get((id(owner), attribute))


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
