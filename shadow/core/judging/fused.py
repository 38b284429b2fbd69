"""One pass per leaf: the kernel that reduces a large leaf on an accelerator to the comparator's statistics, where
the device has one.

Torch's eager reduction of a leaf (:func:`shadow.core.judging.compare._device_stats`) is twenty-odd kernels, each
reading or writing the whole leaf: on a GPU, slower than ``torch.testing.assert_close``. A fused kernel reads each
element of both sides once and writes the int64[8] of statistics. This module says which device has one:

- the emulated npu: its own kernel (:func:`shadow.npu.emulated.leaf_statistics`, one queued kernel);
- CUDA (and ROCm): a Triton kernel (:mod:`shadow.core.judging.triton_pass`), where Triton is installed, for leaves
  computed in float32 (float64 ones keep the eager reduction);
- anything else (an Ascend NPU under torch_npu, say): none, the eager reduction.

A kernel that fails (Triton cannot compile on this host, say) is not tried again in this process: the eager
reduction takes over, and the failure is kept in :data:`FAILURES`, which :func:`describe` (the device check's
comparator row) reports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from shadow.core.model import tolerance as tol

#: A fused kernel: (flat legacy, flat upstream, tolerance, compute dtype, compare bits) -> int64[8] on their device,
#: or None where it does not take this pair (its compute dtype, say).
Kernel = Callable[[torch.Tensor, torch.Tensor, tol.Tolerance, torch.dtype, bool], "torch.Tensor | None"]

#: Why a device type's kernel was given up in this process, by device type.
FAILURES: dict[str, str] = {}


def _emulated_npu(legacy: torch.Tensor, upstream: torch.Tensor, tolerance: tol.Tolerance, compute: torch.dtype,
                  bitwise: bool) -> torch.Tensor:  # fmt: skip
    from shadow.npu import emulated

    rtol, atol, equal_nan = tolerance.rtol, tolerance.atol, tolerance.equal_nan
    return emulated.leaf_statistics(legacy, upstream, rtol, atol, equal_nan, bitwise, compute == torch.float64)


def _triton(legacy: torch.Tensor, upstream: torch.Tensor, tolerance: tol.Tolerance, compute: torch.dtype,
            bitwise: bool) -> torch.Tensor | None:  # fmt: skip
    if compute != torch.float32:
        return None
    from shadow.core.judging import triton_pass

    return triton_pass.leaf_statistics(legacy, upstream, tolerance.rtol, tolerance.atol, tolerance.equal_nan, bitwise)


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # (an import that fails for any reason: no kernel, the eager reduction)
        return False
    return True


def kernel_for(device_type: str) -> Kernel | None:
    """The fused kernel for tensors of ``device_type``, None where there is none (or it failed in this process)."""
    if device_type in FAILURES:
        return None
    if device_type == "npu":
        from shadow.npu import emulated

        return _emulated_npu if emulated.installed_devices() else None
    if device_type == "cuda" and _triton_installed():
        return _triton
    return None


def describe(device_type: str) -> str:
    """Which pass reduces a large float32 leaf on ``device_type`` in this process, in words."""
    kernel = kernel_for(device_type)
    if kernel is _emulated_npu:
        return "one pass: the emulated npu's kernel"
    if kernel is _triton:
        return "one pass: Triton"
    why = FAILURES.get(device_type, "no fused kernel for this device" if device_type != "cuda" else "no Triton")
    return f"torch's eager kernels: {why}"


def leaf_statistics(
    legacy: torch.Tensor, upstream: torch.Tensor, tolerance: tol.Tolerance, compute: torch.dtype, bitwise: bool
) -> torch.Tensor | None:
    """The statistics of flat ``legacy`` and ``upstream`` from their device's fused kernel: int64[8] on the device,
    or None where the device has no kernel for them (the caller reduces them eagerly)."""
    device_type = legacy.device.type
    kernel = kernel_for(device_type)
    if kernel is None:
        return None
    try:
        return kernel(legacy, upstream, tolerance, compute, bitwise)
    except torch.OutOfMemoryError:  # (the device's, not the kernel's: the eager reduction would not fit either)
        raise
    except Exception as exc:  # (a compiler missing on this host: never again here, and said where asked)
        FAILURES[device_type] = f"{type(exc).__name__}: {exc}"[:300]
        return None
