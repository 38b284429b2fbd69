"""The targets of the patches torch_npu 2.13/2.14 still carry: ``torch.load``, ``torch.save``, ``Tensor.__repr__``,
``UntypedStorage.cpu``, ``Module.to``, ``Module.npu`` and the optimizers' foreach device list (the DataLoader
iterator's ``__init__`` cannot run twice: it is compared as a canary A/B, :mod:`shadow.core.calls.canary.arms`).

``torch.save``'s legacy is torch_npu's ``_save`` and ``_legacy_save``, which torch's ``save`` calls by their module
names: the target wraps ``torch.save`` (legacy: as installed, calling whatever is at those names), and its upstream is
torch's ``save`` run over torch's own two (:func:`_upstream_save`).

Each target's legacy is whatever is installed when the monitor installs (torch_npu's patch, or its source's with
``--legacy-from``); its upstream is torch's own function. torch keeps ``torch.serialization.load`` and
``torch.utils._foreach_utils._get_foreach_kernels_supported_devices`` under their own names; ``Module.to``,
``Module.npu`` and the iterator's ``__init__`` have no other name, so their upstream is what the first legacy patch
replaced (:func:`shadow.npu.patching.upstream_of`), else torch's own function as this module found it on import
(``Module.npu``: the method torch generates for its PrivateUse1 backend, the same body).
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.model import checkpoint, loaded, saving
from shadow.core.model.observation import BUILTIN_RISKY
from shadow.core.model.target import Target
from shadow.core.support import memory
from shadow.npu import catalog
from shadow.npu.emulated import formats
from shadow.npu.patching import LEGACY_ORIGIN_ATTRIBUTE, upstream_of

_DATALOADER = "torch.utils.data.dataloader"


def _optimizer_module() -> Any:
    return importlib.import_module("torch.optim.optimizer")


def _iterator_class() -> type:
    return importlib.import_module(_DATALOADER)._MultiProcessingDataLoaderIter


#: The targets made here, by name: the catalog's rows whose factory is this module's.
LIVE_NAMES = tuple(row.name for row in catalog.CATALOG if row.factory.startswith(f"{__name__}:"))

#: Where each target's legacy is installed: (its owner, found when asked; the attribute).
PLACES: dict[str, tuple[Callable[[], Any], str]] = {
    row.name: (row.resolve_owner, row.attribute) for row in catalog.CATALOG if row.name in LIVE_NAMES
}


def _torchs_own(owner: Any, attribute: str, module: str) -> Callable | None:
    """``owner.attribute`` as it is now, if it is torch's own function (defined in ``module``, no legacy patch)."""
    found = vars(owner).get(attribute)
    if found is None or getattr(found, LEGACY_ORIGIN_ATTRIBUTE, None) is not None:
        return None
    return found if getattr(found, "__module__", None) == module else None


#: torch's own functions as they were when this module was imported (before torch_npu's patches, where npu-shadow
#: is imported first, as the launcher does).
_ON_IMPORT: dict[str, Callable | None] = {
    "tensor_repr": _torchs_own(torch.Tensor, "__repr__", "torch._tensor"),
    "storage_cpu": _torchs_own(torch.storage._StorageBase, "cpu", "torch.storage"),  # (UntypedStorage inherits it)
    "storage_deepcopy": _torchs_own(torch.storage.TypedStorage, "_deepcopy", "torch.storage"),
    "torch.serialization.save": _torchs_own(torch.serialization, "save", "torch.serialization"),
    "torch.serialization._save": _torchs_own(torch.serialization, "_save", "torch.serialization"),
    "torch.serialization._legacy_save": _torchs_own(torch.serialization, "_legacy_save", "torch.serialization"),
    "module_to": _torchs_own(torch.nn.Module, "to", "torch.nn.modules.module"),
    "module_npu": _torchs_own(torch.nn.Module, "npu", "torch.utils.backend_registration"),
    "dataloader_init": _torchs_own(_iterator_class(), "__init__", _DATALOADER),
    "lstm_forward": _torchs_own(torch.nn.LSTM, "forward", "torch.nn.modules.rnn"),
}


