"""Fire drills: synthetic divergence injected into the *upstream* side of a fraction of sampled calls,
so that operators can watch metrics, alerts and the verdict react. The legacy result the job receives
is never touched: corrupted values are always new tensors."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils._pytree import tree_iter

from shadow.core.judging.compare import storage_key
from shadow.core.model.observation import DRILL_KINDS
from shadow.core.support import trees
from shadow.core.support.rates import check_rate


class DrillError(RuntimeError):
    """What a drill of kind ``exception`` raises on the shadow side."""


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

    def corrupt(self, result: Any, inputs: Any = ()) -> tuple[Any, bool]:
        """A copy of an upstream result with the drill's divergence, and only its own kind, in it; and whether
        any was injected.

        Every other property the comparison checks is kept: ``requires_grad``, tensors shared between outputs,
        and tensors that alias one of ``inputs`` (those are left as they are: corrupting them would write the
        call's arguments). A ``nan`` drill corrupts floating-point tensors only, a ``dtype`` drill floating-point
        tensors, a ``value`` drill tensors and strings."""
        aliased = {key for key in map(storage_key, _tensors(inputs)) if key is not None}
        done: dict[int, Any] = {}
        injected = False

        def leaf(value: Any) -> Any:
            nonlocal injected
            if id(value) in done:
                return done[id(value)]
            corrupted = self._corrupt_leaf(value, aliased)
            done[id(value)] = corrupted
            injected = injected or corrupted is not value
            return corrupted

        corrupted = trees.map_only(object, leaf, result)
        return corrupted, injected

    def _corrupt_leaf(self, leaf: Any, aliased: set[tuple]) -> Any:
        if isinstance(leaf, str):
            return leaf + " (drill)" if self.kind == "value" else leaf
        if not isinstance(leaf, torch.Tensor) or not leaf.numel() or storage_key(leaf) in aliased:
            return leaf
        if self.kind in ("dtype", "nan") and not leaf.is_floating_point():
            return leaf
        dtype = leaf.dtype
        if self.kind == "dtype":
            dtype = torch.float32 if leaf.dtype == torch.float16 else torch.float16
        with torch.no_grad():  # (a copy with the leaf's own strides: a layout difference is not this drill's kind)
            out = torch.empty_strided(leaf.size(), leaf.stride(), dtype=dtype, device=leaf.device).copy_(leaf)
            if self.kind != "dtype":
                index = (0,) * out.dim()
                if self.kind == "nan":
                    out[index] = float("nan")
                else:
                    out[index] = ~out[index] if out.dtype == torch.bool else out[index] + 1
        return out.requires_grad_() if leaf.requires_grad else out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_iter(tree) if isinstance(leaf, torch.Tensor)]
