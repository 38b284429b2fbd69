"""The built-in targets' factories: the three patches npu-shadow was built for (here) and those torch_npu 2.13/2.14
still carry (:mod:`shadow.core.model.live_targets`); each target is a row of :data:`shadow.npu.catalog.CATALOG`,
and :data:`BUILTINS` and :data:`PLACES` are derived from it.

A built-in target's legacy is whatever is installed when the monitor installs (torch_npu's patch on an
NPU host, its source's with ``--legacy-from``, :mod:`shadow.npu.reference`'s in a rehearsal); its upstream is
torch's own implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_iter

from shadow.core.model import live_targets, oracle
from shadow.core.model.observation import BUILTIN_RISKY
from shadow.core.model.target import Target
from shadow.npu import catalog, reference
from shadow.npu.patching import LEGACY_ORIGIN_ATTRIBUTE

__all__ = [
    "BUILTINS",
    "PLACES",
    "Target",
    "active_builtins",
    "data_parallel",
    "parallel_apply",
    "patch_origin",
    "tensor_type",
]

# --------------------------------------------------------------------------- signatures


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


#: The accelerator's device type, once torch has one (it does not change for the life of the process).
_ACCELERATOR: list[str | None] = [None]


def _placement(tensor: Any) -> str:
    """Where a call's tensor is: ``cpu``; ``current`` or ``noncurrent``, on the accelerator's current device or
    another of its devices (where legacy's ``.type()`` differs: it moves to the current npu); else its device type."""
    device = getattr(tensor, "device", None)
    if device is None:
        return "none"
    kind = device.type
    if kind == "cpu":
        return "cpu"
    accelerator = _ACCELERATOR[0]
    if accelerator is None:
        found = torch.accelerator.current_accelerator()
        accelerator = _ACCELERATOR[0] = found.type if found is not None else None
    if kind == accelerator:
        return "current" if device.index == torch.accelerator.current_device_index() else "noncurrent"
    return kind


def _off_npu() -> str:
    """``_elsewhere`` where this process's accelerator is another than an npu (a GPU): an npu type name or class
    there is a path of its own (legacy moves to the accelerator, upstream knows no npu), a risky signature, never an
    unexplained divergence; "" on an npu, and on a host without an accelerator."""
    accelerator = _ACCELERATOR[0]
    if accelerator is None:
        found = torch.accelerator.current_accelerator()
        accelerator = _ACCELERATOR[0] = found.type if found is not None else None
    return "_elsewhere" if accelerator not in (None, "npu") else ""


#: The destination kind of each ``.type()`` argument seen (bounded): the classification runs on every call.
_KINDS: dict[Any, str] = {}


def _destination(dtype: Any) -> str:
    try:
        return _KINDS[dtype]
    except (KeyError, TypeError):  # (not seen yet, or not hashable)
        pass
    if dtype is None:
        kind = "none"
    elif isinstance(dtype, torch.dtype):
        kind = "dtype"
    elif isinstance(dtype, str):
        if reference.npu_type_dtype(dtype) is None:
            kind = "name"
        else:
            kind = "torch_npu_name" if dtype.startswith("torch_npu.") else "npu_name" + _off_npu()
    elif isinstance(dtype, type):
        kind = "npu_class" + _off_npu() if reference.npu_type_dtype(dtype) is not None else "class"
    else:
        return "other"
    if len(_KINDS) < 1024:
        _KINDS[dtype] = kind
    return kind


def tensor_type_signature(args: tuple, kwargs: dict) -> str:
    """``<destination>/<source>/<blocking|nonblocking>`` of a ``Tensor.type`` call.

    Destination: ``none``, ``dtype``, ``npu_name`` (``'torch.npu.HalfTensor'``), ``torch_npu_name`` (torch_npu's
    own spelling ``'torch_npu.npu.HalfTensor'``, which upstream rejects), ``name`` (any other name),
    ``npu_class``, ``class`` or ``other``; ``npu_name_elsewhere`` and ``npu_class_elsewhere`` on an accelerator
    that is not an npu (:func:`_off_npu`). Source: see :func:`_placement`.
    """
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    nonblocking = (
        (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) if kwargs or len(args) > 2 else False
    )
    return f"{_destination(dtype)}/{_placement(args[0])}/{'nonblocking' if nonblocking else 'blocking'}"


def _dp_signature(replicas: int) -> str:
    accelerator = torch.accelerator.current_accelerator()
    device_type = accelerator.type if accelerator is not None else "cpu"
    grad = "on" if torch.is_grad_enabled() else "off"
    autocast = "on" if torch.is_autocast_enabled(device_type) else "off"
    return f"replicas={'1' if replicas == 1 else '2+' if replicas > 1 else '0'}/grad={grad}/autocast={autocast}"


def parallel_apply_signature(args: tuple, kwargs: dict) -> str:
    """``replicas=<1|2+>/grad=<on|off>/autocast=<on|off>`` of a ``DataParallel.parallel_apply`` call (a single
    replica is legacy's path where its worker's ``set_device`` stays behind)."""
    return _dp_signature(len(_arg(args, kwargs, 1, "replicas", ())))


def data_parallel_signature(args: tuple, kwargs: dict) -> str:
    """The same classification for a ``data_parallel(module, inputs, device_ids, output_device, dim, ...)`` call,
    by the replicas that run: scatter cuts the batch into at most as many chunks as it has rows along ``dim``, so a
    batch of one runs one replica however many device ids are given."""
    device_ids = _arg(args, kwargs, 2, "device_ids")
    if device_ids is None:
        device_ids = range(torch.accelerator.device_count() or 1)
    dim = _arg(args, kwargs, 4, "dim", 0)
    rows = next(
        (t.size(dim) for t in tree_iter(_arg(args, kwargs, 1, "inputs")) if isinstance(t, torch.Tensor) and t.dim()),
        None,
    )
    return _dp_signature(len(device_ids) if rows is None else min(len(device_ids), rows))


#: The key of every argument-free ``t.type()`` (a query of the tensor's type name, never a risky path).
_NAMES_ITS_TYPE = ("names its type",)
_DTYPE = torch.dtype


def tensor_type_key(args: tuple, kwargs: dict, _dtype: type = _DTYPE, _query: tuple = _NAMES_ITS_TYPE) -> Any:
    """The :attr:`Target.signature_key` of a ``Tensor.type`` call: the dtype of a cast to a dtype (its signatures,
    ``dtype/<placement>/blocking``, are never a risky path), one key for the argument-free query, and None for the
    rest (a destination by name or class: the kinds whose paths can be risky, every call classified). It reads no
    attribute of the tensor: a mode or a subclass's ``__torch_function__`` would see that."""
    if kwargs:
        return None
    count = len(args)
    if count == 2:
        destination = args[1]
        return destination if destination.__class__ is _dtype else None
    return _query if count == 1 else None


def names_its_type(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.type`` call is ``t.type()``: the name of the tensor's type, read from its metadata by
    torch's C code (no copy, no device work, no lock; a tensor subclass or mode that could run Python skips the
    call before upstream runs)."""
    return len(args) == 1 and not kwargs


#: Where torch_npu 2.12's legacy and upstream are known to differ (the README's "what really differs").
TENSOR_TYPE_RISKY = BUILTIN_RISKY["tensor_type"]
DATA_PARALLEL_RISKY = BUILTIN_RISKY["parallel_apply"]


# --------------------------------------------------------------------------- built-ins


def _torch_parallel_apply() -> Callable:
    return importlib.import_module("torch.nn.parallel.parallel_apply").parallel_apply


def _torch_data_parallel() -> Callable:
    # The package attribute torch.nn.parallel.data_parallel is the (possibly patched) function that
    # hides the submodule of the same name; the submodule keeps upstream's function.
    return importlib.import_module("torch.nn.parallel.data_parallel").data_parallel


def tensor_type() -> Target:
    """``torch.Tensor.type`` against ``torch._C.TensorBase.type``; casts must be bitwise identical."""
    return Target(
        name="tensor_type",
        owner=torch.Tensor,
        attribute="type",
        upstream=torch._C.TensorBase.type,
        exact=True,
        isolate=False,
        signature=tensor_type_signature,
        signature_pure=True,
        risky_signatures=TENSOR_TYPE_RISKY,
        never_blocks=names_its_type,
        signature_key=tensor_type_key,
    )


def parallel_apply(apply: Callable | None = None) -> Target:
    """``DataParallel.parallel_apply`` against torch's module-level ``parallel_apply``.

    ``apply`` replaces torch's function (with the same signature), e.g. by one that runs on the CPU.
    """
    apply = apply or _torch_parallel_apply()

    def upstream_parallel_apply(self: torch.nn.DataParallel, replicas: Sequence, inputs: Sequence, kwargs: Any) -> list:
        return apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])

    return Target(
        name="parallel_apply",
        owner=torch.nn.DataParallel,
        attribute="parallel_apply",
        upstream=upstream_parallel_apply,
        signature=parallel_apply_signature,
        signature_pure=True,
        risky_signatures=DATA_PARALLEL_RISKY,
        oracle=oracle.parallel_apply_call,
    )


def data_parallel(function: Callable | None = None) -> Target:
    """``torch.nn.parallel.data_parallel`` against the submodule's upstream function (or ``function``)."""
    return Target(
        name="data_parallel",
        owner=importlib.import_module("torch.nn.parallel"),
        attribute="data_parallel",
        upstream=function or _torch_data_parallel(),
        signature=data_parallel_signature,
        signature_pure=True,
        risky_signatures=DATA_PARALLEL_RISKY,
        oracle=oracle.data_parallel_call,
    )


#: Each built-in target's factory, by name (its row's, :data:`shadow.npu.catalog.CATALOG`).
BUILTINS: dict[str, Callable[[], Target]] = {row.name: row.make for row in catalog.rows(catalog.SHADOWED)}


def patch_origin(obj: Any) -> str | None:
    """'torch_npu' (imported), 'torch_npu X source' (:mod:`shadow.npu.torch_npu_source`) or 'reference' when ``obj``
    is one of those legacy patches, else None."""
    # (no import here: this runs at exit too, where importing can cost a signalled job its exit status)
    loaded = getattr(obj, LEGACY_ORIGIN_ATTRIBUTE, None)
    if loaded is not None:
        return loaded
    module = getattr(obj, "__module__", None) or ""
    if module == "torch_npu" or module.startswith("torch_npu."):
        return "torch_npu"
    if module == reference.__name__:
        return "reference"
    return None


#: Where every built-in target's legacy is installed: (its owner, found when asked; the attribute).
PLACES: dict[str, tuple[Callable[[], Any], str]] = {
    row.name: (row.resolve_owner, row.attribute) for row in catalog.rows(catalog.SHADOWED)
}


def active_builtins() -> dict[str, str]:
    """{built-in target name: patch origin} for every built-in whose legacy patch is installed now (and, for the
    targets whose upstream torch keeps under no other name, whose upstream is known: see
    :func:`shadow.core.model.live_targets.upstream`)."""
    active = {}
    for name, (owner, attribute) in PLACES.items():
        origin = patch_origin(getattr(owner(), attribute, None))
        if origin is not None and live_targets.available(name):
            active[name] = origin
    return active
