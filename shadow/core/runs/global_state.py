"""The process-wide settings a shadow side could change, taken and put back around it.

Upstream implementations, comparators and exporters are code the job did not ask to run on its thread: whatever
they set globally must be what legacy left once the shadow side is done. Each setting is a row of
:data:`SETTINGS`: how it is read, how it is written back, and its name where two snapshots differ. Only settings
that changed are written back, so an unchanged state costs a few getter calls.

Not taken (no getter, or no cheap way to put back): ``torch.set_flush_denormal`` (torch has no getter), the
saved-tensors hooks below the top of their stack, and anything outside torch, NumPy's error settings, Python's
warning filters and its recursion limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
import torch.utils._device
import torch.utils.deterministic
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

#: Once found: the autocast device types, and the accelerator's device module once its runtime is up. Neither
#: changes for the life of the process once it is so (a snapshot is taken several times a sampled call).
_FOUND: dict[str, Any] = {}


def _autocast_device_types() -> list[str]:
    found = _FOUND.get("device types")
    if found is not None:
        return found
    # (CUDA's flag always: ``torch.is_autocast_enabled()`` without a device type reads it, and both legacies'
    # parallel_apply hand it to their workers, whatever the accelerator)
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:  # (not yet, maybe: a backend registered later)
        return ["cpu", "cuda"]
    found = _FOUND["device types"] = list(dict.fromkeys(["cpu", "cuda", accelerator.type]))
    return found


def _initialized_accelerator() -> Any | None:
    """The accelerator's device module if its runtime is up (asking a cold CUDA for its device would start it)."""
    found = _FOUND.get("initialized")
    if found is not None:
        return found
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None
    module = torch.get_device_module(accelerator.type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is None or is_initialized():
        _FOUND["initialized"] = module
        return module
    return None


# --------------------------------------------------------------------------- readers and writers


def _autocast() -> dict[str, tuple[bool, torch.dtype]]:
    return {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _autocast_device_types()}


def _set_autocast(state: dict[str, tuple[bool, torch.dtype]]) -> None:
    for device_type, (enabled, dtype) in state.items():
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)


