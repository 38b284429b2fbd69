"""The comparator's one pass over a leaf as a Triton kernel (CUDA and ROCm GPUs, where Triton is installed).

Imported only where it is used (:mod:`shadow.core.judging.fused`): importing it imports Triton. The statistics are
those of :func:`shadow.core.judging.compare._device_stats`, computed in float32 (a float64 leaf keeps the eager
reduction). Each program reduces one block of both sides, reading each element once, and folds its block's counts
into the leaf's int64[8] with atomics: counts are added; the first element out of tolerance is kept as ``n - index``
and the greatest errors as their float32 bits, both by ``atomic_max`` (the bits of non-negative floats order as the
floats do), so the buffer starts as zeros. A one-program kernel then turns ``n - index`` back into the index and
reads both sides' values there. Three launches per leaf (the zeros, the pass, the finish), no host read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements per program.
BLOCK = 2048

#: The integer type of each element width, to compare bits.
_BITS = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _leaf_pass(
    legacy, upstream, out, n, rtol, atol,
    EQUAL_NAN: tl.constexpr, BITWISE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x_raw = tl.load(legacy + offsets, mask=inside, other=0)
    y_raw = tl.load(upstream + offsets, mask=inside, other=0)
    x = x_raw.to(tl.float32)
    y = y_raw.to(tl.float32)
    diff = tl.abs(x - y)  # NaN where either is NaN or both are the same infinity
    size = tl.abs(x)
    close = ((diff - size * rtol) <= atol) | (x == y)
    if EQUAL_NAN:
        close = close | ((x != x) & (y != y))
    bad = (close == 0) & inside
    finite = diff < float("inf")
    bad_count = tl.sum(bad.to(tl.int64), axis=0)
    if BITWISE:
        differing = (x_raw.to(BITS, bitcast=True) != y_raw.to(BITS, bitcast=True)) & inside
        tl.atomic_add(out + 0, tl.sum(differing.to(tl.int64), axis=0))
    else:  # (bits of different dtypes cannot be equal: what differs then is the values)
        tl.atomic_add(out + 0, bad_count)
    tl.atomic_add(out + 1, bad_count)
    tl.atomic_add(out + 2, tl.sum((bad & (finite == 0)).to(tl.int64), axis=0))
    tl.atomic_max(out + 3, tl.max(tl.where(bad, n - offsets, 0), axis=0))
    # errors over finite differences only; 0/0 is no error, x/0 is inf
    errors = tl.where(finite & inside, diff, 0.0)
    relative = errors / size
    relative = tl.where(relative == relative, relative, 0.0)
    tl.atomic_max(out + 4, tl.max(errors, axis=0).to(tl.int32, bitcast=True).to(tl.int64))
    tl.atomic_max(out + 5, tl.max(relative, axis=0).to(tl.int32, bitcast=True).to(tl.int64))


@triton.jit
def _leaf_finish(legacy, upstream, out, n):
    last = tl.load(out + 3)
    first = tl.where(last > 0, n - last, -1)
    at = tl.maximum(first, 0)
    tl.store(out + 3, first)
    tl.store(out + 6, tl.load(legacy + at).to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(out + 7, tl.load(upstream + at).to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64))


def leaf_statistics(
    legacy: torch.Tensor, upstream: torch.Tensor, rtol: float, atol: float, equal_nan: bool, bitwise: bool
) -> torch.Tensor:
    """The comparator's statistics of flat ``legacy`` and ``upstream`` (one device, same numel) in float32: int64[8]
    on their device, from one pass over both. ``bitwise``: they have the same dtype and their bits are compared."""
    legacy, upstream = ((t.view(torch.uint8) if t.dtype == torch.bool else t).contiguous() for t in (legacy, upstream))
    n = legacy.numel()
    out = torch.zeros(8, dtype=torch.int64, device=legacy.device)
    bits = _BITS[legacy.element_size()]
    # (fp fusion off: ``diff - size * rtol`` rounded as the host and torch round it, not contracted into an fma)
    _leaf_pass[(triton.cdiv(n, BLOCK),)](
        legacy, upstream, out, n, float(rtol), float(atol), EQUAL_NAN=equal_nan, BITWISE=bitwise, BITS=bits,
        BLOCK=BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
    _leaf_finish[(1,)](legacy, upstream, out, n, enable_fp_fusion=False)
    return out
