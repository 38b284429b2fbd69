"""Keeping the upstream run from changing anything the training job can see.

Only sampled calls of targets that ask for it pay for this. Before legacy runs we take the RNG
states, clones of every module buffer reachable from the arguments and clones of the tensor
arguments. The upstream run then starts from exactly what legacy started from, runs on its own
tensors (the module's buffers are swapped for clones in the module's ``_buffers`` dicts, so the
originals are never written and their autograd version counters never move), builds no autograd
graph, and afterwards every generator is put back where legacy left it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_iter, tree_map_only


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

    __slots__ = ("_accelerator", "_cpu", "_devices", "_numpy", "_python")

    def __init__(self) -> None:
        self._python = random.getstate()
        self._numpy = np.random.get_state()
        self._cpu = torch.get_rng_state()
        self._accelerator = _accelerator_rng_module()
        self._devices = None
        if self._accelerator is not None:
            if hasattr(self._accelerator, "get_rng_state_all"):
                self._devices = self._accelerator.get_rng_state_all()
            else:  # a device module with the per-device API only
                count = torch.accelerator.device_count()
                self._devices = [self._accelerator.get_rng_state(i) for i in range(count)]

    def restore(self) -> None:
        random.setstate(self._python)
        np.random.set_state(self._numpy)
        torch.set_rng_state(self._cpu)
        if self._accelerator is None:
            return
        if hasattr(self._accelerator, "set_rng_state_all"):
            self._accelerator.set_rng_state_all(self._devices)
        else:
            for index, state in enumerate(self._devices):
                self._accelerator.set_rng_state(state, index)


def find_modules(tree: Any) -> list[torch.nn.Module]:
    """Every distinct nn.Module among the leaves of ``tree`` (lists of replicas included)."""
    seen: dict[int, torch.nn.Module] = {}
    for leaf in tree_iter(tree):
        if isinstance(leaf, torch.nn.Module):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def clone_tensors(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a detached clone (same device, dtype and strides)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


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
    if isinstance(container, (set, frozenset)):
        return container != content
    return container.keys() != content.keys() or any(container[k] is not v for k, v in content.items())


class ModuleState:
    """A module's training flag and dictionaries (parameters, buffers, submodules, hooks), put back on restore."""

    __slots__ = ("_dicts", "_module", "_training")

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._training = module.training
        self._dicts = {
            name: (vars(module)[name], _copy(vars(module)[name])) for name in _MODULE_DICTS if name in vars(module)
        }

    def restore(self) -> None:
        module = self._module
        if module.training != self._training:
            module.training = self._training  # (this module only: each submodule has its own state)
        for name, (container, content) in self._dicts.items():
            if vars(module).get(name) is not container:
                vars(module)[name] = container
            if _changed(container, content):
                container.clear()
                container.update(content)


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


class Isolation:
    """Taken before legacy runs; :meth:`upstream_run` then gives the upstream side its own world.

    ``runs``: how many isolated runs will follow (the upstream run, and the single-device oracle's); each gets
    its own clones of the arguments and buffers, so none starts from what another left.
    """

    def __init__(self, args: tuple, kwargs: dict, runs: int = 1) -> None:
        self.rng_before = RngSnapshot()
        self._worlds = [self._world(args, kwargs) for _ in range(runs)]
        self.args, self.kwargs = self._worlds[0][0]

    @staticmethod
    def _world(
        args: tuple, kwargs: dict
    ) -> tuple[tuple[tuple, dict], list[tuple[dict, str, torch.Tensor]], list[torch.nn.Module]]:
        clones: dict[int, torch.Tensor] = {}  # tied buffers stay tied in the isolated run
        swaps: list[tuple[dict, str, torch.Tensor]] = []
        modules = list({id(m): m for root in find_modules((args, kwargs)) for m in root.modules()}.values())
        for module in modules:
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    clone = clones.setdefault(id(buffer), buffer.detach().clone())
                    swaps.append((module._buffers, name, clone))
        return clone_tensors((args, kwargs)), swaps, modules

    def arguments(self, run: int = 0) -> tuple[tuple, dict]:
        """The cloned (args, kwargs) of one run."""
        return self._worlds[run][0]

    @contextlib.contextmanager
    def upstream_run(self, run: int = 0) -> Iterator[None]:
        """Run the body isolated: legacy's starting state, no graph, nothing leaks out."""
        rng_after_legacy = RngSnapshot()
        _, swaps, modules = self._worlds[run]
        # Taken before the buffer swaps: restoring the modules' dictionaries also swaps the originals back.
        states = [ModuleState(m) for m in modules]
        hooks = _GlobalHooks()
        try:
            self.rng_before.restore()
            for buffers, name, clone in swaps:
                buffers[name] = clone
            with torch.no_grad():
                yield
        finally:
            for state in states:
                state.restore()
            hooks.restore()
            rng_after_legacy.restore()