def _default_device() -> tuple[Any, Any]:
    """The default device's context (torch.set_default_device) and the device torch's constructors fill in."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None), torch.utils._device.CURRENT_DEVICE


def _set_default_device(value: tuple[Any, Any]) -> None:
    # The very objects, not a new context: the mode stack (put back first) holds the old one.
    context, torch.utils._device.CURRENT_DEVICE = value
    if context is None:
        vars(torch._GLOBAL_DEVICE_CONTEXT).pop("device_context", None)
    else:
        torch._GLOBAL_DEVICE_CONTEXT.device_context = context


def _current_device() -> int | None:
    return torch.accelerator.current_device_index() if _initialized_accelerator() is not None else None


def _set_current_device(index: int | None) -> None:
    if index is not None:
        torch.accelerator.set_device_index(index)


def _set_function_modes(modes: tuple) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def _set_dispatch_modes(modes: tuple) -> None:
    while torch._C._len_torch_dispatch_stack():
        torch._C._pop_torch_dispatch_stack()
    for mode in modes:
        torch._C._push_on_torch_dispatch_stack(mode)


def _saved_tensors_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _set_saved_tensors_hooks(top: Any) -> None:
    """Pop what was pushed above ``top`` (hooks taken off below it cannot be put back)."""
    for _ in range(64):
        if _saved_tensors_hooks() == top or _saved_tensors_hooks() is None:
            return
        torch._C._autograd._pop_saved_tensors_default_hooks()


def _set_print_options(options: dict[str, Any]) -> None:
    for name, value in options.items():
        setattr(torch._tensor_str.PRINT_OPTS, name, value)


def _set_warning_filters(filters: tuple) -> None:
    warnings.filters[:] = list(filters)
    warnings._filters_mutated()  # (as warnings.filterwarnings does: caches keyed on the filters are dropped)


def _set_fill_uninitialized_memory(value: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = value


def _set_mkldnn(value: bool) -> None:
    torch.backends.mkldnn.enabled = value


def _set_opt_einsum(value: bool) -> None:
    torch.backends.opt_einsum.enabled = value


def _as_is(value: Any) -> Any:
    return value


def _function_modes() -> tuple:
    return tuple(_get_current_function_mode_stack()) if torch._C._len_torch_function_stack() else ()


def _dispatch_modes() -> tuple:
    return tuple(_get_current_dispatch_mode_stack()) if torch._C._len_torch_dispatch_stack() else ()


_OPT_EINSUM = torch.backends.opt_einsum
_OPT_EINSUM_FLAGS = vars(_OPT_EINSUM).get("m", _OPT_EINSUM)  # (the module torch's own flags() writes)
_UNSET = object()


def _opt_einsum_enabled() -> bool:
    # (``torch.backends.opt_einsum.enabled`` as Python finds it, without its failed lookup on the module's class: the
    # attribute a write put on the module, else the flag its module keeps)
    found = vars(_OPT_EINSUM).get("enabled", _UNSET)
    return _OPT_EINSUM_FLAGS.enabled if found is _UNSET else found


def _print_options() -> dict[str, Any]:
    return vars(torch._tensor_str.PRINT_OPTS).copy()


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its name where snapshots differ, its reader and writer, and how a value is shown (and
    compared) in a difference."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    shown: Callable[[Any], Any] = _as_is
    #: Written outside the warnings.catch_warnings() that quiets setters which warn (anomaly detection's).
    outside_catch_warnings: bool = False
    #: Its setter may warn: written back inside warnings.catch_warnings(), entered only then (leaving it marks
    #: the filters changed, which forgets every "shown once" warning: the job would see its warnings again).
    warns: bool = False
    #: One value for the whole process (every thread reads what any thread wrote last): put back only where the
    #: code the tool ran wrote it (:class:`Writes`), never over a change another thread of the job made meanwhile.
    process_wide: bool = False


#: Every setting taken, in the order they are written back: the mode stacks first (a mode upstream left on them
#: would see every later write; a default device is a mode at the bottom of the function mode stack).
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("torch function modes", _function_modes, _set_function_modes),
        Setting("default dtype", torch.get_default_dtype, torch.set_default_dtype, process_wide=True),
        # (thread-local in effect: its context is a mode on this thread's stack, where constructors read it; the
        # global beside it only answers torch.get_default_device)
        Setting(
            "default device",
            _default_device,
            _set_default_device,
            shown=lambda value: None if value[1] is None else str(value[1]),
        ),
        Setting("autocast", _autocast, _set_autocast),
        Setting("autocast cache", torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
        Setting(
            "deterministic algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]),
            process_wide=True,
        ),
        Setting(
            "fill uninitialized memory",
            lambda: torch.utils.deterministic.fill_uninitialized_memory,
            _set_fill_uninitialized_memory,
            process_wide=True,
        ),
        Setting(
            "float32 matmul precision",
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
            process_wide=True,
        ),
        Setting("threads", torch.get_num_threads, torch.set_num_threads),
        Setting(
            "anomaly detection",
            lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            lambda value: torch.set_anomaly_enabled(*value),
            warns=True,
            process_wide=True,
        ),
        Setting("warn always", torch.is_warn_always_enabled, torch.set_warn_always, process_wide=True),
        Setting(
            "autograd multithreading",
            torch.autograd.is_multithreading_enabled,
            torch.autograd.set_multithreading_enabled,
        ),
        Setting("mkldnn", lambda: torch.backends.mkldnn.enabled, _set_mkldnn, process_wide=True),
        # (process-wide, but written by a plain assignment to the module that no hook sees: put back whoever wrote it)
        Setting("opt_einsum", _opt_einsum_enabled, _set_opt_einsum),
        Setting(
            "multi-head attention fast path",
            torch.backends.mha.get_fastpath_enabled,
            torch.backends.mha.set_fastpath_enabled,
            process_wide=True,
        ),
        Setting("print options", _print_options, _set_print_options, process_wide=True),
        Setting("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        Setting("current device", _current_device, _set_current_device),
        Setting("torch dispatch modes", _dispatch_modes, _set_dispatch_modes),
        Setting("saved tensors hooks", _saved_tensors_hooks, _set_saved_tensors_hooks),
        Setting("numpy error settings", np.geterr, lambda value: np.seterr(**value)),
        Setting(
            "warning filters",
            lambda: tuple(warnings.filters),
            _set_warning_filters,
            outside_catch_warnings=True,
            process_wide=True,
        ),
        Setting("recursion limit", sys.getrecursionlimit, sys.setrecursionlimit, process_wide=True),
    )
}


#: Settings a module writes when it is first imported (``warnings.filterwarnings`` at import time): one run of a
#: call can write them and the same call run again cannot.
IMPORT_TIME_SETTINGS = ("warning filters",)


class TorchGlobals:
    """A snapshot of the global settings; :meth:`restore` writes back those that changed since."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = self._read()

    @staticmethod
    def _read() -> list[Any]:
        # (no warnings.catch_warnings() here: it changes the process's warning filters for a moment, and another
        # thread's snapshot taken then would see a difference nobody made)
        return [setting.read() for setting in SETTINGS.values()]  # (SETTINGS' order)

    def same_as(self, other: TorchGlobals) -> bool:
        """Whether the two snapshots hold the same settings (the very objects, or equal values)."""
        return self._state == other._state

    def differences(self, other: TorchGlobals) -> dict[str, tuple[Any, Any]]:
        """{setting's name: (its value here, its value in ``other``)} for each setting the two differ in."""
        found = {}
        for setting, mine, theirs in zip(SETTINGS.values(), self._state, other._state, strict=True):
            mine, theirs = setting.shown(mine), setting.shown(theirs)
            if mine != theirs:
                found[setting.name] = (mine, theirs)
        return found

    def process_wide_differences(self, other: TorchGlobals) -> list[str]:
        """The process-wide settings the two snapshots differ in, by name."""
        pairs = zip(SETTINGS.values(), self._state, other._state, strict=True)
        return [setting.name for setting, mine, theirs in pairs if setting.process_wide and mine != theirs]

    def as_written_by(self, written: Collection[str], others: TorchGlobals) -> TorchGlobals:
        """This snapshot as far as the code that ran on its thread is concerned: its process-wide settings that code
        did not write (``written``: :class:`Writes`) as they are in ``others`` (a change another thread made
        meanwhile is no difference of that code's)."""
        taken = TorchGlobals.__new__(TorchGlobals)
        taken._state = [
            mine if not setting.process_wide or setting.name in written else theirs
            for setting, mine, theirs in zip(SETTINGS.values(), self._state, others._state, strict=True)
        ]
        return taken

    def attributed(
        self, written: Collection[str], others: TorchGlobals, before: TorchGlobals
    ) -> tuple[TorchGlobals, list[str]]:
        """(this snapshot as the code that wrote ``written`` left it: :meth:`as_written_by` ``others``; the
        process-wide settings it differs from ``before`` in that the code did not write: another thread's changes,
        which the code may have read)."""
        foreign = [name for name in self.process_wide_differences(before) if name not in written]
        return self.as_written_by(written, others), foreign

    def restore(self, written: Collection[str] = ()) -> None:
        """Write back every thread-local setting that differs from the snapshot, and of the process-wide ones those
        named in ``written`` (the ones the tool's own code wrote since, :class:`Writes`): a process-wide setting
        another thread of the job changed meanwhile keeps its new value. Each is written on its own: one that cannot
        be written back does not keep the others from it; the first failure is raised at the end."""
        now, then = self._read(), self._state
        if now == then:
            return
        pairs = zip(SETTINGS.values(), now, then, strict=True)
        changed = [
            (setting, value)
            for setting, current, value in pairs
            if current != value and (not setting.process_wide or setting.name in written)
        ]
        failure: BaseException | None = None
        quiet = any(setting.warns for setting, _ in changed)
        with warnings.catch_warnings() if quiet else contextlib.nullcontext():
            if quiet:
                warnings.simplefilter("ignore")
            for setting, value in changed:
                if not setting.outside_catch_warnings:
                    failure = _write(setting, value) or failure
        for setting, value in changed:
            if setting.outside_catch_warnings:
                failure = _write(setting, value) or failure
        if failure is not None:
            raise failure


