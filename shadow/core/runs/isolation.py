"""Keeping the upstream run from changing anything the training job can see, while it runs the same call.

Only sampled calls of targets that ask for it pay for this. Before legacy runs we take the RNG states and clones
of every module buffer reachable from the arguments; after it, clones of the tensor arguments (which legacy must
have left as they were: see :class:`Isolation`). The upstream run then starts from exactly what legacy started
from, in the caller's grad mode, on tensors whose autograd graph never reaches the caller's: cloned arguments and
buffers, and parameters as new leaves over the same storage (``detach``: no copy), each with the ``requires_grad``
of the tensor it stands for. The module's own dictionaries and attributes hold these while upstream runs, so the
originals are never written and their autograd version counters never move. Afterwards every generator, module
attribute and hook registry is put back where legacy left it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_iter

from shadow.core.support import memory, trees

_PLAIN_TORCH_FUNCTION = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def is_hooked_subclass(leaf: Any) -> bool:
    """A tensor subclass with its own __torch_function__ or __torch_dispatch__ (nn.Parameter has neither)."""
    cls = type(leaf)
    if cls is torch.Tensor or not isinstance(leaf, torch.Tensor):
        return False
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    return function not in _PLAIN_TORCH_FUNCTION or cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _accelerator_rng_module() -> Any | None:
    """The device module (torch.cuda, torch.npu, ...) whose generators may have been used, if any."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is None:
        return None
    module = torch.get_device_module(accelerator.type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is not None and not is_initialized():
        return None  # no generator of this device was ever used; don't initialise the device for it
    return module


class RngSnapshot:
    """The state of every generator a forward can draw from: Python, NumPy, torch CPU, accelerators."""

    __slots__ = ("_accelerator", "_cpu", "_devices", "_numpy", "_numpy_written", "_python")

    def __init__(self) -> None:
        self._python = random.getstate()
        self._numpy = np.random.get_state()
        self._numpy_written: tuple | None = None
        self._cpu = torch.get_rng_state()
        self._accelerator = _accelerator_rng_module()
        self._devices = None
        if self._accelerator is not None:
            if hasattr(self._accelerator, "get_rng_state_all"):
                self._devices = self._accelerator.get_rng_state_all()
            else:  # a device module with the per-device API only
                count = torch.accelerator.device_count()
                self._devices = [self._accelerator.get_rng_state(i) for i in range(count)]

    def same_as(self, other: RngSnapshot) -> bool:
        """Whether every generator is where it was in ``other`` (nothing drew from one in between)."""
        devices = self._devices or []
        return (
            self._python == other._python
            and all(_same(a, b) for a, b in zip(self._numpy, other._numpy))
            and torch.equal(self._cpu, other._cpu)
            and self._accelerator is other._accelerator
            and len(devices) == len(other._devices or [])
            and all(torch.equal(a, b) for a, b in zip(devices, other._devices or []))
        )

    def restore(self) -> None:
        random.setstate(self._python)
        if self._numpy_written is None:
            # (the same state with its key as a list of ints: NumPy's setter reads the key one element at a time,
            # and a list's element costs it a twentieth of an array's; a call restores one snapshot once per run)
            name, key, *rest = self._numpy
            self._numpy_written = (name, key.tolist(), *rest)
        np.random.set_state(self._numpy_written)
        torch.set_rng_state(self._cpu)
        if self._accelerator is None:
            return
        if hasattr(self._accelerator, "set_rng_state_all"):
            self._accelerator.set_rng_state_all(self._devices)
        else:
            for index, state in enumerate(self._devices):
                self._accelerator.set_rng_state(state, index)


def _same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else a == b


class SideEffects(Exception):
    """A function that must leave the generators and the grad mode as it found them did not (they are put back)."""


def call_without_side_effects(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, checked to leave every generator (:class:`RngSnapshot`) and the grad mode as it found
    them: where it did not, they are put back and :class:`SideEffects` is raised (a user's signature function that
    draws a random number would otherwise shift the job's random stream)."""
    with _unseen():
        before, grad = RngSnapshot(), torch.is_grad_enabled()
    value = function(*args)
    with _unseen():
        if torch.is_grad_enabled() == grad and RngSnapshot().same_as(before):
            return value
        before.restore()
        torch.set_grad_enabled(grad)
    name = getattr(function, "__qualname__", None) or repr(function)
    raise SideEffects(f"{name:.80} changed the random generators or the grad mode")


@contextlib.contextmanager
def _unseen() -> Iterator[None]:
    """This thread's torch function and dispatch modes set aside: the job's modes never see the check's own ops."""
    with torch._C.DisableTorchFunction():
        if not torch._C._len_torch_dispatch_stack():
            yield
            return
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            yield


def find_modules(tree: Any) -> list[torch.nn.Module]:
    """Every distinct nn.Module among the leaves of ``tree`` (lists of replicas included)."""
    seen: dict[int, torch.nn.Module] = {}
    for leaf in trees.leaves(tree):
        if isinstance(leaf, torch.nn.Module):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def modules_in_call(args: tuple, kwargs: dict) -> list[torch.nn.Module]:
    """Every module a call can reach: the modules among its arguments and all their submodules, each once."""
    return list({id(m): m for root in find_modules((args, kwargs)) for m in root.modules()}.values())


def user_code_reached(args: tuple, kwargs: dict, pure_hooks: bool) -> tuple[list[torch.nn.Module], str]:
    """(every module the call can reach (:func:`modules_in_call`), and what of the job's own code a second run of
    it would run): ``mode`` where it reaches a tensor subclass with its own hooks (an argument, or a parameter,
    buffer or tensor attribute of a module in the call), ``hooks`` where a forward of its modules runs a hook the
    user registered (unless the user declared them ``pure_hooks``), else ""."""
    leaves = trees.leaves((args, kwargs))
    roots = {id(leaf): leaf for leaf in leaves if isinstance(leaf, torch.nn.Module)}
    modules = list({id(m): m for root in roots.values() for m in root.modules()}.values())
    if any(map(is_hooked_subclass, leaves)) or any(map(is_hooked_subclass, module_tensors(modules))):
        return modules, "mode"
    if not pure_hooks and has_user_hooks(modules):
        return modules, "hooks"
    return modules, ""


def holds_hooked_subclass(tree: Any) -> bool:
    """Whether a tensor subclass with its own hooks is among the leaves of ``tree`` (a result whose comparison
    would run its code)."""
    return any(map(is_hooked_subclass, trees.leaves(tree)))


def _plain_tensors(modules: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """The plain tensor attributes of ``modules`` that do not require grad (a replica's parameters do)."""
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.requires_grad:
                yield value


def module_tensors(modules: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """The parameters, buffers and plain tensor attributes (a DataParallel replica's parameters) of ``modules``."""
    for module in modules:
        for container in (module._parameters, module._buffers, vars(module)):
            for value in container.values():
                if isinstance(value, torch.Tensor):
                    yield value


#: The hook registries whose hooks run during a forward (and a backward through its output).
_RUN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_RUN_HOOKS = tuple(f"_global{name}" for name in _RUN_HOOKS)


def _is_torchs_own(hook: Any) -> bool:
    """Whether a hook is torch's own code (spectral_norm's and pruning's pre-hooks, weight_norm's): such hooks
    write only module state, which the isolation puts back."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    owner = getattr(hook, "__self__", None)
    if owner is not None and not isinstance(owner, type):  # a bound method: its object's class decides
        hook = owner
    plain = isinstance(hook, (types.FunctionType, types.BuiltinFunctionType))
    module = (getattr(hook, "__module__", None) if plain else type(hook).__module__) or ""
    return module == "torch" or module.startswith("torch.")


def has_user_hooks(modules: list[torch.nn.Module]) -> bool:
    """Whether a forward of these modules runs a hook the user registered: on any of them, or globally."""
    registries = [getattr(torch.nn.modules.module, name) for name in _GLOBAL_RUN_HOOKS]
    registries += [vars(m)[name] for m in modules for name in _RUN_HOOKS if vars(m).get(name)]
    return any(not _is_torchs_own(hook) for registry in registries for hook in registry.values())


def _new_leaf(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """A tensor outside the caller's autograd graph standing for ``tensor``: a clone (``copy``) or the same
    storage, of the same class (a Parameter stays a Parameter) and with the same ``requires_grad``."""
    leaf = tensor.detach().clone() if copy else tensor.detach()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(leaf, requires_grad=tensor.requires_grad)
    return leaf.requires_grad_(tensor.requires_grad) if tensor.requires_grad else leaf


class _Replicated(torch.autograd.Function):
    """The identity, as an autograd node: what stands for a broadcast replica parameter is, like it, a non-leaf
    with a ``grad_fn``, over the same storage (no copy), whose graph ends at a leaf of the shadow side's own."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor outside the caller's graph with ``tensor``'s autograd shape: a new leaf for a leaf, a non-leaf over
    a new leaf for a non-leaf (a DataParallel replica's parameters: forwards may check their ``grad_fn``)."""
    leaf = _new_leaf(tensor, copy=False)
    if tensor.is_leaf or not tensor.requires_grad:
        return leaf
    with torch.enable_grad():
        return _Replicated.apply(leaf)


def clone_tensors(tree: Any, copied: dict[int, torch.Tensor] | None = None) -> Any:
    """``tree`` with every tensor replaced by a clone outside the caller's graph (same device, dtype, strides and
    ``requires_grad``), or by its clone in ``copied`` (by id) where one was made already."""
    copied = copied or {}
    return trees.map_only(torch.Tensor, lambda t: copied[id(t)] if id(t) in copied else _new_leaf(t, copy=True), tree)


def detach_tensors(tree: Any) -> Any:
    """``tree`` with every tensor that requires grad replaced by a new leaf over the same storage: a run on it
    builds a graph of its own, never one that reaches the caller's tensors. ``tree`` itself when none does."""
    for leaf in trees.leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            break
    else:
        return tree
    return trees.map_only(torch.Tensor, lambda t: _new_leaf(t, copy=False) if t.requires_grad else t, tree)


#: The per-module dictionaries an upstream run could add to or change (register_buffer, hooks, ...).
_MODULE_DICTS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_GLOBAL_HOOKS = tuple(name for name in vars(torch.nn.modules.module) if name.startswith("_global_") and "hooks" in name)


def _copy(container: Any) -> Any:
    return container.copy() if hasattr(container, "copy") else container


def _changed(container: Any, content: Any) -> bool:
    """Whether a dict (by key and value identity: values may be tensors) or a set differs from its copy."""
    if not container or isinstance(container, (set, frozenset)):  # (most of a module's hook dicts are empty)
        return container != content
    # (in order: a dict's copy keeps its order, and a value swapped in place keeps its key's)
    return container.keys() != content.keys() or not all(map(operator.is_, container.values(), content.values()))


class ModuleState:
    """A module's attributes (the training flag, counters and caches a forward sets, ...) and the contents of its
    dictionaries (parameters, buffers, submodules, hooks), put back on restore.

    Attributes are put back by binding: ``self.calls += 1`` is undone, an object changed in place
    (``self.cache.append(x)``) is not."""

    __slots__ = ("_attributes", "_dicts", "_module")

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        attributes = self._attributes = dict(vars(module))
        self._dicts = [(attributes[name], _copy(attributes[name])) for name in _MODULE_DICTS if name in attributes]

    @property
    def attributes(self) -> dict[str, Any]:
        """The module's attributes as they were taken (a copy of its ``__dict__``)."""
        return self._attributes

    def restore(self) -> None:
        attributes = vars(self._module)
        if _changed(attributes, self._attributes):
            attributes.clear()
            attributes.update(self._attributes)
        for container, content in self._dicts:
            if _changed(container, content):
                container.clear()
                container.update(content)


_MISSING = object()
_PLAIN_TYPES = (int, float, complex, bool, str, bytes, type(None))
#: Attributes of a module that are torch's own bookkeeping, compared as the dictionaries they are elsewhere.
_NOT_STATE = frozenset((*_MODULE_DICTS, "training"))


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN_TYPES):
        return True
    return isinstance(value, tuple) and len(value) <= 16 and all(isinstance(v, _PLAIN_TYPES) for v in value)


def _alike(first: Any, second: Any) -> bool:
    """Whether two values a forward left in a module attribute are alike: equal tensors (NaN equal to NaN), equal
    plain values; other objects alike when of one type (comparing them would run the user's code)."""
    if first is second:
        return True
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if (first.shape, first.dtype, first.device) != (second.shape, second.dtype, second.device):
            return False
        with torch.no_grad():
            return bool(torch.equal(first, second)) or (
                first.is_floating_point() and bool(torch.allclose(first, second, equal_nan=True))
            )
    if _plain(first) and _plain(second):
        return type(first) is type(second) and (first == second or (first != first and second != second))
    return type(first) is type(second)


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "(none)"
    if isinstance(value, torch.Tensor):
        if value.numel() <= 4:
            return f"tensor({value.detach().cpu().tolist()}, dtype={str(value.dtype).removeprefix('torch.')})"
        return f"tensor of shape {tuple(value.shape)}"
    if _plain(value):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__}"


def module_differences(
    modules: list[torch.nn.Module],
    before: list[dict[str, Any]],
    versions: dict[int, int],
    first: list[dict[str, Any]],
    second: list[dict[str, Any]],
    stand_ins: dict[int, torch.Tensor],
) -> dict[str, tuple[str, str]]:
    """The module attributes two runs from the same start left differently ({"Module.name": (first's,
    second's)}): attributes either run rebound, added or deleted, and plain tensor attributes either wrote in
    place. ``versions``: the plain tensors' version counters at the start; ``stand_ins``: by the id of each
    original tensor, what stood for it in the second run (a copy: unchanged where it is still bound)."""
    counts: dict[str, int] = {}
    for module in modules:
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    found: dict[str, tuple[str, str]] = {}
    for index, module in enumerate(modules):
        start, left_first, left_second = before[index], first[index], second[index]
        kind = type(module).__name__
        where = kind if counts[kind] == 1 else f"{kind}[{index}]"
        for name in dict.fromkeys((*start, *left_first, *left_second)):
            if name in _NOT_STATE or name.startswith("__"):
                continue
            was = start.get(name, _MISSING)
            a, b = left_first.get(name, _MISSING), left_second.get(name, _MISSING)
            stand_in = stand_ins.get(id(was)) if isinstance(was, torch.Tensor) else None
            if stand_in is not None and b is stand_in:
                b = was if stand_in._version == versions.get(id(stand_in), 0) else stand_in
            first_changed = a is not was or (isinstance(a, torch.Tensor) and a._version != versions.get(id(a), 0))
            second_changed = b is not was
            if not (first_changed or second_changed):
                continue
            if not (a is b if a is _MISSING or b is _MISSING else _alike(a, b)):
                found[f"{where}.{name}"] = (_shown(a), _shown(b))
    return found


class _GlobalHooks:
    """The module hooks registered for every module (``register_module_forward_hook`` and the like)."""

    def __init__(self) -> None:
        self._saved = {name: _copy(getattr(torch.nn.modules.module, name)) for name in _GLOBAL_HOOKS}

    def restore(self) -> None:
        for name, content in self._saved.items():
            container = getattr(torch.nn.modules.module, name)
            if _changed(container, content):
                container.clear()
                container.update(content)


#: A substitution made for the isolated run: ``container[key] = value`` (a module's _parameters, _buffers or
#: attribute dictionary).
_Swap = tuple[dict, str, torch.Tensor]


class ArgumentsChanged(RuntimeError):
    """Legacy wrote an argument in place: without a copy taken before it (which would have cost legacy that
    memory), upstream cannot start from what legacy started from."""


class Isolation:
    """Taken before the primary runs; :meth:`take_arguments` after it; :meth:`shadow_run` then gives the upstream
    side its own world.

    Before legacy only what legacy changes by design is copied: the module buffers (BatchNorm's running
    statistics), when the copies fit in the memory free (:mod:`shadow.core.support.memory`). Arguments are copied after
    legacy, when legacy's own memory is no longer at stake, and only if legacy left them as they were (their
    autograd version counters tell). ``modules``: every module the call reaches (:func:`modules_in_call`).
    ``runs``: how many isolated runs will follow (the upstream run, and the single-device oracle's); each gets its
    own copies, so none starts from what another left. Raises :class:`InsufficientMemory`.
    """

    def __init__(self, args: tuple, kwargs: dict, modules: list[torch.nn.Module], runs: int = 1) -> None:
        buffers = {id(b): b for m in modules for b in m._buffers.values() if b is not None}
        plain = {id(t): t for t in _plain_tensors(modules)}
        memory.check_fits([*buffers.values(), *plain.values()], runs, "module buffers")
        self.rng_before = RngSnapshot()
        # What every run starts from: the modules' attributes before legacy ran (a forward that counts its calls
        # in ``self.calls`` or ``self.steps`` starts each run from the same count), and the plain tensors' versions.
        self._before = [ModuleState(m) for m in modules]
        self._plain_versions = {id(t): t._version for t in plain.values()}
        self.module_differences: dict[str, tuple[str, str]] = {}
        self._modules = modules
        self._runs = runs
        self._given = (args, kwargs)
        tensors = {id(t): t for t in tree_iter((args, kwargs)) if isinstance(t, torch.Tensor)}.values()
        # An inference tensor keeps no version counter: what legacy does to it cannot be seen, so it is copied now.
        early = [t for t in tensors if t.is_inference()]
        memory.check_fits(early, runs, "inference-tensor arguments")
        self._early = [{id(t): _new_leaf(t, copy=True) for t in early} for _ in range(runs)]
        self._versions = [(t, t._version) for t in tensors if not t.is_inference()]
        # The parameters stand in for themselves (new leaves over the same storage: no copy), so legacy must not
        # write them in place either (version counters again; a rebinding, ``param.data = ...``, is no write).
        parameters = {id(p): p for m in modules for p in m._parameters.values() if p is not None}
        self._parameter_versions = [(p, p._version) for p in parameters.values() if not p.is_inference()]
        self._worlds = [self._swaps(modules) for _ in range(runs)]
        self._arguments: list[tuple[tuple, dict]] = []

    def take_arguments(self) -> tuple[tuple, dict]:
        """Copy the arguments for every run, after legacy: the first run's (args, kwargs). Raises ArgumentsChanged
        where legacy wrote one in place, InsufficientMemory where the copies would not fit."""
        changed = sum(t._version != version for t, version in self._versions)
        if changed:
            raise ArgumentsChanged(f"legacy wrote {changed} of the call's tensor arguments in place")
        changed = sum(p._version != version for p, version in self._parameter_versions)
        if changed:
            raise ArgumentsChanged(f"legacy wrote {changed} of the modules' parameters in place")
        memory.check_fits((t for t, _ in self._versions), self._runs, "argument copies")
        self._arguments = [clone_tensors(self._given, early) for early in self._early]
        return self._arguments[0]

    @staticmethod
    def _swaps(modules: list[torch.nn.Module]) -> tuple[list[_Swap], list[torch.Tensor]]:
        """One run's swaps, and the tensors they stand for (in the same order)."""
        leaves: dict[int, torch.Tensor] = {}  # tied parameters and buffers stay tied in the isolated run
        swaps: list[_Swap] = []
        originals: list[torch.Tensor] = []
        for module in modules:
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    swaps.append((module._buffers, name, leaves.setdefault(id(buffer), _new_leaf(buffer, copy=True))))
                    originals.append(buffer)
            for name, parameter in module._parameters.items():
                if parameter is not None:
                    leaf = leaves.setdefault(id(parameter), _new_leaf(parameter, copy=False))
                    swaps.append((module._parameters, name, leaf))
                    originals.append(parameter)
            for name, value in vars(module).items():  # a replica's parameters: non-leaf tensors in its __dict__
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    swaps.append((vars(module), name, leaves.setdefault(id(value), _stand_in(value))))
                    originals.append(value)
                elif isinstance(value, torch.Tensor):  # a plain tensor attribute: a forward may write it in place
                    swaps.append((vars(module), name, leaves.setdefault(id(value), _new_leaf(value, copy=True))))
                    originals.append(value)
        return swaps, originals

    def arguments(self, run: int = 0) -> tuple[tuple, dict]:
        """The copied (args, kwargs) of one run (after :meth:`take_arguments`)."""
        return self._arguments[run]

    def stand_ins(self, run: int = 0) -> dict[int, torch.Tensor]:
        """What stands for each tensor of the call in one run (after :meth:`take_arguments`), by the id of the tensor
        it stands for: the parameters' new leaves, the replicas' parameters, the argument copies. The gradients a
        backward comparison asks for are with respect to those that require grad."""
        swaps, originals = self._worlds[run]
        found = {id(original): value for (_, _, value), original in zip(swaps, originals)}
        for original, copy in zip(tree_iter(self._given), tree_iter(self._arguments[run])):
            if isinstance(original, torch.Tensor) and isinstance(copy, torch.Tensor):
                found.setdefault(id(original), copy)
        return found

    @contextlib.contextmanager
    def shadow_run(self, run: int = 0) -> Iterator[None]:
        """Run the body isolated: legacy's starting state, its own graph, nothing leaks out."""
        rng_after_legacy = RngSnapshot()
        swaps, originals = self._worlds[run]
        # Taken before the swaps: restoring the modules' attributes and dictionaries also swaps the originals back.
        states = [ModuleState(m) for m in self._modules]
        hooks = _GlobalHooks()
        try:
            self.rng_before.restore()
            for state in self._before:  # (the attributes legacy started from, not those it left)
                state.restore()
            versions = dict(self._plain_versions)
            for container, key, value in swaps:
                versions[id(value)] = value._version
                container[key] = value
            yield
            if run == 0:
                left = [dict(vars(m)) for m in self._modules]
                self.module_differences = module_differences(
                    self._modules,
                    [state.attributes for state in self._before],
                    versions,
                    [state.attributes for state in states],
                    left,
                    {id(original): value for (_, _, value), original in zip(swaps, originals)},
                )
        finally:
            for state in states:
                state.restore()
            hooks.restore()
            rng_after_legacy.restore()
