"""Making torch.compile see legacy, not the wrapper.

Dynamo cannot trace the sampler's gate (``next`` on an ``itertools.repeat`` is a graph break) and
would guard on it if it could. ``torch.compiler.substitute_in_graph`` tells dynamo to trace legacy in
the wrapper's place, so compiled code behaves as legacy alone: no sampling inside traced code, no
extra graph break or recompilation, and no cost in eager mode.

Registering needs ``torch._dynamo``, whose import takes seconds. A process that never compiles
should not pay that, so registrations wait until something else imports ``torch._dynamo``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shadow")

_DYNAMO = "torch._dynamo"


class Substitutions:
    """Wrappers waiting for dynamo to be imported before dynamo is told to trace their legacy instead."""

    def __init__(self) -> None:
        self._pending: list[tuple[Callable, Callable]] = []

    def trace_as_legacy(self, wrapper: Callable, legacy: Callable) -> None:
        """Have dynamo trace ``legacy`` wherever it meets ``wrapper``, now or once dynamo is imported."""
        if _DYNAMO in sys.modules:
            _register(wrapper, legacy)
        else:
            self._pending.append((wrapper, legacy))
            if not any(isinstance(finder, _DynamoImportHook) for finder in sys.meta_path):
                sys.meta_path.insert(0, _DynamoImportHook(self.flush))

    def flush(self) -> None:
        while self._pending:
            _register(*self._pending.pop(0))


#: The process's pending substitutions.
SUBSTITUTIONS = Substitutions()


def trace_as_legacy(wrapper: Callable, legacy: Callable) -> None:
    """Have dynamo trace ``legacy`` wherever it meets ``wrapper``, now or once dynamo is imported."""
    SUBSTITUTIONS.trace_as_legacy(wrapper, legacy)


def _register(wrapper: Callable, legacy: Callable) -> None:
    import torch

    def traceable(*args: Any, **kwargs: Any) -> Any:
        return legacy(*args, **kwargs)

    try:
        torch.compiler.substitute_in_graph(wrapper, skip_signature_check=True)(traceable)
    except Exception as exc:  # an older torch without it: compiled code then traces the wrapper
        log.warning("npu-shadow: torch.compile will trace the shadow wrapper (%s)", exc)


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Runs the pending registrations right after ``torch._dynamo`` has finished importing."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            self.then()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