def _generated_module_npu(self: torch.nn.Module, device: int | torch.device | None = None) -> torch.nn.Module:
    """torch's ``Module.<backend>`` for its PrivateUse1 backend
    (``torch.utils.backend_registration._generate_module_methods_for_privateuse1_backend``): the same body, for a
    host where torch_npu replaced the generated method before npu-shadow could see it."""
    backend = torch._C._get_privateuse1_backend_name()
    return self._apply(lambda t: getattr(t, backend)(device))


def upstream(name: str) -> Callable | None:
    """torch's own function for a live target, or None where it cannot be found (torch_npu imported before
    npu-shadow replaced ``Module.to``: the target is then not installed, and doctor says why)."""
    if name == "torch_load":
        return importlib.import_module("torch.serialization").load
    if name == "foreach_devices":
        return importlib.import_module("torch.utils._foreach_utils")._get_foreach_kernels_supported_devices
    if name == "torch_save":
        return _upstream_save if all(_serialization_own(n) for n in ("save", "_save", "_legacy_save")) else None
    owner, attribute = {**PLACES, **ARM_PLACES}[name]
    found = upstream_of(owner(), attribute) or _ON_IMPORT.get(name)
    if found is None and name == "module_npu":
        return _generated_module_npu
    return found


def available(name: str) -> bool:
    """Whether a target's upstream is known here (a live target's may not be; every other one's is)."""
    return name not in LIVE_NAMES or upstream(name) is not None


# --------------------------------------------------------------------------- torch.load


def _source_kind(f: Any) -> str:
    return "path" if checkpoint.is_path(f) else "buffer"


def checkpoint_format(f: Any) -> str:
    """``safetensors`` (a path ending so), ``zip`` (torch's format since 1.6), ``legacy`` (the older pickle
    stream), ``special`` (a path that is not a regular file: a FIFO or a device is never opened) or ``unknown``, from
    the first bytes (a buffer is read and put back where it was)."""
    if checkpoint.is_path(f):
        if os.fsdecode(os.fspath(f)).endswith(".safetensors"):
            return "safetensors"
        regular = checkpoint.regular_file(f)
        if not regular:
            return "special" if regular is False else "unknown"
        try:
            with open(f, "rb") as opened:
                head = opened.read(4)
        except OSError:
            return "unknown"
    else:
        try:
            where = f.tell()
            head = f.read(4)
            f.seek(where)
        except Exception:  # (a stream that cannot tell or seek)
            return "unknown"
    return "zip" if head[:4] == b"PK\x03\x04" else "legacy" if head else "unknown"


def _map_location_kind(location: Any) -> str:
    if location is None:
        return "none"
    if isinstance(location, (str, torch.device)):
        try:
            kind = torch.device(location).type
        except RuntimeError:
            return "name"
        return "cpu" if kind == "cpu" else "device"
    if isinstance(location, dict):
        return "dict"
    return "callable" if callable(location) else "other"


#: The values torch reads as true in ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` / ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``.
_TRUE = ("1", "y", "yes", "true")


def _forcing() -> str:
    """How the weights-only variables are set: ``none``, ``set`` (as both implementations read it) or
    ``mixed-case`` (true only once lower-cased: upstream reads it, torch_npu's copy does not)."""
    found = "none"
    for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        value = os.environ.get(name, "0")
        if value in _TRUE:
            found = "set" if found == "none" else found
        elif value.lower() in _TRUE:
            found = "mixed-case"
    return found


