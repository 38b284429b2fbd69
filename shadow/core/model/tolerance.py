"""Tolerances: per dtype defaults equal to ``torch.testing.assert_close``, overridable per target."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from shadow.core.model.observation import bounded


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Elements agree when ``|upstream - legacy| <= atol + rtol * |legacy|``.

    ``equal_nan``: NaN in the same position on both sides counts as agreement.
    """

    rtol: float
    atol: float
    equal_nan: bool = True

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not _finite(value):
                raise ValueError(f"Tolerance.{name} must be a finite number >= 0, got {bounded(repr(value), 40)}")
            if value < 0:
                raise ValueError(f"Tolerance.{name} must be >= 0, got {value!r}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


EXACT = Tolerance(0.0, 0.0)

#: The defaults of torch.testing.assert_close; every other dtype compares exactly.
DEFAULTS: Mapping[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(1e-3, 1e-5),
    torch.bfloat16: Tolerance(1.6e-2, 1e-5),
    torch.float32: Tolerance(1.3e-6, 1e-5),
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.complex32: Tolerance(1e-3, 1e-5),
    torch.complex64: Tolerance(1.3e-6, 1e-5),
    torch.complex128: Tolerance(1e-7, 1e-7),
}

#: What a user may pass for one target: one Tolerance for every dtype, or a per-dtype table.
ToleranceSpec = Tolerance | Mapping[torch.dtype, Tolerance] | None


def validate(spec: object, where: str) -> None:
    """Raise ValueError unless ``spec`` is a Tolerance, a {torch.dtype: Tolerance} dict, or None."""
    if spec is None or isinstance(spec, Tolerance):
        return
    if isinstance(spec, Mapping):
        for key, value in spec.items():
            if not isinstance(key, torch.dtype) or not isinstance(value, Tolerance):
                raise ValueError(
                    f"{where}: a tolerance table maps torch.dtype to shadow.Tolerance, got {key!r}: {value!r}"
                )
        return
    raise ValueError(f"{where}: expected a shadow.Tolerance, a {{torch.dtype: Tolerance}} dict or None, got {spec!r}")


def resolve(spec: ToleranceSpec, dtype: torch.dtype) -> Tolerance:
    """The tolerance for one dtype under ``spec`` (falling back to the assert_close defaults)."""
    if isinstance(spec, Tolerance):
        return spec
    if spec is not None and dtype in spec:
        return spec[dtype]
    return DEFAULTS.get(dtype, EXACT)


def for_pair(spec: ToleranceSpec, legacy: torch.dtype, upstream: torch.dtype) -> Tolerance:
    """The looser of the two dtypes' tolerances, as assert_close does for mixed dtypes."""
    first, second = resolve(spec, legacy), resolve(spec, upstream)
    if first == second:
        return first
    return Tolerance(max(first.rtol, second.rtol), max(first.atol, second.atol), first.equal_nan and second.equal_nan)
