"""Whether the shadow side's own runs registered autograd hooks: the job's code, which a backward comparison would
run again.

A forward may register a hook on a tensor it makes (``y.register_hook(log_gradient)``): the job's backward runs it
once. A backward comparison pulls products through the shadow run's graph and through legacy's again, so the hook
would run twice more, the job's code seeing calls it never made. While a monitor that compares gradients is
installed, torch's hook registrations count the ones made on a shadow-side thread (nothing else changes: the
original runs as it did, for the job's threads too); a backward comparison whose runs registered any is skipped
(reason ``hooks``). Hooks registered through a graph node's own ``register_hook`` (C code) are not seen.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.runs.sides import current_run, shadow_side_of_this_thread

#: The registering functions watched: (owner, attribute).
_WATCHED: tuple[tuple[Any, str], ...] = (
    (torch.Tensor, "register_hook"),
    (torch.Tensor, "register_post_accumulate_grad_hook"),
    (torch.autograd.graph, "register_multi_grad_hook"),
)

_lock = threading.Lock()
_installs = 0
_originals: list[tuple[Any, str, Any]] = []
_registered = [0]  # (hooks registered on shadow-side threads so far: a list, bumped without a lock)


def registered() -> int:
    """How many hooks the shadow side's runs have registered so far (compare two readings)."""
    return _registered[0]


def _counting(original: Callable) -> Callable:
    @functools.wraps(original)
    def register(*args: Any, **kwargs: Any) -> Any:
        if current_run() is not None or shadow_side_of_this_thread() is not None:
            _registered[0] += 1
        return original(*args, **kwargs)

    return register


def install() -> None:
    """Count registrations from now on (nested installs are counted: the last :func:`uninstall` puts torch back)."""
    global _installs
    with _lock:
        _installs += 1
        if _installs > 1:
            return
        for owner, attribute in _WATCHED:
            original = vars(owner).get(attribute)
            if original is not None:
                _originals.append((owner, attribute, original))
                setattr(owner, attribute, _counting(original))


def uninstall() -> None:
    """Undo one :func:`install`: the last one puts torch's own functions back (where nothing replaced ours since)."""
    global _installs
    with _lock:
        _installs = max(0, _installs - 1)
        if _installs:
            return
        while _originals:
            owner, attribute, original = _originals.pop()
            if getattr(vars(owner).get(attribute), "__wrapped__", None) is original:
                setattr(owner, attribute, original)