def torch_load_signature(args: tuple, kwargs: dict) -> str:
    """``<path|buffer>/<format>/map=<kind>/wo=<default|true|false>[/mmap]/env=<none|set|mixed-case>`` of a
    ``torch.load`` call: where the checkpoint comes from and its format (:func:`checkpoint_format`), the kind of
    ``map_location``, ``weights_only``, ``mmap`` where it is on, and the weights-only variables (:func:`_forcing`)."""
    f = args[0] if args else kwargs.get("f")
    location = args[1] if len(args) > 1 else kwargs.get("map_location")
    weights_only = kwargs.get("weights_only")
    mmap = "/mmap" if kwargs.get("mmap") else ""
    wo = "default" if weights_only is None else str(bool(weights_only)).lower()
    return f"{_source_kind(f)}/{checkpoint_format(f)}/map={_map_location_kind(location)}/wo={wo}{mmap}/env={_forcing()}"


def loaded_state(result: Any, args: tuple, kwargs: dict) -> Any:
    """What a load gave, as the comparator reads it (:func:`shadow.core.model.loaded.comparable`): a whole module by
    its class, parameters, buffers and attributes, an object by its fields, never by identity."""
    return loaded.comparable(result)


def torch_load(trusted: bool = False) -> Target:
    """``torch.load`` against ``torch.serialization.load`` (torch_npu's is a stale copy of an older upstream).

    The shadow load reads the checkpoint the primary read, once, from a buffer of its own
    (:mod:`shadow.core.model.checkpoint`); ``trusted`` declares the job's checkpoints safe to unpickle twice (a whole
    model, a ``Namespace``, a callable ``map_location``: skipped otherwise)."""
    return Target(
        name="torch_load",
        owner=torch,
        attribute="load",
        upstream=upstream("torch_load"),
        exact=True,
        signature=torch_load_signature,
        signature_pure=True,
        risky_signatures=BUILTIN_RISKY["torch_load"],
        run_if=functools.partial(checkpoint.refusal, trusted=trusted),
        replay=functools.partial(checkpoint.replay, trusted=trusted),
        snapshot=loaded_state,
    )


# --------------------------------------------------------------------------- torch.save


def _serialization_own(name: str) -> Callable | None:
    """torch's own ``torch.serialization.<name>``: what the first legacy patch replaced, else what was there when
    this module was imported."""
    return upstream_of(torch.serialization, name) or _ON_IMPORT[f"torch.serialization.{name}"]


def _upstream_save(*args: Any, **kwargs: Any) -> Any:
    """``torch.save`` as torch has it: torch's ``save`` over torch's own ``_save`` and ``_legacy_save`` (its module's
    globals copied, those two replaced: the module itself, which the job's other threads use, is left alone)."""
    save = _serialization_own("save")
    namespace = dict(vars(torch.serialization), _save=_serialization_own("_save"))
    namespace["_legacy_save"] = _serialization_own("_legacy_save")
    function = types.FunctionType(save.__code__, namespace, save.__name__, save.__defaults__, save.__closure__)
    function.__kwdefaults__ = save.__kwdefaults__
    return function(*args, **kwargs)


def torch_save_signature(args: tuple, kwargs: dict) -> str:
    """``dest=<path|stream>/format=<zip|legacy>/tensors=<none|host|device|mixed|objects>/npu_formats=<nd|internal>``
    of a ``torch.save`` call: where it writes, in which format, where the tensors it saves are (``objects``: it saves
    more than tensors and plain values in containers), and whether an npu tensor among them is in an internal format
    (where torch_npu sizes its storage otherwise than torch)."""
    dest = "path" if checkpoint.is_path(saving.destination(args, kwargs)) else "stream"
    kind = "zip" if saving.zipped(args, kwargs) else "legacy"
    tensors = saving.tensors_of(saving.saved_object(args, kwargs))
    if tensors is None:
        where = "objects"
    else:
        devices = {t.device.type == "cpu" for t in tensors}
        where = "none" if not devices else "mixed" if len(devices) == 2 else "host" if True in devices else "device"
    internal = any(npu_format(t) not in (None, formats.Format.ND) for t in tensors or ())
    return f"dest={dest}/format={kind}/tensors={where}/npu_formats={'internal' if internal else 'nd'}"


