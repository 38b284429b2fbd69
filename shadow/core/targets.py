"""What can be shadowed: the ``Target`` description and the three built-in targets.

A built-in target's legacy is whatever is installed when the monitor installs (torch_npu's patch on an
NPU host, :mod:`shadow.npu.reference`'s in a rehearsal); its upstream is torch's own implementation.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_iter

from shadow.core import oracle
from shadow.core.observation import BUILTIN_RISKY, BUILTIN_TARGETS, label_text
from shadow.core.oracle import SingleDeviceCall
from shadow.core.tolerance import ToleranceSpec
from shadow.npu import reference
from shadow.npu.patching import LEGACY_ORIGIN_ATTRIBUTE

Signature = Callable[[tuple, dict], str]


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A patch pair: ``owner.attribute`` (legacy) shadowed by ``upstream``.

    ``upstream`` takes the same arguments as the wrapped attribute. ``legacy=None`` means whatever is
    installed on ``owner.attribute`` at install time. ``exact`` demands bitwise equal results.
    ``isolate``: give the upstream run its own RNG state, module buffers and input clones (needed
    whenever a module or RNG is involved; only pure functions should turn it off).
    ``signature`` classifies a call into a small fixed set of code paths; ``risky_signatures`` are
    ``fnmatch`` patterns of the paths where legacy and upstream differ, which a verdict should see.
    ``oracle`` describes a call's single-device equivalent (:mod:`shadow.core.oracle`), to find what legacy and
    upstream share but a single device would not do. ``never_blocks`` tells the calls whose upstream run cannot
    block or wait (no device work, no lock, no Python code: a query of a tensor's metadata in torch's C code): their
    upstream runs on the caller's thread, without the deadline's thread (:mod:`shadow.core.deadline`), whose
    hand-off costs more than such a call's whole upstream side. ``signature_key`` (with ``signature``) is a cheap
    key of a call, hashable, read without running user code (no tensor attribute a mode would see), that stands for
    its signature or for several that are never risky, or None where it cannot be had cheaply: once a key's
    signature has had its first comparisons, calls with that key take the unguided wrapper's unsampled path (their
    signatures counted by systematic sampling), and every other call is classified, so a signature whose key is new
    is compared on its first calls whenever it first appears, however rare (:mod:`shadow.core.coverage`). Without
    one, calls are classified one in ``CLASSIFY_ONE_IN`` once every signature seen has had its first comparisons.
    """

    name: str
    owner: Any
    attribute: str
    upstream: Callable
    legacy: Callable | None = None
    tolerance: ToleranceSpec = None
    exact: bool = False
    isolate: bool = True
    signature: Signature | None = None
    risky_signatures: tuple[str, ...] = ()
    oracle: Callable[[tuple, dict], SingleDeviceCall | None] | None = None
    never_blocks: Callable[[tuple, dict], bool] | None = None
    signature_key: Callable[[tuple, dict], Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or label_text(self.name, 200) != self.name:
            raise ValueError(f"Target.name must be a non-empty string without control characters, got {self.name!r}")
        if not callable(self.upstream):
            raise ValueError(f"Target {self.name!r}: upstream must be callable, got {self.upstream!r}")
        if self.legacy is not None and not callable(self.legacy):
            raise ValueError(f"Target {self.name!r}: legacy must be callable or None, got {self.legacy!r}")
        if self.never_blocks is not None and not callable(self.never_blocks):
            raise ValueError(f"Target {self.name!r}: never_blocks must be callable or None, got {self.never_blocks!r}")
        if self.signature_key is not None and (not callable(self.signature_key) or self.signature is None):
            raise ValueError(
                f"Target {self.name!r}: signature_key must be callable and come with a signature function, got "
                f"{self.signature_key!r}"
            )
        if not hasattr(self.owner, self.attribute) and self.legacy is None:
            raise ValueError(f"Target {self.name!r}: {self.owner!r} has no attribute {self.attribute!r}")

    @property
    def where(self) -> str:
        """``module.Class.attribute`` for messages."""
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        module = getattr(self.owner, "__module__", None)
        prefix = f"{module}.{owner}" if module and module != owner else owner
        return f"{prefix}.{self.attribute}"

    def resolve_legacy(self) -> Callable:
        """The legacy callable: the one given, or what is installed on owner.attribute now."""
        return self.legacy if self.legacy is not None else getattr(self.owner, self.attribute)


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
            kind = "torch_npu_name" if dtype.startswith("torch_npu.") else "npu_name"
    elif isinstance(dtype, type):
        kind = "npu_class" if reference.npu_type_dtype(dtype) is not None else "class"
    else:
        return "other"
    if len(_KINDS) < 1024:
        _KINDS[dtype] = kind
    return kind


def tensor_type_signature(args: tuple, kwargs: dict) -> str:
    """``<destination>/<source>/<blocking|nonblocking>`` of a ``Tensor.type`` call.

    Destination: ``none``, ``dtype``, ``npu_name`` (``'torch.npu.HalfTensor'``), ``torch_npu_name`` (torch_npu's
    own spelling ``'torch_npu.npu.HalfTensor'``, which upstream rejects), ``name`` (any other name),
    ``npu_class``, ``class`` or ``other``. Source: see :func:`_placement`.
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
        risky_signatures=DATA_PARALLEL_RISKY,
        oracle=oracle.data_parallel_call,
    )


BUILTINS: dict[str, Callable[[], Target]] = {
    "parallel_apply": parallel_apply,
    "data_parallel": data_parallel,
    "tensor_type": tensor_type,
}


assert tuple(BUILTINS) == BUILTIN_TARGETS, "the vocabulary's names are the built-in targets'"


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


def active_builtins() -> dict[str, str]:
    """{built-in target name: patch origin} for every built-in whose legacy patch is installed now."""
    active = {}
    for name, factory in BUILTINS.items():
        target = factory()
        origin = patch_origin(getattr(target.owner, target.attribute, None))
        if origin is not None:
            active[name] = origin
    return active
