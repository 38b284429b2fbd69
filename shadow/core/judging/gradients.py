"""Backward comparison: the same vector-Jacobian products through each side's own graph.

A forward comparison cannot see a difference that only shows in backward: saved tensors kept in another dtype, a
reduction on another device, a custom autograd function whose backward scales its gradient. On a sampled fraction
of compared calls of an isolated target, one seeded random cotangent per output leaf (drawn from a generator of
this module's, never the job's RNG) is pulled back through upstream's graph (the isolated upstream run's) and
through a graph of legacy's own (legacy run again, isolated like upstream: the caller's graph, ``.grad``, tensor
hooks and RNG are never reached). The products with respect to every parameter (the replicas' too) and every
input that requires grad are compared like outputs; one that differs is a mismatch with reason ``grad`` naming
it (``args[0].fc.weight``). ``torch.autograd.grad`` returns the products without accumulating them anywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_iter

from shadow.core.judging.compare import compare
from shadow.core.model.observation import Outcome, bounded
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.support import trees


def names_of(args: tuple, kwargs: dict) -> dict[int, str]:
    """A readable name for every tensor of a call that requires grad, by id: ``args[1][0].conv1.weight`` for a
    parameter of a module among the arguments (a replica's too), ``args[2][0][0]`` for an input."""
    names: dict[int, str] = {}
    pairs, _ = trees.flatten_with_paths((args, kwargs))
    for path, leaf in pairs:
        where = ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])
        if isinstance(leaf, torch.nn.Module):
            for module_name, module in leaf.named_modules(remove_duplicate=False):
                prefix = f"{where}.{module_name}" if module_name else where
                tensors = list(module._parameters.items()) + [
                    (name, value) for name, value in vars(module).items() if isinstance(value, torch.Tensor)
                ]
                for name, tensor in tensors:
                    if tensor is not None and tensor.requires_grad:
                        names.setdefault(id(tensor), f"{prefix}.{name}")
        elif isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            names.setdefault(id(leaf), where)
    return names


def prepare() -> None:
    """Import now what a backward comparison would import on its first run: ``torch.autograd.grad`` given cotangent
    tensors imports ``torch.fx.experimental.symbolic_shapes`` (and sympy), and an import that adds warning filters
    mid-job changes the filters, which makes Python forget which warnings it has shown: the job's warnings would show
    again (torch's "not compiled with NCCL support" 7 times instead of once)."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401


def _differentiable(output: Any) -> list[tuple[int, torch.Tensor]]:
    return [
        (position, leaf)
        for position, leaf in enumerate(tree_iter(output))
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point()
    ]


def vjp(output: Any, wrt: dict[int, torch.Tensor], seed: int) -> dict[int, torch.Tensor | None] | None:
    """The products of one seeded random cotangent per differentiable output leaf (the same for the same
    ``seed`` and output shapes, whichever side) with the Jacobian with respect to each of ``wrt``'s tensors that
    requires grad (None where the output does not depend on it). None where no output leaf requires grad, or no
    tensor of ``wrt`` does (nothing to pull back)."""
    leaves = _differentiable(output)
    keys = [key for key, tensor in wrt.items() if tensor.requires_grad]
    if not leaves or not keys:
        return None
    generator = torch.Generator()
    cotangents = []
    for position, leaf in leaves:
        generator.manual_seed(seed + position)  # (a leaf's cotangent depends on its position alone)
        drawn = torch.randn(leaf.shape, generator=generator, dtype=torch.float64)
        cotangents.append(drawn.to(device=leaf.device, dtype=leaf.dtype))
    grads = torch.autograd.grad([leaf for _, leaf in leaves], [wrt[key] for key in keys], cotangents, allow_unused=True)
    return dict(zip(keys, grads))


@dataclasses.dataclass(frozen=True)
class GradientComparison:
    """What the two sides' products showed: ``outcome`` (match, close or mismatch), the names that differ (by
    ``detail``), the greatest differences, and each product's greatest absolute difference (``leaf_errors``, named
    ``grad:<tensor>``: what a gradient noise floor holds and judges). ``value_only``: every difference is one of
    value (no product on one side only, none of another shape or dtype), the only kind a floor can excuse."""

    outcome: str
    detail: str = ""
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    compared: int = 0
    leaf_errors: tuple[tuple[str, float], ...] = ()
    value_only: bool = True


def compare_gradients(
    legacy: dict[int, torch.Tensor | None],
    upstream: dict[int, torch.Tensor | None],
    names: dict[int, str],
    tolerance: ToleranceSpec,
) -> GradientComparison:
    """Each tensor's two products compared like outputs (the target's tolerance); a product on one side only is
    a difference too."""
    outcome, differing, abs_error, rel_error, compared = Outcome.MATCH.value, [], 0.0, 0.0, 0
    leaf_errors, value_only = [], True
    for key in sorted(set(legacy) | set(upstream), key=lambda k: names.get(k, "")):
        ours, theirs = legacy.get(key), upstream.get(key)
        name = names.get(key, "a tensor of the call")
        if ours is None and theirs is None:
            continue
        compared += 1
        if ours is None or theirs is None:
            differing.append(f"{name}: a gradient on the {'upstream' if ours is None else 'legacy'} side only")
            outcome, value_only = Outcome.MISMATCH.value, False
            continue
        found = compare(ours, theirs, tolerance=tolerance)
        leaf_errors.append((f"grad:{name}", found.max_abs_error))
        abs_error, rel_error = max(abs_error, found.max_abs_error), max(rel_error, found.max_rel_error)
        if found.outcome == Outcome.MISMATCH:
            differing.append(f"{name}: {found.detail or ', '.join(found.reasons)}")
            outcome, value_only = Outcome.MISMATCH.value, value_only and set(found.reasons) == {"value"}
        elif found.outcome == Outcome.CLOSE and outcome == Outcome.MATCH.value:
            outcome = Outcome.CLOSE.value
    detail = bounded("gradient of " + "; ".join(differing)) if differing else ""
    return GradientComparison(outcome, detail, abs_error, rel_error, compared, tuple(leaf_errors), value_only)
