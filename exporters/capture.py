"""Repro captures: a mismatching call's inputs and both outputs, saved with ``torch.save``.

Files are readable by the owner only and load with ``torch.load(..., weights_only=True)``: everything
that is not a tensor, dtype, number, string or container is replaced by a plain description
(modules by their class name, their state in ``module_state``; exceptions by their text; classes by
their import path, ``{"class": "module:qualname"}``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._pytree import tree_iter, tree_map

from shadow.core.observation import Observation

FORMAT = 1
_PLAIN = (torch.Tensor, torch.dtype, torch.device, str, int, float, bool, type(None), bytes)


def import_path(obj: Any) -> str | None:
    """``module:qualname`` of a function, method descriptor or class; None if it has none."""
    owner = getattr(obj, "__objclass__", None)  # C method descriptors such as TensorBase.type
    module = getattr(owner or obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        return None
    return f"{module}:{qualname}"


def _plain(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf.detach()
    if isinstance(leaf, _PLAIN):
        return leaf
    if isinstance(leaf, torch.nn.Module):
        return {"module": type(leaf).__qualname__}
    if isinstance(leaf, BaseException):
        return {"exception": type(leaf).__name__, "message": str(leaf)}
    if isinstance(leaf, type):
        return {"class": import_path(leaf) or repr(leaf)}
    try:
        return {"repr": repr(leaf)}
    except Exception as exc:  # a __repr__ that raises: the capture still describes the leaf
        return {"repr": f"<{type(leaf).__qualname__}: repr raised {type(exc).__name__}>"}


def payload(observation: Observation) -> dict[str, Any]:
    """What a capture file holds for an observation with evidence."""
    evidence = observation.evidence
    if evidence is None:
        raise ValueError("observation has no evidence to capture")
    return {
        "format": FORMAT,
        "target": observation.target,
        "outcome": observation.outcome,
        "reasons": list(observation.reasons),
        "signature": observation.signature,
        "detail": observation.detail,
        "args": tree_map(_plain, list(evidence.args)),
        "kwargs": tree_map(_plain, dict(evidence.kwargs)),
        "legacy": tree_map(_plain, evidence.legacy),
        "upstream": tree_map(_plain, evidence.upstream),
        "module_state": {k: v.detach() for k, v in (evidence.module_state or {}).items()},
        "legacy_fn": import_path(evidence.legacy_fn),
        "upstream_fn": import_path(evidence.upstream_fn),
        "exact": evidence.exact,
    }


def size_of(data: Any) -> int:
    """Bytes of tensor data in a payload (what dominates the file)."""
    return sum(t.numel() * t.element_size() for t in tree_iter(data) if isinstance(t, torch.Tensor))


def save(data: dict[str, Any], path: str) -> None:
    """Write a capture readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        torch.save(data, handle)


def load(path: str) -> dict[str, Any]:
    """Read a capture safely (weights_only); tensors of devices absent here come to the CPU."""
    try:
        try:
            data = torch.load(path, weights_only=True)
        except RuntimeError:
            data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # unpickling errors come in many types
        raise ValueError(f"{path} is not a loadable capture: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an npu-shadow capture (format {FORMAT})")
    for key, kind in _FIELDS.items():
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{path}: malformed capture: {key!r} must be a {kind.__name__}, got {data.get(key)!r:.80}")
    if not all(isinstance(k, str) for k in data["kwargs"]):
        raise ValueError(f"{path}: malformed capture: 'kwargs' keys must be strings")
    return data


#: The fields every capture has, with their types.
_FIELDS = {"target": str, "outcome": str, "signature": str, "detail": str, "args": list, "kwargs": dict}
