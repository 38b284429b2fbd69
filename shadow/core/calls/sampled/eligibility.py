"""Whether a sampled call can be run twice as the same call: what would make the shadow side visible to the job's
own code, or not the same call."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from shadow.core.model.observation import bounded
from shadow.core.model.targets import Target
from shadow.core.runs.isolation import has_user_hooks, module_tensors
from shadow.core.support import trees
from shadow.core.support.memory import InsufficientMemory

_PLAIN_TORCH_FUNCTION = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def is_hooked_subclass(leaf: Any) -> bool:
    """A tensor subclass with its own __torch_function__ or __torch_dispatch__ (nn.Parameter has neither)."""
    cls = type(leaf)
    if cls is torch.Tensor or not isinstance(leaf, torch.Tensor):
        return False
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    return function not in _PLAIN_TORCH_FUNCTION or cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


#: torch's own TorchFunctionModes: they are part of the call's context, active for legacy and upstream alike.
_TORCHS_OWN_MODES = (DeviceContext,)  # torch.set_default_device, ``with torch.device(...)``


def user_code_would_see_the_shadow(args: tuple, kwargs: dict, modules: list[torch.nn.Module]) -> bool:
    """Whether a user's TorchFunctionMode or any TorchDispatchMode is active, or the call reaches a tensor
    subclass with its own hooks (an argument, or a parameter, buffer or tensor attribute of a module in the call).
    Their code would then see every operation of the shadow side, and upstream's calls would come back through
    them to the wrapper, so the comparison would not be faithful: such calls are skipped with reason "mode"
    (counted, never compared). torch's own modes (a default device) are part of the call: upstream runs under
    them too."""
    if torch._C._len_torch_dispatch_stack():
        return True
    if torch._C._len_torch_function_stack() and not all(
        isinstance(mode, _TORCHS_OWN_MODES) for mode in _get_current_function_mode_stack()
    ):
        return True
    return any(map(is_hooked_subclass, trees.leaves((args, kwargs)))) or any(
        map(is_hooked_subclass, module_tensors(modules))
    )


def skip_reason(
    target: Target, pure_hooks: bool, args: tuple, kwargs: dict, modules: list[torch.nn.Module]
) -> tuple[str, str] | None:
    """(reason, detail) where a sampled call of ``target`` cannot be compared faithfully, else None.

    Args:
        target: the call's target (its ``run_if``).
        pure_hooks: the user's module hooks are declared free of side effects.
        args, kwargs: the call's arguments.
        modules: the modules in the call.

    Returns:
        Why the shadow side would be visible to code the job runs (a user's mode, a tensor subclass, a user's module
        hooks), is being compiled, or the target says the call cannot run twice (:attr:`Target.run_if`); None when
        it can be compared.
    """
    if torch.compiler.is_compiling():
        return "compiling", ""
    if user_code_would_see_the_shadow(args, kwargs, modules):
        return "mode", ""
    if not pure_hooks and has_user_hooks(modules):
        return "hooks", ""
    if target.run_if is not None:
        try:
            why = target.run_if(args, kwargs)
        except InsufficientMemory as exc:
            return "oom", bounded(str(exc))
        except Exception as exc:  # (the target's own check: its failure is ours to count, never the job's)
            return "comparator", bounded(f"run_if raised {exc!r}")
        if why is not None:
            return "ineligible", bounded(str(why))
    return None
