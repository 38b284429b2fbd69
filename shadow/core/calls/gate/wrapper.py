"""The function installed in legacy's place: one C call on the unsampled path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from shadow.core.calls.gate.sampling import CLOSED, Gate

Setters = tuple[Callable[[Gate], None], Callable[[Callable], None]]


def make_wrapper(
    primary: Callable,
    arrive: Callable[[tuple, dict], Any],
    novel: Callable[[tuple, dict], Any] | None = None,
    key: Callable[[tuple, dict], Any] | None = None,
    known: set | None = None,
) -> tuple[Callable, Setters]:
    """The function installed in legacy's place, and the setters that hand it a new gate and a new primary (the
    function whose result the caller gets: legacy, or upstream in a canary until a rollback).

    The unsampled path is ``next(gate, False)`` and the primary's call: nothing else runs there. A call that finds
    the gate closed goes to ``arrive``: the sampled call, or (a guided target) a call to classify. With a signature
    ``key`` (:attr:`Target.signature_key`), only a call whose key is ``known`` (its signature had its first calls)
    takes the gate; every other call is ``novel``: classified and counted on its own, so a signature is compared on
    its first calls whenever it first appears.
    """
    gate = CLOSED

    def shadow_wrapper(*args: Any, **kwargs: Any) -> Any:
        if next(gate, False):
            return primary(*args, **kwargs)
        return arrive(args, kwargs)

    def keyed_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            seen = key(args, kwargs) in known  # type: ignore[misc, operator]
        except Exception:  # (a key function's failure, or an unhashable key: the call is classified)
            seen = False
        if seen:
            if next(gate, False):
                return primary(*args, **kwargs)
            return arrive(args, kwargs)
        return novel(args, kwargs)  # type: ignore[misc]

    def set_gate(new_gate: Gate) -> None:
        nonlocal gate
        gate = new_gate

    def set_primary(new_primary: Callable) -> None:
        nonlocal primary
        primary = new_primary

    wrapper = shadow_wrapper if key is None else keyed_wrapper
    _look_like(wrapper, primary)
    return wrapper, (set_gate, set_primary)


def _look_like(wrapper: Callable, legacy: Callable) -> None:
    for name in ("__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, name, getattr(legacy, name))
    wrapper.__wrapped__ = legacy  # type: ignore[attr-defined]
