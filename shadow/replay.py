"""Re-running a repro capture: legacy and upstream on the captured inputs, compared again."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from shadow import reference
from shadow.compare import Comparison, compare

#: Targets whose capture holds evidence but cannot be re-run without the job's model.
NOT_REPLAYABLE = {"parallel_apply", "data_parallel"}


def resolve(path: str) -> Callable:
    """Import ``module:qualname``."""
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _restore(leaf: Any) -> Any:
    if isinstance(leaf, dict) and set(leaf) == {"class"} and ":" in leaf["class"]:
        return resolve(leaf["class"])
    return leaf


def _callables(data: dict[str, Any]) -> tuple[Callable, Callable]:
    legacy_path, upstream_path = data.get("legacy_fn"), data.get("upstream_fn")
    if data["target"] == "tensor_type":
        # torch_npu's patch where it is importable, the reference legacy elsewhere
        legacy = _try_resolve(legacy_path) or reference.npu_type
        return legacy, _try_resolve(upstream_path) or torch._C.TensorBase.type
    if not legacy_path or not upstream_path:
        raise ValueError(f"capture of {data['target']!r} does not name importable legacy/upstream functions")
    return resolve(legacy_path), resolve(upstream_path)


def _try_resolve(path: str | None) -> Callable | None:
    if not path:
        return None
    try:
        return resolve(path)
    except (ImportError, AttributeError):
        return None


def replay(data: dict[str, Any]) -> tuple[Comparison | None, str]:
    """Run both sides on the captured inputs. Returns the comparison (None if it cannot run) and a text."""
    if data["target"] in NOT_REPLAYABLE:
        return None, (
            f"{data['target']} captures hold inputs, outputs and the module's state_dict "
            f"({len(data.get('module_state') or {})} entries); re-running needs the job's model"
        )
    legacy, upstream = _callables(data)
    args = tree_map(_restore, data["args"])
    kwargs = tree_map(_restore, data["kwargs"])
    results = []
    for function in (legacy, upstream):
        try:
            results.append((function(*args, **kwargs), None))
        except Exception as exc:
            results.append((None, exc))
    (legacy_out, legacy_error), (upstream_out, upstream_error) = results
    if legacy_error is not None or upstream_error is not None:
        if type(legacy_error) is type(upstream_error):
            return Comparison("match"), "both sides raised " + type(legacy_error).__name__
        text = "; ".join(
            f"{side} raised {type(e).__name__}: {e}" if e is not None else f"{side} returned normally"
            for side, e in (("legacy", legacy_error), ("upstream", upstream_error))
        )
        return Comparison("mismatch", ("exception",), detail=text), text
    result = compare(legacy_out, upstream_out, exact=bool(data.get("exact")), legacy_inputs=args, upstream_inputs=args)
    return result, result.detail or result.outcome
