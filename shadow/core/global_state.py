"""The process-wide torch settings a shadow side could change, taken and put back around it.

Upstream implementations, comparators and exporters are code the job did not ask to run on its thread: whatever
they set globally (default dtype or device, autocast, determinism, matmul precision, threads, anomaly detection,
print options, the accelerator's current device) must be what legacy left once the shadow side is done. Only
settings that changed are written back, so an unchanged state costs a few getter calls.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


def _autocast_device_types() -> list[str]:
    accelerator = torch.accelerator.current_accelerator()
    return ["cpu"] + ([accelerator.type] if accelerator is not None else [])


def _initialized_accelerator() -> Any | None:
    """The accelerator's device module if its runtime is up (asking a cold CUDA for its device would start it)."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None
    module = torch.get_device_module(accelerator.type)
    is_initialized = getattr(module, "is_initialized", None)
    return module if is_initialized is None or is_initialized() else None


#: How each setting is named where two snapshots are compared.
_NAMES = {
    "default_dtype": "default dtype",
    "default_device": "default device",
    "autocast": "autocast",
    "autocast_cache": "autocast cache",
    "deterministic": "deterministic algorithms",
    "matmul_precision": "float32 matmul precision",
    "threads": "threads",
    "anomaly": "anomaly detection",
    "printoptions": "print options",
    "grad": "grad mode",
    "device": "current device",
}


def _plain(key: str, value: Any) -> Any:
    if key == "default_device":  # a DeviceContext: compare what it sets
        return None if value is None else str(value.device)
    return value


class TorchGlobals:
    """A snapshot of torch's global settings; :meth:`restore` writes back those that changed since."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = self._read()

    @staticmethod
    def _read() -> dict[str, Any]:
        with warnings.catch_warnings():  # (getters of settings with newer spellings warn)
            warnings.simplefilter("ignore")
            state = {
                "default_dtype": torch.get_default_dtype(),
                "default_device": getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None),
                "autocast": {
                    t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _autocast_device_types()
                },
                "autocast_cache": torch.is_autocast_cache_enabled(),
                "deterministic": (
                    torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled(),
                ),
                "matmul_precision": torch.get_float32_matmul_precision(),
                "threads": torch.get_num_threads(),
                "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                "printoptions": dict(vars(torch._tensor_str.PRINT_OPTS)),
                "grad": torch.is_grad_enabled(),
            }
        module = _initialized_accelerator()
        state["device"] = torch.accelerator.current_device_index() if module is not None else None
        return state

    def differences(self, other: TorchGlobals) -> dict[str, tuple[Any, Any]]:
        """{setting's name: (its value here, its value in ``other``)} for each setting the two differ in."""
        found = {}
        for key, value in self._state.items():
            mine, theirs = _plain(key, value), _plain(key, other._state[key])
            if mine != theirs:
                found[_NAMES[key]] = (mine, theirs)
        return found

    def restore(self) -> None:
        """Write back every setting that differs from the snapshot."""
        now, then = self._read(), self._state
        if now == then:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if now["default_dtype"] != then["default_dtype"]:
                torch.set_default_dtype(then["default_dtype"])
            if now["default_device"] is not then["default_device"]:
                context = then["default_device"]
                torch.set_default_device(None if context is None else context.device)
            for device_type, (enabled, dtype) in then["autocast"].items():
                if now["autocast"].get(device_type) != (enabled, dtype):
                    torch.set_autocast_enabled(device_type, enabled)
                    torch.set_autocast_dtype(device_type, dtype)
            if now["autocast_cache"] != then["autocast_cache"]:
                torch.set_autocast_cache_enabled(then["autocast_cache"])
            if now["deterministic"] != then["deterministic"]:
                torch.use_deterministic_algorithms(then["deterministic"][0], warn_only=then["deterministic"][1])
            if now["matmul_precision"] != then["matmul_precision"]:
                torch.set_float32_matmul_precision(then["matmul_precision"])
            if now["threads"] != then["threads"]:
                torch.set_num_threads(then["threads"])
            if now["anomaly"] != then["anomaly"]:
                torch.set_anomaly_enabled(*then["anomaly"])
            if now["printoptions"] != then["printoptions"]:
                for name, value in then["printoptions"].items():
                    setattr(torch._tensor_str.PRINT_OPTS, name, value)
            if now["grad"] != then["grad"]:
                torch.set_grad_enabled(then["grad"])
            if then["device"] is not None and now["device"] != then["device"]:
                torch.accelerator.set_device_index(then["device"])