def torch_save(trusted: bool = False) -> Target:
    """``torch.save`` against torch's own ``_save``/``_legacy_save`` (:func:`_upstream_save`): the shadow run saves
    into a buffer of its own, and the two outputs are compared as data (:mod:`shadow.core.model.saving`); ``trusted``
    lets objects that are more than tensors in containers be pickled twice."""
    return Target(
        name="torch_save",
        owner=torch,
        attribute="save",
        upstream=upstream("torch_save") or _missing("torch_save"),
        isolate=False,
        reads_only=True,
        signature=torch_save_signature,
        signature_pure=True,
        risky_signatures=BUILTIN_RISKY["torch_save"],
        run_if=functools.partial(saving.refusal, trusted=trusted),
        replay=saving.replay,
        snapshot=saving.written,
        compare=functools.partial(saving.difference, trusted=trusted),
        clean=saving.kept,
        environmental=saving.environment_failure,
    )


# --------------------------------------------------------------------------- Tensor.__repr__


def npu_format(tensor: torch.Tensor) -> int | None:
    """An npu tensor's internal format (torch_npu's ``get_npu_format``: the installed torch_npu's, else the emulated
    npu's), None for a tensor elsewhere or where it cannot be read."""
    if tensor.device.type != "npu":
        return None
    torch_npu = sys.modules.get("torch_npu")
    get = getattr(torch_npu, "get_npu_format", None) or formats.get
    try:
        return int(get(tensor))
    except Exception:  # (a FakeTensor has no NPU storage: torch_npu's raises)
        return None


def tensor_repr_signature(args: tuple, kwargs: dict) -> str:
    """``device=<type>/format=<nd|internal>/grad=<none|leaf|graph>/contents=<given|none>`` of a ``Tensor.__repr__``
    call: torch_npu 2.13/2.14 print an npu tensor in an internal format through its host copy."""
    tensor = args[0]
    found = npu_format(tensor)
    layout = "nd" if found is None or found == formats.Format.ND else "internal"
    grad = "graph" if tensor.grad_fn is not None else "leaf" if tensor.requires_grad else "none"
    contents = "none" if kwargs.get("tensor_contents") is None else "given"
    return f"device={tensor.device.type}/format={layout}/grad={grad}/contents={contents}"


def tensor_repr() -> Target:
    """``Tensor.__repr__`` against torch's: the two strings, compared exactly (a repr reads the tensor and changes
    nothing: no isolation)."""
    return Target(
        name="tensor_repr",
        owner=torch.Tensor,
        attribute="__repr__",
        upstream=upstream("tensor_repr") or _missing("tensor_repr"),
        exact=True,
        isolate=False,
        reads_only=True,  # (under torch's no_grad: its grad_fn is printed, never extended)
        signature=tensor_repr_signature,
        signature_pure=True,
        risky_signatures=BUILTIN_RISKY["tensor_repr"],
    )


# --------------------------------------------------------------------------- UntypedStorage.cpu


def storage_format(storage: Any) -> str:
    """``internal`` for an npu storage in an internal format (read as torch_npu reads it, through a tensor of its
    descriptor, where torch_npu is imported), else ``nd``."""
    torch_npu = sys.modules.get("torch_npu")
    construct = getattr(getattr(torch_npu, "_C", None), "_tensor_construct_from_storage", None)
    if storage.device.type != "npu" or construct is None:
        return "nd"
    try:
        found = npu_format(construct(storage))
    except Exception:  # (a storage torch_npu cannot describe: read as torch's)
        return "nd"
    return "nd" if found in (None, formats.Format.ND) else "internal"


def storage_cpu_signature(args: tuple, kwargs: dict) -> str:
    """``device=<type>/format=<nd|internal>`` of an ``UntypedStorage.cpu`` call (a host storage is returned as it
    is; an internal-format one is where torch_npu's copy is converted and torch's is not)."""
    return f"device={args[0].device.type}/format={storage_format(args[0])}"


def storage_cpu_run_if(args: tuple, kwargs: dict) -> None:
    """Every copy can run twice: the shadow run's host copy must fit (raises InsufficientMemory)."""
    storage = args[0]
    if storage.device.type != "cpu":
        memory.check_host_fits(storage.nbytes(), "a second host copy of the storage")


