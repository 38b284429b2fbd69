"""The built-in targets, one row each: what torch_npu patches, where, in which of its files, how it is compared, and
what makes the target's factory (no torch import: the analysis tools read it too).

Everything else about the built-ins is derived from :data:`CATALOG`: the vocabulary's names
(:data:`shadow.core.model.observation.BUILTIN_TARGETS`, ``ARM_TARGETS``, ``BUILTIN_RISKY``), where each legacy is
installed (``shadow.core.model.targets.PLACES``), the factories (``shadow.core.model.targets.BUILTINS``), the patches a
torch_npu wheel is read for (:data:`shadow.npu.torch_npu_source.PATCHES`), the census's "shadowed by", doctor's list
and the table of docs/targets.md (:func:`docs_table`). Adding a target is one row here and one factory.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

#: A row's kinds: compared on sampled calls against an isolated second run, or a canary A/B (never run twice).
SHADOWED, CANARY = "shadowed", "canary"

#: What a row may need of the host before its upstream can run (doctor says so): an accelerator, or torch's
#: generated ``Module.npu`` (an npu backend registered).
NEEDS = ("", "accelerator", "npu_backend")

_MODULE = "torch_npu/utils/_module.py"
_CAST_WEIGHT = (("cast_weight", "torch.nn.Module", "cast_weight"),)


@dataclasses.dataclass(frozen=True)
class Row:
    """One built-in target.

    Args:
        name: the target's name (labels, settings, journals).
        owner: the dotted path of what torch_npu patches (a class or a module of torch).
        attribute: the patched attribute.
        file: the torch_npu source file that installs the patch.
        definition: the definition there that is installed.
        factory: ``module:function`` that makes the target (a canary's: its arms' installer).
        kind: :data:`SHADOWED` or :data:`CANARY`.
        risky: the patterns of the signatures where legacy and upstream are known to differ.
        helpers: (definition, owner, attribute) installed beside the patch (``Module.cast_weight``).
        needs: what the host must have for upstream to run (:data:`NEEDS`).
        wrapped, upstream, compared: the docs table's words for what is wrapped, its upstream, how it is compared.
    """

    name: str
    owner: str
    attribute: str
    file: str
    definition: str
    factory: str
    kind: str = SHADOWED
    risky: tuple[str, ...] = ()
    helpers: tuple[tuple[str, str, str], ...] = ()
    needs: str = ""
    wrapped: str = ""
    upstream: str = "torch's"
    compared: str = "exact"

    @property
    def docs(self) -> str:
        """The docs anchor of its row in docs/targets.md."""
        return f"docs/targets.md#{self.name}"

    def resolve_owner(self) -> Any:
        """The patched owner (a class or module of torch), imported when asked."""
        return resolve(self.owner)

    def make(self) -> Any:
        """What its factory makes (a shadowed target's :class:`~shadow.core.model.target.Target`)."""
        return self.factory_function()()

    def factory_function(self) -> Callable[..., Any]:
        """Its factory, imported when asked."""
        module, _, function = self.factory.partition(":")
        return getattr(importlib.import_module(module), function)


def resolve(dotted: str) -> Any:
    """The object at a dotted path (a module, or an attribute of one), imported when asked."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for name in parts[end:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(f"no module along {dotted!r}")


CATALOG: tuple[Row, ...] = (
    Row(
        "parallel_apply", "torch.nn.DataParallel", "parallel_apply", _MODULE, "npu_parallel_apply",
        "shadow.core.model.targets:parallel_apply", risky=("replicas=1/*", "*/autocast=on"), needs="accelerator",
        wrapped="`DataParallel.parallel_apply`",
        upstream="`torch.nn.parallel.parallel_apply.parallel_apply(replicas, inputs, kwargs, "
        "self.device_ids[:len(replicas)])`",
        compared="tolerance",
    ),
    Row(
        "data_parallel", "torch.nn.parallel", "data_parallel", _MODULE, "npu_data_parallel",
        "shadow.core.model.targets:data_parallel", risky=("replicas=1/*", "*/autocast=on"), needs="accelerator",
        wrapped="`torch.nn.parallel.data_parallel`", upstream="the submodule's `data_parallel`", compared="tolerance",
    ),
    Row(
        "tensor_type", "torch.Tensor", "type", "torch_npu/utils/tensor_methods.py", "_npu_type",
        "shadow.core.model.targets:tensor_type",
        risky=(
            "npu_name/noncurrent/*", "npu_class/noncurrent/*", "torch_npu_name/*", "npu_name_elsewhere/*",
            "npu_class_elsewhere/*",
        ),
        wrapped="`torch.Tensor.type`", upstream="`torch._C.TensorBase.type`",
    ),
    # torch_npu 2.13/2.14: a .safetensors path, the weights-only variables in mixed case
    Row(
        "torch_load", "torch", "load", "torch_npu/utils/serialization.py", "load",
        "shadow.core.model.live_targets:torch_load", risky=("path/safetensors/*", "*/env=mixed-case"),
        wrapped="`torch.load`", upstream="`torch.serialization.load`",
    ),
    Row(
        "module_to", "torch.nn.Module", "to", _MODULE, "to", "shadow.core.model.live_targets:module_to",
        risky=("*/format=channels_last_3d",), helpers=_CAST_WEIGHT,
        wrapped="`torch.nn.Module.to` (with `cast_weight`)", upstream="torch's `Module.to`",
        compared="exact, per parameter and buffer",
    ),
    # a device given as a string or torch.device
    Row(
        "module_npu", "torch.nn.Module", "npu", _MODULE, "npu", "shadow.core.model.live_targets:module_npu",
        risky=("device=str", "device=device"), helpers=_CAST_WEIGHT, needs="npu_backend",
        wrapped="`torch.nn.Module.npu` (with `cast_weight`)", upstream="torch's generated `Module.npu`",
        compared="exact, per parameter and buffer",
    ),
    Row(
        "foreach_devices", "torch.optim.optimizer", "_get_foreach_kernels_supported_devices",
        "torch_npu/utils/_optim.py", "patch_supported_devices", "shadow.core.model.live_targets:foreach_devices",
        wrapped="`torch.optim.optimizer._get_foreach_kernels_supported_devices`",
        upstream="`torch.utils._foreach_utils`'s", compared="its own (`compare=`)",
    ),
    # torch_npu 2.12 (removed in 2.13): a packed sequence's batch_sizes moved to the device
    Row(
        "lstm_forward", "torch.nn.LSTM", "forward", _MODULE, "_lstm_forward",
        "shadow.core.model.live_targets:lstm_forward", risky=("packed=yes/*",),
        wrapped="`torch.nn.LSTM.forward` (torch_npu 2.8 to 2.12)", compared="tolerance, gradients too",
    ),
    # torch_npu 2.13/2.14: an internal-format npu tensor printed through its host copy (no device, no grad)
    Row(
        "tensor_repr", "torch.Tensor", "__repr__", "torch_npu/_init/patches/npu_patches.py",
        "apply_npu_internal_format_repr_patch._npu_internal_format_repr", "shadow.core.model.live_targets:tensor_repr",
        risky=("*/format=internal/*",), wrapped="`torch.Tensor.__repr__`", upstream="`torch._tensor.Tensor.__repr__`",
        compared="exact (the strings)",
    ),
    # torch_npu 2.13/2.14: an internal-format storage is sized, copied and converted through its NPU descriptor
    Row(
        "torch_save", "torch.serialization", "_save", "torch_npu/utils/serialization.py", "_npu_save",
        "shadow.core.model.live_targets:torch_save", risky=("*/npu_formats=internal",),
        helpers=(("_add_serialization_methods._npu_legacy_save", "torch.serialization", "_legacy_save"),),
        wrapped="`torch.save` (torch_npu's `_save` and `_legacy_save` under it)",
        upstream="`torch.save` with torch's `_save` and `_legacy_save`, into a buffer of its own",
        compared="what the two files load back to; byte layout apart (`close`)",
    ),
    Row(
        "storage_cpu", "torch.storage.UntypedStorage", "cpu", "torch_npu/utils/storage.py", "_cpu",
        "shadow.core.model.live_targets:storage_cpu", risky=("*/format=internal",),
        wrapped="`torch.UntypedStorage.cpu`", upstream="`torch.storage.UntypedStorage.cpu`",
        compared="exact (device, size and bytes)",
    ),
    Row(
        "storage_deepcopy", "torch.storage.TypedStorage", "_deepcopy", "torch_npu/utils/storage.py", "_deepcopy",
        "shadow.core.model.live_targets:storage_deepcopy", risky=("*/format=internal",),
        wrapped="`torch.TypedStorage._deepcopy` (`copy.deepcopy`)",
        upstream="`torch.storage.TypedStorage._deepcopy`", compared="exact (dtype, device, size and bytes)",
    ),
    Row(
        "dataloader_init", "torch.utils.data.dataloader._MultiProcessingDataLoaderIter", "__init__", _MODULE,
        "_mpdl_iter_init", "shadow.core.calls.canary.arms:IteratorArms", kind=CANARY,
        wrapped="`_MultiProcessingDataLoaderIter.__init__`", compared="a canary A/B, never shadowed",
    ),
)  # fmt: skip


def rows(kind: str | None = None) -> tuple[Row, ...]:
    """The catalog's rows (of one ``kind``), in its order."""
    return tuple(row for row in CATALOG if kind is None or row.kind == kind)


def row(name: str) -> Row:
    """The row of the built-in target ``name`` (KeyError naming the built-ins where there is none)."""
    for found in CATALOG:
        if found.name == name:
            return found
    raise KeyError(f"{name!r} is no built-in target; built-ins: {[r.name for r in CATALOG]}")


def shadowing(owner: str, attribute: str) -> str | None:
    """The built-in target that wraps ``owner.attribute`` (a dotted path), or None."""
    return next((r.name for r in CATALOG if (r.owner, r.attribute) == (owner, attribute)), None)


def docs_table() -> str:
    """The table of docs/targets.md, one line per row."""
    lines = [
        "| name | wrapped | torch_npu's patch | upstream | compared | risky signatures |",
        "|---|---|---|---|---|---|",
    ]
    for r in CATALOG:
        risky = ", ".join(f"`{pattern}`" for pattern in r.risky)
        lines.append(
            f'| <a id="{r.name}"></a>`{r.name}` | {r.wrapped} | `{r.file}`: `{r.definition}` | {r.upstream} | '
            f"{r.compared} | {risky} |"
        )
    return "\n".join(lines) + "\n"