def _setters() -> tuple[dict[int, str], dict[int, str]]:
    """({id of a C function: the process-wide setting it writes}, {id of a Python code: the setting}): what
    :class:`Writes` watches for. Taken once (the objects are kept alive by the table itself)."""
    found = _FOUND.get("setters")
    if found is not None:
        return found
    c_functions = {
        "default dtype": (torch._C._set_default_dtype, torch._C._set_default_tensor_type),
        "deterministic algorithms": (torch._C._set_deterministic_algorithms,),
        "fill uninitialized memory": (torch._C._set_deterministic_fill_uninitialized_memory,),
        "float32 matmul precision": (torch._C._set_float32_matmul_precision,),
        "anomaly detection": (torch._C.set_anomaly_enabled,),
        "warn always": (torch._C._set_warnAlways,),
        "mkldnn": (torch._C._set_mkldnn_enabled,),
        "warning filters": (warnings._filters_mutated,),  # type: ignore[attr-defined]  (every filter change calls it)
        "recursion limit": (sys.setrecursionlimit,),
    }
    python_functions = {
        "default device": (
            torch.set_default_device, torch.utils._device.DeviceContext.__enter__,
            torch.utils._device.DeviceContext.__exit__,
        ),
        "multi-head attention fast path": (torch.backends.mha.set_fastpath_enabled,),
        "print options": (torch._tensor_str.set_printoptions,),
    }  # fmt: skip
    kept: list[Any] = []
    by_c, by_code = {}, {}
    for name, functions in c_functions.items():
        for function in functions:
            kept.append(function)
            by_c[id(function)] = name
    for name, functions in python_functions.items():
        for function in functions:
            code = getattr(function, "__code__", None)
            if code is not None:
                kept.append(code)
                by_code[id(code)] = name
    found = _FOUND["setters"] = (by_c, by_code)
    _FOUND["setters kept"] = kept
    return found


class Writes:
    """The process-wide settings the code run on this thread writes while the ``with`` body runs: a profile hook
    on this thread alone (``sys.setprofile``; the thread's own hook, a profiler's, is put back after) that notes each
    call of a function that writes one (:func:`_setters`). Those alone are put back after a run of the tool's: a
    setting another thread of the job changes meanwhile is the job's (not put back, and no difference of the run's).
    Not seen: threads the body starts, and a plain assignment to ``torch._tensor_str.PRINT_OPTS``."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __enter__(self) -> Writes:
        by_c, by_code = _setters()
        names = self.names

        def hook(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call":
                name = by_c.get(id(arg))
            elif event == "call":
                name = by_code.get(id(frame.f_code))
            else:
                return
            if name is not None:
                names.add(name)

        self._outer = sys.getprofile()
        sys.setprofile(hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._outer)


def _write(setting: Setting, value: Any) -> Exception | None:
    try:
        setting.write(value)
    except Exception as exc:
        return exc
    return None