def _storage_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_difference(legacy: Any, upstream: Any) -> str | None:
    """None where both copies are storages of one kind, dtype (a typed one's), device and bytes, else how they
    differ."""
    if type(legacy) is not type(upstream) or not isinstance(legacy, (torch.UntypedStorage, torch.TypedStorage)):
        return f"legacy's copy is a {type(legacy).__name__}, upstream's a {type(upstream).__name__}"
    if isinstance(legacy, torch.TypedStorage):  # (read without its own properties: they warn it is deprecated)
        if legacy.dtype != upstream.dtype:
            return f"legacy's copy holds {legacy.dtype}, upstream's {upstream.dtype}"
        legacy, upstream = legacy._untyped_storage, upstream._untyped_storage
    if (legacy.device, legacy.nbytes()) != (upstream.device, upstream.nbytes()):
        return (
            f"legacy's copy is {legacy.nbytes()} bytes on {legacy.device}, "
            f"upstream's {upstream.nbytes()} on {upstream.device}"
        )
    if not torch.equal(_storage_bytes(legacy), _storage_bytes(upstream)):
        return "the copies hold different bytes"
    return None


def storage_cpu() -> Target:
    """``UntypedStorage.cpu`` against torch's: the host copies compared byte for byte."""
    return Target(
        name="storage_cpu",
        owner=torch.storage.UntypedStorage,
        attribute="cpu",
        upstream=upstream("storage_cpu") or _missing("storage_cpu"),
        isolate=False,
        signature=storage_cpu_signature,
        signature_pure=True,
        risky_signatures=BUILTIN_RISKY["storage_cpu"],
        run_if=storage_cpu_run_if,
        compare=storage_difference,
    )


def _deepcopy_memo(args: tuple, kwargs: dict) -> dict:
    return args[1] if len(args) > 1 else kwargs["memo"]


def storage_deepcopy_run_if(args: tuple, kwargs: dict) -> str | None:
    """A storage copied earlier in the same ``deepcopy`` is refused (the shadow run would find legacy's copy in the
    memo, of another kind than upstream leaves there); any other copy must fit on its device (raises
    InsufficientMemory)."""
    storage = args[0]._untyped_storage  # (a TypedStorage's own properties warn that it is deprecated)
    if storage._cdata in _deepcopy_memo(args, kwargs).get("torch", {}):
        return "the storage was copied earlier in this deepcopy: the memo holds legacy's copy"
    memory.check_device_fits(storage.device, storage.nbytes(), "a second copy of the storage")
    return None


def storage_deepcopy_replay(args: tuple, kwargs: dict) -> Callable[[], tuple[tuple, dict]]:
    """Taken before the primary copies: the shadow run gets the memo as it is now, in a dict of its own (the
    caller's keeps legacy's entry)."""
    memo = dict(_deepcopy_memo(args, kwargs))
    if "torch" in memo:
        memo["torch"] = dict(memo["torch"])
    return lambda: ((args[0], memo), {})


def storage_deepcopy() -> Target:
    """``TypedStorage._deepcopy`` (``copy.deepcopy`` of a tensor on an accelerator) against torch's: the copies
    compared as storages (dtype, device and bytes); the memo entry each side leaves is its own (legacy keeps the
    typed copy, torch the untyped one), which only a later call of the same deepcopy reads."""
    return Target(
        name="storage_deepcopy",
        owner=torch.storage.TypedStorage,
        attribute="_deepcopy",
        upstream=upstream("storage_deepcopy") or _missing("storage_deepcopy"),
        isolate=False,
        signature=lambda args, kwargs: storage_cpu_signature((args[0]._untyped_storage,), {}),
        risky_signatures=BUILTIN_RISKY["storage_deepcopy"],
        signature_pure=True,
        run_if=storage_deepcopy_run_if,
        replay=storage_deepcopy_replay,
        compare=storage_difference,
        reaches=lambda args, kwargs: args[:1],  # (the memo: every object copied so far, half-built ones too)
    )


