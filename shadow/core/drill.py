"""Fire drills: synthetic divergence injected into the *upstream* side of a fraction of sampled calls,
so that operators can watch metrics, alerts and the verdict react. The legacy result the job receives
is never touched: corrupted values are always new tensors."""

from __future__ import annotations

import random
from typing import Any

import torch

from shadow.core import trees
from shadow.core.rates import check_rate

#: The faults a drill can inject into the upstream result.
DRILL_KINDS = ("value", "dtype", "nan", "exception")


class DrillError(RuntimeError):
    """What a drill of kind ``exception`` raises on the upstream side."""


class Drill:
    """Inject ``kind`` (value, dtype, nan, exception) into a ``rate`` fraction of upstream runs."""

    def __init__(self, kind: str, rate: float, seed: int | None = None) -> None:
        if kind not in DRILL_KINDS:
            raise ValueError(f"drill kind {kind!r} is not one of {DRILL_KINDS}")
        self.kind, self.rate = kind, check_rate(rate, "drill rate")
        self._rng = random.Random(None if seed is None else f"drill/{seed}")

    def fires(self) -> bool:
        """Whether this sampled call gets the synthetic divergence (drawn on sampled calls only)."""
        return self.rate >= 1.0 or self._rng.random() < self.rate

    def before_upstream(self) -> None:
        if self.kind == "exception":
            raise DrillError("npu-shadow fire drill: synthetic upstream exception")

    def corrupt(self, result: Any) -> Any:
        """A copy of an upstream result with the drill's divergence in it."""
        return trees.map_only(object, self._corrupt_leaf, result)

    def _corrupt_leaf(self, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if self.kind == "dtype":
                return leaf.detach().to(torch.float32 if leaf.dtype == torch.float16 else torch.float16)
            out = leaf.detach().clone()
            if out.numel():
                flat = out.view(-1) if out.is_contiguous() else out.reshape(-1)
                if self.kind == "nan" and out.is_floating_point():
                    flat[0] = float("nan")
                else:
                    flat[0] = flat[0] + 1
                if not out.is_contiguous():
                    out = flat.reshape(out.shape)
            return out
        if isinstance(leaf, str) and self.kind == "value":
            return leaf + " (drill)"
        return leaf
