"""Which side is nearer the truth: a float64 run on the CPU of the call both sides made.

When legacy and upstream differ in value (outcome ``close``, or a ``mismatch`` for value alone), the comparison
says that they differ, not which one is wrong. Accuracy tools answer that for single operators by a float64 CPU
"golden" run (msprobe's api_accuracy_checker; torch._dynamo's ``same(ref, res, fp64_ref)`` asks whether the new
result is further from float64 than the old one). Here, on a sampled fraction of such calls, the call runs again on
the CPU in float64, once on each side's code path: every floating tensor of the arguments copied and upcast, every
module in the call with its parameters and buffers swapped for upcast copies (put back afterwards), the global RNG
put back where it was, no graph. Where the two float64 runs agree within :data:`FLOAT64_AGREEMENT` they are the
truth; where they do not, one side's code rounds (or computes) differently by design, and a truth run on that
side's path would take its side: ``nearer`` is ``differs-in-float64``, each side's error measured against its own
path's float64 run. For the DataParallel targets the truth is replica 0's module alone (the single-device call of
:mod:`shadow.core.model.oracle`: one code path, neither side's), compared with replica 0's part of each side's result.

Each side's error against the truth is, per output leaf, the greatest absolute difference divided by the
greatest magnitude of the truth (a NaN or infinity where the truth has a finite value counts as infinite); a
side's error is its greatest over the leaves. ``nearer`` is the side with the smaller error, ``tie`` where the two
are within 10% of each other (both rounding the same truth about as well).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shadow.core.model.observation import DECADE_LIMIT as DECADE_LIMIT
from shadow.core.model.observation import DIFFERS_IN_FLOAT64
from shadow.core.model.observation import NEARER as NEARER
from shadow.core.model.observation import error_decade as error_decade
from shadow.core.runs.isolation import ModuleState, RngSnapshot, module_tensors, modules_in_call
from shadow.core.support import memory, trees

#: Errors within this share of the larger one are a tie.
TIE_SHARE = 0.1

#: The greatest relative difference (as :func:`leaf_errors` measures it) at which the two sides' float64 runs are
#: one truth: a million float64 ulps, far above what a different summation order or a fused operation makes, far
#: below what a float16 or float32 step in either code path makes.
FLOAT64_AGREEMENT = 1e-10


def _upcast_dtype(tensor: torch.Tensor) -> torch.dtype:
    if tensor.is_floating_point():
        return torch.float64
    if tensor.is_complex():
        return torch.complex128
    return tensor.dtype


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` in its widest dtype: always a copy, never ``tensor`` itself (``.to`` returns a CPU
    float64 or integer tensor as it is, and the truth run would then write the caller's own buffers)."""
    return tensor.detach().to("cpu", _upcast_dtype(tensor), copy=True)


def _host_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * _upcast_dtype(t).itemsize for t in tensors)