# --------------------------------------------------------------------------- Module.to, Module.npu


def module_state(result: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """What ``Module.to``/``Module.npu`` leave: every parameter and buffer of the module (its device, dtype,
    strides and values, compared as tensors), and on a real NPU each one's internal format
    (``torch_npu.get_npu_format``)."""
    module = args[0] if args else kwargs.get("self")
    state: dict[str, Any] = {}
    with torch.no_grad():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            state[name] = tensor.detach()
    torch_npu = sys.modules.get("torch_npu")
    get_npu_format = getattr(torch_npu, "get_npu_format", None)
    if get_npu_format is not None:
        for name, tensor in list(state.items()):
            if tensor.device.type == "npu":
                state[f"{name} (npu format)"] = int(get_npu_format(tensor))
    return state


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    found = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return list(found.values())


def _fits(module: torch.nn.Module, device: Any, dtype: torch.dtype | None) -> None:
    """Raise InsufficientMemory unless the shadow run's copy of the module's tensors fits where it is made: on
    ``device`` (each tensor's own where None), each floating tensor in ``dtype`` where one is given (a dtype-only
    ``.to(torch.float64)`` makes copies twice the size of the tensors it has now)."""
    needed: collections.Counter[torch.device] = collections.Counter()
    for t in _module_tensors(module):
        converts = dtype is not None and (t.is_floating_point() or t.is_complex())
        itemsize = dtype.itemsize if converts else t.element_size()
        needed[torch.device(device) if device is not None else t.device] += t.numel() * itemsize
    for where, size in needed.items():
        memory.check_device_fits(where, size, "a second copy of the module's tensors")


def module_to_run_if(args: tuple, kwargs: dict) -> None:
    """Every ``Module.to`` can run twice: the shadow run's copy must fit where it goes (raises InsufficientMemory)."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    _fits(args[0], device, dtype)


def module_npu_run_if(args: tuple, kwargs: dict) -> None:
    """As :func:`module_to_run_if`, the copy on the npu (the current one where no index is given)."""
    device = args[1] if len(args) > 1 else kwargs.get("device")
    index = device if isinstance(device, int) else getattr(torch.device(device), "index", None) if device else None
    _fits(args[0], torch.device(torch._C._get_privateuse1_backend_name(), index), None)


def _device_kind(device: Any) -> str:
    if device is None:
        return "none"
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        if device.index is None or device.index == torch.accelerator.current_device_index():
            return "current"
        return "noncurrent"
    return device.type


def module_to_signature(args: tuple, kwargs: dict) -> str:
    """``device=<none|cpu|current|noncurrent|...>/dtype=<none|floating|complex|other>/format=<memory format>`` of
    a ``Module.to`` call (legacy converts the memory format of 4-D tensors only: ``channels_last_3d`` is where
    it differs)."""
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    kind = (
        "none"
        if dtype is None
        else "floating"
        if dtype.is_floating_point
        else "complex"
        if dtype.is_complex
        else ("other")
    )
    layout = "none" if memory_format is None else str(memory_format).removeprefix("torch.")
    return f"device={_device_kind(device)}/dtype={kind}/format={layout}"


def _module_move(name: str, attribute: str, signature: Callable, run_if: Callable) -> Target:
    """A target of a method that moves or converts a module in place: compared per parameter and buffer."""
    return Target(
        name=name,
        owner=torch.nn.Module,
        attribute=attribute,
        upstream=upstream(name) or _missing(name),
        exact=True,
        signature=signature,
        signature_pure=True,
        risky_signatures=BUILTIN_RISKY[name],
        run_if=run_if,
        snapshot=module_state,
    )


def module_to() -> Target:
    """``Module.to`` (with torch_npu's ``cast_weight``) against torch's: in place, compared per parameter and
    buffer."""
    return _module_move("module_to", "to", module_to_signature, module_to_run_if)


def module_npu_signature(args: tuple, kwargs: dict) -> str:
    """``device=<none|int|str|device>`` of a ``Module.npu`` call: legacy builds ``torch.device("npu", device)``,
    which only an int (or None) survives."""
    device = args[1] if len(args) > 1 else kwargs.get("device")
    for kind, classes in (("none", type(None)), ("int", int), ("str", str), ("device", torch.device)):
        if isinstance(device, classes):
            return f"device={kind}"
    return "device=other"


def module_npu() -> Target:
    """``Module.npu`` against torch's generated method for its PrivateUse1 backend: in place, as ``module_to``."""
    return _module_move("module_npu", "npu", module_npu_signature, module_npu_run_if)


#: Where the canary A/B targets' legacy is installed (:mod:`shadow.core.calls.canary.arms`).
ARM_PLACES: dict[str, tuple[Callable[[], Any], str]] = {
    row.name: (row.resolve_owner, row.attribute) for row in catalog.rows(catalog.CANARY)
}


def _missing(name: str) -> Callable:
    def unknown(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"npu-shadow: torch's own {name} is unknown here (torch_npu was imported first)")

    return unknown


# --------------------------------------------------------------------------- the optimizers' foreach devices


def foreach_difference(legacy: Any, upstream: Any) -> str | None:
    """What upstream's device list turns on (or off) for this host's accelerator, or None where both treat it
    alike: an entry for a device type the host does not have (upstream's ``mtia``) changes nothing here."""
    accelerator = torch.accelerator.current_accelerator()
    here = accelerator.type if accelerator is not None else "cpu"
    legacy_on, upstream_on = here in legacy, here in upstream
    if legacy_on == upstream_on:
        return None
    if upstream_on:
        return (
            f"upstream lists {here}, legacy does not: deleting the patch turns the foreach (multi-tensor) optimizer "
            f"kernels on for {here} (legacy {sorted(legacy)}, upstream {sorted(upstream)})"
        )
    return f"legacy lists {here}, upstream does not: deleting the patch turns the foreach kernels off for {here}"


def foreach_devices() -> Target:
    """``torch.optim.optimizer._get_foreach_kernels_supported_devices`` against torch's: which device types the
    optimizers run foreach kernels on."""
    return Target(
        name="foreach_devices",
        owner=_optimizer_module(),
        attribute="_get_foreach_kernels_supported_devices",
        upstream=upstream("foreach_devices"),
        isolate=False,
        signature=lambda args, kwargs: "devices",
        signature_pure=True,
        compare=foreach_difference,
    )


# --------------------------------------------------------------------------- LSTM.forward (torch_npu 2.12)


def lstm_signature(args: tuple, kwargs: dict) -> str:
    """``packed=<yes|no>/batched=<yes|no>/hx=<given|none>/bidirectional=<yes|no>`` of an ``LSTM.forward`` call
    (torch_npu 2.12's moves a packed sequence's ``batch_sizes`` to the device and reshapes the output)."""
    module = args[0]
    given = args[1] if len(args) > 1 else kwargs.get("input")
    hx = args[2] if len(args) > 2 else kwargs.get("hx")
    packed = isinstance(given, torch.nn.utils.rnn.PackedSequence)
    batched = packed or getattr(given, "ndim", 3) == 3
    return (
        f"packed={'yes' if packed else 'no'}/batched={'yes' if batched else 'no'}"
        f"/hx={'none' if hx is None else 'given'}/bidirectional={'yes' if module.bidirectional else 'no'}"
    )


def lstm_forward() -> Target:
    """``nn.LSTM.forward`` (torch_npu 2.12's patch; 2.13 removed it) against torch's: a module forward, isolated and
    compared within tolerance like DataParallel's, its gradients too where ``--backward-rate`` asks."""
    return Target(
        name="lstm_forward",
        owner=torch.nn.LSTM,
        attribute="forward",
        upstream=upstream("lstm_forward") or _missing("lstm_forward"),
        signature=lstm_signature,
        signature_pure=True,
        risky_signatures=BUILTIN_RISKY["lstm_forward"],
    )
