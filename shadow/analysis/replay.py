"""Re-running a repro capture: legacy and upstream on the captured inputs, compared again.

A capture is data from elsewhere (a bug report, a shared folder): nothing in it chooses what runs. A built-in
target's capture re-runs that target's own functions (``tensor_type``: the reference legacy against
``torch._C.TensorBase.type``); a custom target's functions come from the command line. Class leaves resolve only
to torch's tensor type classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_iter, tree_map

from shadow.core.judging.compare import Comparison, compare, compare_exceptions
from shadow.core.model.observation import Outcome
from shadow.npu import reference

#: Targets whose capture holds evidence but cannot be re-run without the job's model.
NOT_REPLAYABLE = {"parallel_apply", "data_parallel"}

#: What each built-in target re-runs: (legacy, upstream).
BUILTIN_FUNCTIONS: dict[str, tuple[Callable, Callable]] = {
    "tensor_type": (reference.npu_type, torch._C.TensorBase.type),
}

#: Tensor type class names a capture's ``{"class": "module:Name"}`` leaf may name (module torch or a device's).
TENSOR_TYPE_CLASSES = frozenset(
    f"{kind}Tensor" for kind in ("Bool", "Byte", "Char", "Short", "Int", "Long", "Half", "Float", "Double", "BFloat16")
)


class ReplayRefused(ValueError):
    """The capture asks for something replay does not do; the message says what."""


def resolve(path: str) -> Callable:
    """Import ``module:qualname`` (for functions given on the command line, never from a capture)."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"{path!r} is not MODULE:FUNCTION")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


def tensor_type_class(path: str) -> type:
    """The tensor type class a capture names ('torch:FloatTensor', 'torch.npu:HalfTensor'); refuses the rest."""
    module_name, _, name = path.partition(":")
    accelerator = torch.accelerator.current_accelerator()
    modules = {"torch": torch}
    if accelerator is not None:
        modules[f"torch.{accelerator.type}"] = torch.get_device_module(accelerator.type)
    found = getattr(modules[module_name], name, None) if module_name in modules else None
    if name not in TENSOR_TYPE_CLASSES or not isinstance(found, type):
        raise ReplayRefused(f"the capture names class {path!r}: only torch tensor type classes are replayed")
    return found


def devices_needed(data: dict[str, Any], locations: set[str]) -> tuple[str, int] | None:
    """(device type, count) the captured call ran on where this process has no such accelerator: from the
    devices its tensors were saved from (``locations``, see :func:`exporters.capture.load`), the current device
    it recorded and the device classes it names ('torch.npu:HalfTensor'). None when this process has them."""
    named = {str(data.get("device") or ""), *locations}
    named |= {str(leaf["class"]).split(":")[0].removeprefix("torch.") + ":0" for leaf in _classes(data)}
    wanted: dict[str, int] = {}
    for text in named:
        kind, _, index = text.partition(":")
        if kind and kind != "cpu" and "." not in kind:
            wanted[kind] = max(wanted.get(kind, 0), int(index) + 1 if index.isdigit() else 1)
    accelerator = torch.accelerator.current_accelerator()
    here = accelerator.type if accelerator is not None else None
    count_here = torch.accelerator.device_count() if here is not None else 0
    missing = {kind: count for kind, count in wanted.items() if kind != here or count > count_here}
    if not missing:
        return None
    kind = max(missing, key=lambda k: missing[k])
    return kind, missing[kind]


def _classes(data: dict[str, Any]) -> list[dict]:
    return [leaf for leaf in tree_iter((data["args"], data["kwargs"]), is_leaf=_is_class) if _is_class(leaf)]


def current_device(data: dict[str, Any]) -> int | None:
    """The device index the capture recorded as current, where this process's accelerator is of its type."""
    kind, _, index = str(data.get("device") or "").partition(":")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or kind != accelerator.type or not index.isdigit():
        return None
    return int(index) if int(index) < torch.accelerator.device_count() else None


def _is_class(leaf: Any) -> bool:
    return isinstance(leaf, dict) and set(leaf) == {"class"}


def _restore(leaf: Any) -> Any:
    return tensor_type_class(str(leaf["class"])) if _is_class(leaf) else leaf


def functions(
    data: dict[str, Any], legacy: Callable | None = None, upstream: Callable | None = None
) -> tuple[Callable, Callable]:
    """The two functions to re-run: a built-in target's own, or for a custom target those given."""
    target = data["target"]
    if target in BUILTIN_FUNCTIONS:
        if legacy is not None or upstream is not None:
            raise ReplayRefused(f"{target} is a built-in target: it re-runs its own functions only")
        return BUILTIN_FUNCTIONS[target]
    if legacy is None or upstream is None:
        named = f" (the capture says legacy {data.get('legacy_fn')}, upstream {data.get('upstream_fn')})"
        raise ReplayRefused(
            f"a capture of custom target {target!r} re-runs the functions given with --legacy MODULE:FUNCTION "
            f"and --upstream MODULE:FUNCTION, never those the file names{named}"
        )
    return legacy, upstream


def replay(
    data: dict[str, Any], legacy: Callable | None = None, upstream: Callable | None = None
) -> tuple[Comparison | None, str]:
    """Run both sides on the captured inputs. Returns the comparison (None if it cannot run) and a text.

    Raises :class:`ReplayRefused` when the capture asks for functions or classes replay does not run.
    """
    if data["target"] in NOT_REPLAYABLE:
        return None, (
            f"{data['target']} captures hold inputs, outputs and the module's state_dict "
            f"({len(data.get('module_state') or {})} entries); re-running needs the job's model"
        )
    legacy, upstream = functions(data, legacy, upstream)
    args = tree_map(_restore, data["args"], is_leaf=_is_class)
    kwargs = tree_map(_restore, data["kwargs"], is_leaf=_is_class)
    results = []
    for function in (legacy, upstream):
        try:
            with torch.accelerator.device_index(current_device(data)):
                results.append((function(*args, **kwargs), None))
        except Exception as exc:
            results.append((None, exc))
    (legacy_out, legacy_error), (upstream_out, upstream_error) = results
    if legacy_error is not None or upstream_error is not None:
        result = compare_exceptions(legacy_error, upstream_error)
        if legacy_error is not None and upstream_error is not None:
            same = "the same exception" if result.outcome == Outcome.MATCH else "exceptions of the same type"
            if result.outcome == Outcome.ERROR:
                same = "different exceptions"
            return result, f"both sides raised ({same}): {result.detail}"
        return result, result.detail
    result = compare(legacy_out, upstream_out, exact=bool(data.get("exact")), legacy_inputs=args, upstream_inputs=args)
    return result, result.detail or result.outcome