def upcast(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU, floating ones in float64 (modules left as they are)."""
    return trees.map_only(torch.Tensor, _upcast, tree)


@contextlib.contextmanager
def upcast_modules(modules: list[torch.nn.Module]) -> Iterator[None]:
    """The body runs with every parameter, buffer and tensor attribute (a replica's parameters) of ``modules``
    swapped for an upcast CPU copy; the modules are put back as they were afterwards."""
    states = [ModuleState(module) for module in modules]
    copies: dict[int, torch.Tensor] = {}  # (tied tensors stay tied)
    tensors = {id(t): t for t in module_tensors(modules)}
    memory.check_host_fits(_host_bytes(iter(tensors.values())), "the truth run's module copies")

    def copy(tensor: torch.Tensor, parameter: bool = False) -> torch.Tensor:
        if id(tensor) not in copies:
            made = _upcast(tensor)
            copies[id(tensor)] = torch.nn.Parameter(made, requires_grad=False) if parameter else made
        return copies[id(tensor)]

    try:
        for module in modules:
            for name, value in list(module._parameters.items()):
                if value is not None:
                    module._parameters[name] = copy(value, parameter=True)
            for name, value in list(module._buffers.items()):
                if value is not None:
                    module._buffers[name] = copy(value)
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    vars(module)[name] = copy(value)
        yield
    finally:
        for state in states:
            state.restore()


@contextlib.contextmanager
def in_float64(function: Callable, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """The body runs with the modules among ``function`` and its arguments upcast (:func:`upcast_modules`), and
    gets the upcast arguments; the global RNG is put back as it was afterwards. Entered on the caller's thread, as
    the isolation is: a run abandoned at its deadline never leaves the caller's modules swapped."""
    modules = modules_in_call((function, *args), kwargs)  # (the function itself may be a module)
    arguments = {id(t): t for t in trees.leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    memory.check_host_fits(_host_bytes(iter(arguments.values())), "the truth run's argument copies")
    rng = RngSnapshot()
    try:
        with upcast_modules(modules):
            yield upcast((args, kwargs))
    finally:
        rng.restore()


def run_upcast(function: Callable, args: tuple, kwargs: dict) -> Any:
    """``function`` on upcast arguments, without a graph or autocast."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return function(*args, **kwargs)


def run_in_float64(function: Callable, args: tuple, kwargs: dict) -> Any:
    """``function`` on the upcast arguments, with the modules among them upcast, on the CPU, without a graph or
    autocast; the global RNG as it was before."""
    with in_float64(function, args, kwargs) as (up_args, up_kwargs):
        return run_upcast(function, up_args, up_kwargs)


def leaf_errors(result: Any, truth: Any) -> list[float]:
    """Per output leaf with values, ``result``'s error against ``truth`` (see the module's docstring); an empty
    list where their structures differ."""
    leaves, spec = trees.flatten(result)
    truths, truth_spec = trees.flatten(truth)
    if spec != truth_spec:
        return []
    errors = []
    for leaf, reference in zip(leaves, truths):
        if not (isinstance(leaf, torch.Tensor) and isinstance(reference, torch.Tensor)):
            continue
        if leaf.shape != reference.shape or not (leaf.is_floating_point() or leaf.is_complex()):
            continue
        ours, exact = _upcast(leaf), _upcast(reference).to(_upcast(leaf).dtype)
        if exact.numel() == 0:
            continue
        finite = torch.isfinite(exact)
        if bool((finite & ~torch.isfinite(ours)).any()):
            errors.append(math.inf)
            continue
        scale = float(exact[finite].abs().max()) if bool(finite.any()) else 0.0
        difference = float((ours[finite] - exact[finite]).abs().max()) if bool(finite.any()) else 0.0
        errors.append(difference / scale if scale > 0 else difference)
    return errors


@dataclasses.dataclass(frozen=True)
class Truth:
    """Both sides' errors against the float64 run, per leaf and overall, and which side is nearer."""

    nearer: str
    legacy_error: float
    upstream_error: float
    legacy_leaf_errors: tuple[float, ...] = ()
    upstream_leaf_errors: tuple[float, ...] = ()


def nearer(legacy: list[float], upstream: list[float]) -> Truth | None:
    """Which side's errors are smaller (None where the leaves could not be paired with the truth's)."""
    if not legacy or len(legacy) != len(upstream):
        return None
    ours, theirs = max(legacy), max(upstream)
    finite = math.isfinite(ours) and math.isfinite(theirs)
    if ours == theirs or (finite and abs(ours - theirs) <= TIE_SHARE * max(ours, theirs)):
        side = "tie"
    else:
        side = "legacy" if ours < theirs else "upstream"
    return Truth(side, ours, theirs, tuple(legacy), tuple(upstream))


def judge(legacy_result: Any, upstream_result: Any, truth: Any) -> Truth | None:
    """Both results against the truth (None where they cannot be paired with it)."""
    return nearer(leaf_errors(legacy_result, truth), leaf_errors(upstream_result, truth))


def judge_both(legacy_result: Any, upstream_result: Any, legacy_truth: Any, upstream_truth: Any) -> Truth | None:
    """Both results against the float64 runs of both code paths: against the truth where the two runs agree within
    :data:`FLOAT64_AGREEMENT`, else ``differs-in-float64`` (each side's error against its own path's run). None
    where the results cannot be paired with the runs."""
    apart = leaf_errors(legacy_truth, upstream_truth)
    if not apart:
        return None
    if max(apart) <= FLOAT64_AGREEMENT:
        return judge(legacy_result, upstream_result, upstream_truth)
    legacy, upstream = leaf_errors(legacy_result, legacy_truth), leaf_errors(upstream_result, upstream_truth)
    if not legacy or len(legacy) != len(upstream):
        return None
    return Truth(DIFFERS_IN_FLOAT64, max(legacy), max(upstream), tuple(legacy), tuple(upstream))
