"""Comparing a legacy result with an upstream result, leaf by leaf.

Both outputs are flattened with torch's pytree (dataclasses are opened too) into pairs of leaves
named by their path. Structure, Python types, tensor metadata and aliasing are checked on the host;
tensor values are reduced on the tensors' own device to a few statistics per leaf, and all leaves'
statistics travel to the host together, in one non-blocking copy: :func:`start` launches the work and returns the
comparison where the statistics are on the host already, else a :class:`PendingComparison` that says when they are
(an event per device, queried without waiting) and reads them then; :func:`compare` waits where the device has not
finished.

Tensors in host memory (device "cpu") are reduced by numpy ufuncs on one thread, in cache-sized chunks
written into reused scratch arrays: each element streams through memory once, no parallel region waits
for a core the job is using, and the statistics are on the host without any synchronisation. Tensors on
an accelerator are reduced on their device, whole, in one pass by the device's fused kernel where it has one
(:mod:`shadow.core.judging.fused`), else by torch's eager kernels; small ones (``SMALL_ON_HOST`` elements at
most) are copied to the host (non-blocking, into pinned memory) and reduced there once the copies landed: a logit or
a loss costs two copies instead of a kernel launch or twenty-odd.
All compute the same statistics (``tests/test_compare.py`` checks them against each other).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import keystr

from shadow.core.judging import fused
from shadow.core.model import tolerance as tol
from shadow.core.model.observation import DETAIL_LIMIT, MISMATCH_REASONS, Outcome, bounded
from shadow.core.model.target import Alike
from shadow.core.support import trees

#: Elements per chunk on the host: the working set of one chunk (two inputs, three float and three bool
#: scratch arrays) stays in a core's cache.
_HOST_CHUNK = 1 << 15


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The verdict on one pair of outputs."""

    outcome: str  # an Outcome's value: match (bitwise equal), close (within tolerance), mismatch or error
    reasons: tuple[str, ...] = ()
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    mismatched: int = 0
    numel: int = 0
    detail: str = ""
    #: The greatest absolute error of each output leaf that has values (its path inside the output: "" for a lone
    #: tensor), for the noise floor.
    leaf_errors: tuple[tuple[str, float], ...] = ()


# --------------------------------------------------------------------------- structure


def _flatten(
    flattened: tuple[list[tuple[Any, Any]], Any], prefix: str = ""
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """(leaves by path, container specs by path) of a nested output, from its (key path, leaf) pairs and spec
    (:func:`trees.flatten_with_paths`, a dataclass instance a leaf: its fields are opened here)."""
    pairs, spec = flattened
    leaves: dict[str, Any] = {}
    specs: list[tuple[str, Any]] = [(prefix, spec)]
    for key_path, leaf in pairs:
        path = prefix + keystr(key_path)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            specs.append((path, type(leaf)))
            fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)}
            sub_leaves, sub_specs = _flatten(trees.flatten_with_paths(fields, dataclasses_as_leaves=True), path)
            leaves.update(sub_leaves)
            specs.extend(sub_specs)
        else:
            leaves[path] = leaf
    return leaves, specs


def storage_key(t: torch.Tensor) -> tuple | None:
    """Where a tensor's storage lives, (device, address), or None where it has none: two tensors alias when
    their keys are equal."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, ptr) if ptr else None


def _alias_map(input_leaves: list[Any]) -> dict[tuple, int]:
    keys: dict[tuple, int] = {}
    for index, leaf in enumerate(x for x in input_leaves if isinstance(x, torch.Tensor)):
        key = storage_key(leaf)
        if key is not None:
            keys.setdefault(key, index)
    return keys


# --------------------------------------------------------------------------- values


def _compute_dtype(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    """float32 for everything but float64 (NPUs have no float64: never upcast half types to it)."""
    return torch.float64 if torch.float64 in (first, second) else torch.float32


def _bits(value: torch.Tensor) -> torch.Tensor:
    """A 0-d float32/float64 tensor reinterpreted as an int64 tensor, to travel with the counts."""
    if value.dtype == torch.float64:
        return value.view(torch.int64)
    return value.view(torch.int32).to(torch.int64)


def _unbits(value: int, compute: torch.dtype) -> float:
    if compute == torch.float64:
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return struct.unpack("<f", struct.pack("<i", value))[0]


def _as_real(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.detach().resolve_conj().resolve_neg().reshape(-1)
    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t


def _int_view(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    return t.view(width) if width is not None and t.dtype != torch.bool else t


#: Leaves on an accelerator with at most this many elements are copied to the host and reduced there: two copies
#: cost less than the twenty-odd small kernels (and their launches) of a reduction on the device.
SMALL_ON_HOST = 1 << 16


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of accelerator tensor ``t`` on its way to the host: non-blocking, into pinned memory (a copy into
    pageable memory would make the host wait); readable once an event recorded after it completed."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


@dataclasses.dataclass(frozen=True)
class _HostPair:
    """A small accelerator leaf's two sides on their way to the host (:func:`_to_host`): reduced there, once the
    copies landed."""

    a: torch.Tensor
    b: torch.Tensor
    source: torch.device
    tolerance: tol.Tolerance
    compute: torch.dtype
    same_dtype: bool

    def stats(self) -> torch.Tensor:
        return _host_stats(self.a, self.b, self.tolerance, self.compute, self.same_dtype)


def _value_stats(
    legacy: torch.Tensor, upstream: torch.Tensor, tolerance: tol.Tolerance
) -> tuple[torch.Tensor | _HostPair, torch.dtype]:
    """int64[8] on the tensors' device: bitwise differing, out of tolerance, out of tolerance with a NaN or inf
    involved, flat index of the first element out of tolerance (-1 if none), then as float bits: max abs error
    and max rel error over finite elements, legacy and upstream value at that index.

    Elements agree when ``|legacy - upstream| <= atol + rtol * |legacy|``, when they are equal (equal
    infinities), or when both are NaN and the tolerance has ``equal_nan``."""
    compute = _compute_dtype(legacy.dtype, upstream.dtype)
    a, b = _as_real(legacy), _as_real(upstream)
    same_dtype = legacy.dtype == upstream.dtype
    if a.device.type != "cpu" and a.numel() <= SMALL_ON_HOST:  # (exact copies)
        return _HostPair(_to_host(a), _to_host(b), a.device, tolerance, compute, same_dtype), compute
    if a.device.type == "cpu":
        return _host_stats(a, b, tolerance, compute, same_dtype), compute
    found = fused.leaf_statistics(a, b, tolerance, compute, same_dtype)
    return (_device_stats(a, b, tolerance, compute, same_dtype) if found is None else found), compute


def _device_stats(
    a: torch.Tensor, b: torch.Tensor, tolerance: tol.Tolerance, compute: torch.dtype, same_dtype: bool
) -> torch.Tensor:
    """The statistics of flat ``a`` and ``b`` computed by torch on their device, without a synchronisation."""
    n = a.numel()
    a_raw, b_raw = a, b
    a, b = a.to(compute), b.to(compute)
    diff = torch.sub(a, b).abs_()  # NaN where either side is NaN or both are the same infinity
    absa = a.abs()
    close = torch.sub(diff, absa, alpha=tolerance.rtol) <= tolerance.atol  # False on NaN and inf
    close |= a == b  # equal infinities
    if tolerance.equal_nan:
        close |= torch.isnan(torch.fmin(a, b))  # fmin is NaN only where both are
    good = torch.count_nonzero(close)
    first = close.view(torch.uint8).argmin()  # the first False
    # Bits of different dtypes cannot be equal; what differs then is the values.
    bitdiff = torch.count_nonzero(_int_view(a_raw) != _int_view(b_raw)) if same_dtype else n - good
    nonfinite_bad = n - torch.count_nonzero(close.logical_or_(diff < math.inf))
    diff.nan_to_num_(0.0, 0.0, 0.0)
    rel = torch.div(diff, absa).nan_to_num_(0.0, math.inf, math.inf)
    first = torch.where(good < n, first, -1)
    at = first.clamp(min=0)
    return torch.cat(
        [
            torch.stack([bitdiff, n - good, nonfinite_bad, first]),
            # (take, not a[at]: indexing by a 0-d tensor reads it on the host, a synchronization)
            torch.stack([_bits(diff.max()), _bits(rel.max()), _bits(torch.take(a, at)), _bits(torch.take(b, at))]),
        ]
    )


def _host_stats(
    a: torch.Tensor, b: torch.Tensor, tolerance: tol.Tolerance, compute: torch.dtype, same_dtype: bool
) -> torch.Tensor:
    """The same statistics for flat tensors in host memory, computed by numpy chunk by chunk."""
    n = a.numel()
    size = min(n, _HOST_CHUNK)
    native = a.dtype == compute and b.dtype == compute
    staged = [] if native else [torch.empty(size, dtype=compute, device="cpu") for _ in range(2)]
    np_compute = np.float64 if compute == torch.float64 else np.float32
    diff, absa, scratch = (np.empty(size, np_compute) for _ in range(3))
    close, flags, more = (np.empty(size, np.bool_) for _ in range(3))
    bits = (_int_view(a).numpy(), _int_view(b).numpy()) if same_dtype else None
    a_all, b_all = (a.numpy(), b.numpy()) if native else (None, None)
    bitdiff = bad = nonfinite_bad = 0
    first, max_abs, max_rel, at = -1, 0.0, 0.0, (0.0, 0.0)
    with np.errstate(all="ignore"):
        for start in range(0, n, size):
            stop = min(start + size, n)
            m = stop - start
            if native:
                x, y = a_all[start:stop], b_all[start:stop]
            else:
                x = staged[0][:m].copy_(a[start:stop]).numpy()
                y = staged[1][:m].copy_(b[start:stop]).numpy()
            d, ax, t, c, f, g = diff[:m], absa[:m], scratch[:m], close[:m], flags[:m], more[:m]
            np.abs(np.subtract(x, y, out=d), out=d)  # NaN where either side is NaN or both are the same infinity
            chunk_max = float(d.max())  # NaN or inf unless every element of both sides is finite
            finite = math.isfinite(chunk_max)
            np.abs(x, out=ax)
            np.less_equal(np.subtract(d, np.multiply(ax, tolerance.rtol, out=t), out=t), tolerance.atol, out=c)
            if not finite:
                c |= np.equal(x, y, out=f)  # equal infinities
                if tolerance.equal_nan:
                    c |= np.isnan(np.fmin(x, y, out=t), out=f)  # fmin is NaN only where both are
            chunk_bad = m - np.count_nonzero(c)
            if bits is not None:
                bitdiff += np.count_nonzero(np.not_equal(bits[0][start:stop], bits[1][start:stop], out=f))
            if chunk_bad:
                bad += chunk_bad
                if not finite:
                    nonfinite_bad += m - np.count_nonzero(np.logical_or(c, np.less(d, np.inf, out=g), out=g))
                if first < 0:
                    index = int(np.argmin(c))
                    first, at = start + index, (float(x[index]), float(y[index]))
            if not finite:  # errors are taken over finite differences only
                np.nan_to_num(d, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
                chunk_max = float(d.max())
            max_abs = max(max_abs, chunk_max)
            # fmax skips the NaN of 0/0; x/0 stays inf
            max_rel = max(max_rel, float(np.fmax.reduce(np.divide(d, ax, out=t))))
    if bits is None:
        bitdiff = bad
    floats = np.array([max_abs, max_rel, *at], dtype=np_compute)
    int_type = np.int64 if np_compute is np.float64 else np.int32
    return torch.tensor(
        [bitdiff, bad, nonfinite_bad, first, *floats.view(int_type).tolist()], dtype=torch.int64, device="cpu"
    )


# --------------------------------------------------------------------------- the walk


@dataclasses.dataclass
class _LeafReport:
    path: str
    reasons: list[str]
    notes: list[str]
    shape: tuple[int, ...] = ()
    numel: int = 0
    stats: torch.Tensor | _HostPair | None = None
    compute: torch.dtype = torch.float32
    tolerance: tol.Tolerance = tol.EXACT
    bitwise_equal: bool = True
    exact: bool = False  # compared bit for bit: exact mode, or integers and bools


def _check_tensor(
    path: str,
    legacy: torch.Tensor,
    upstream: torch.Tensor,
    spec: tol.ToleranceSpec,
    exact: bool,
) -> _LeafReport:
    report = _LeafReport(path, [], [], tuple(legacy.shape), legacy.numel())
    if type(legacy) is not type(upstream) or legacy.layout != upstream.layout:
        report.reasons.append("type")
        report.notes.append(f"{type(legacy).__name__}/{legacy.layout} vs {type(upstream).__name__}/{upstream.layout}")
    if legacy.dtype != upstream.dtype:
        report.reasons.append("dtype")
        report.notes.append(f"dtype {legacy.dtype} vs {upstream.dtype}")
    if legacy.shape != upstream.shape:
        report.reasons.append("shape")
        report.notes.append(f"shape {tuple(legacy.shape)} vs {tuple(upstream.shape)}")
    if legacy.device != upstream.device:
        report.reasons.append("device")
        report.notes.append(f"device {legacy.device} vs {upstream.device}")
    if legacy.requires_grad != upstream.requires_grad:
        report.reasons.append("requires_grad")
        report.notes.append(f"requires_grad {legacy.requires_grad} vs {upstream.requires_grad}")
    if legacy.shape == upstream.shape and not _same_layout(legacy, upstream):
        note = f"strides {legacy.stride()} vs {upstream.stride()}"
        if exact:
            report.reasons.append("stride")
            report.notes.append(note)
        else:
            report.notes.append(note + " (layout only: values compared)")
    comparable = (
        type(legacy) is type(upstream)
        and legacy.shape == upstream.shape
        and legacy.device == upstream.device
        and legacy.device.type != "meta"
        and legacy.numel() > 0
        and (legacy.is_complex() == upstream.is_complex())
    )
    # (meta tensors have no values: equal metadata is never a bitwise match)
    report.bitwise_equal = not report.reasons and legacy.device.type != "meta"
    report.exact = exact or not (legacy.is_floating_point() or legacy.is_complex())
    if comparable:
        report.tolerance = tol.EXACT if exact else tol.for_pair(spec, legacy.dtype, upstream.dtype)
        report.stats, report.compute = _value_stats(legacy, upstream, report.tolerance)
    return report


def _same_layout(legacy: torch.Tensor, upstream: torch.Tensor) -> bool:
    """Same strides wherever they matter: dimensions of size 1 have no meaningful stride, and tensors that are
    not strided (sparse, ...) have none."""
    if legacy.layout != torch.strided or upstream.layout != torch.strided or legacy.numel() == 0:
        return True
    return all(size == 1 or a == b for size, a, b in zip(legacy.shape, legacy.stride(), upstream.stride(), strict=True))


def _check_object(path: str, legacy: Any, upstream: Any) -> _LeafReport:
    report = _LeafReport(path, [], [])
    if type(legacy) is not type(upstream):
        report.reasons.append("type")
        report.notes.append(f"type {type(legacy).__name__} vs {type(upstream).__name__}")
        return report
    try:
        equal = legacy == upstream
        equal = bool(equal) or (isinstance(legacy, float) and math.isnan(legacy) and math.isnan(upstream))
    except Exception as exc:  # an __eq__ that raises or returns something without truth value
        equal = False
        report.notes.append(f"== raised {type(exc).__name__}")
    if not equal:
        report.reasons.append("value")
        report.notes.append(f"{bounded(repr(legacy), 80)} vs {bounded(repr(upstream), 80)}")
    report.bitwise_equal = equal
    return report


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape or (1,)):
        out.append(index % size if size else 0)
        index = index // size if size else 0
    return tuple(reversed(out))


#: Plain values whose equality is their comparison's outcome: a pair of equal ones is a match, found at once.
_ATOMS = frozenset({str, bytes, int, bool, type(None), torch.dtype, torch.device, torch.Size})
_EQUAL_ATOMS = Comparison(Outcome.MATCH.value)


def compare(
    legacy: Any,
    upstream: Any,
    *,
    tolerance: tol.ToleranceSpec = None,
    exact: bool = False,
    legacy_inputs: Any = (),
    upstream_inputs: Any = (),
) -> Comparison:
    """Compare two outputs of the same call.

    ``tolerance`` applies to floating leaves (per dtype defaults of assert_close when None); whether a tensor
    requires grad is compared too (reason ``requires_grad``);
    ``exact`` demands bitwise equality everywhere. Inputs, when given, let the comparison check that
    each output aliases the same input on both sides (or none). Waits for the device where its statistics are not
    on the host yet (:func:`start` does not).
    """
    found = start(
        legacy, upstream, tolerance=tolerance, exact=exact, legacy_inputs=legacy_inputs,
        upstream_inputs=upstream_inputs, may_defer=False,
    )  # fmt: skip
    assert isinstance(found, Comparison)  # (not deferred: read, waiting where the device has not finished)
    return found


def start(
    legacy: Any,
    upstream: Any,
    *,
    tolerance: tol.ToleranceSpec = None,
    exact: bool = False,
    legacy_inputs: Any = (),
    upstream_inputs: Any = (),
    may_defer: bool = True,
) -> Comparison | PendingComparison:
    """:func:`compare`, launched: structure, metadata and aliasing checked on the host, the values' statistics
    started on their devices and on their way to the host; nothing waits for a device. The comparison where its
    statistics are on the host already (or ``may_defer`` is false: read then, waiting for the device), else the
    :class:`PendingComparison`."""
    if type(legacy) is type(upstream) and type(legacy) in _ATOMS and legacy == upstream:
        return _EQUAL_ATOMS  # (a type name, a size: found without flattening)
    # The comparison is this tool's own work: no tensor subclass or TorchFunctionMode may see it.
    with torch._C.DisableTorchFunction():
        flattened = trees.flatten_with_paths(legacy, True), trees.flatten_with_paths(upstream, True)
        inputs = trees.leaves(legacy_inputs), trees.leaves(upstream_inputs)
        legacy_leaves, legacy_specs = _flatten(flattened[0])
        upstream_leaves, upstream_specs = _flatten(flattened[1])
        structure = _structure_note(legacy_leaves, legacy_specs, upstream_leaves, upstream_specs)
        reports = _check_leaves(legacy_leaves, upstream_leaves, tolerance, exact, *inputs)
        pending = PendingComparison(reports, structure)
    return pending if may_defer and not pending.ready() else pending.finish()


class PendingComparison:
    """A comparison whose statistics are on their way to the host: :meth:`ready` says (without waiting) whether the
    devices finished them, :meth:`finish` reads them (waiting only where they did not) into the
    :class:`Comparison`. Holds the statistics and the small leaves' host copies, never the compared tensors."""

    def __init__(self, reports: list[_LeafReport], structure: str | None) -> None:
        self._reports, self._structure, self._found = reports, structure, None
        on_device = [r.stats for r in reports if isinstance(r.stats, torch.Tensor) and r.stats.device.type != "cpu"]
        sources = {r.stats.source for r in reports if isinstance(r.stats, _HostPair)}
        self._on_device: torch.Tensor | None = None
        if on_device:
            home = on_device[0].device
            gathered = on_device[0] if len(on_device) == 1 else torch.cat([stats.to(home) for stats in on_device])
            self._on_device = _to_host(gathered)
            sources.add(home)
        self._events = []
        for device in sources:  # (each device's copies were queued on its current stream)
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device.index))
            self._events.append(event)

    def ready(self) -> bool:
        """Whether every statistic is on the host (an event query: never a wait)."""
        return all(event.query() for event in self._events)

    def finish(self) -> Comparison:
        """The comparison, once its statistics are on the host (waiting for the devices where they are not)."""
        if self._found is None:
            for event in self._events:
                if not event.query():
                    event.synchronize()
            self._found = _verdict(self._reports, self._structure, _apply_statistics(self._reports, self._on_device))
            self._reports, self._on_device, self._events = [], None, []
        return self._found


def _structure_note(
    legacy_leaves: dict[str, Any], legacy_specs: list, upstream_leaves: dict[str, Any], upstream_specs: list
) -> str | None:
    """What differs in the containers of the two outputs (None when they have the same structure)."""
    if legacy_specs == upstream_specs:
        return None
    only_legacy = sorted(set(legacy_leaves) - set(upstream_leaves))
    only_upstream = sorted(set(upstream_leaves) - set(legacy_leaves))
    described = ", ".join(
        [f"only legacy has {p or 'output'}" for p in only_legacy[:2]]
        + [f"only upstream has {p or 'output'}" for p in only_upstream[:2]]
    )
    return f"structure differs: {described or 'container types differ'}"


def _check_leaves(
    legacy_leaves: dict[str, Any],
    upstream_leaves: dict[str, Any],
    tolerance: tol.ToleranceSpec,
    exact: bool,
    legacy_inputs: list[Any],
    upstream_inputs: list[Any],
) -> list[_LeafReport]:
    """A report per pair of leaves present on both sides (``legacy_inputs``, ``upstream_inputs``: the leaves of
    each side's inputs): metadata and aliasing checked on the host, value statistics started on the tensors'
    device."""
    tensors = any(isinstance(leaf, torch.Tensor) for leaf in legacy_leaves.values())
    legacy_alias = _alias_map(legacy_inputs) if tensors else {}  # (an output without tensors aliases nothing)
    upstream_alias = _alias_map(upstream_inputs) if tensors else {}
    reports: list[_LeafReport] = []
    for path, a in legacy_leaves.items():
        if path not in upstream_leaves:
            continue
        b = upstream_leaves[path]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            report = _check_tensor(path, a, b, tolerance, exact)
            aliases = legacy_alias.get(storage_key(a)), upstream_alias.get(storage_key(b))
            if aliases[0] != aliases[1]:
                report.reasons.append("alias")
                report.notes.append("aliases input {} vs {}".format(*("no" if x is None else x for x in aliases)))
                report.bitwise_equal = False
        else:
            report = _check_object(path, a, b)
        reports.append(report)
    return reports


def _apply_statistics(
    reports: list[_LeafReport], on_device: torch.Tensor | None
) -> tuple[float, float, int, tuple[tuple[str, float], ...]]:
    """Read every leaf's statistics on the host (``on_device``: those reduced on a device, landed there, in the
    order of the reports), turn them into reasons and notes on the reports, and return (greatest abs error,
    greatest rel error, elements out of tolerance, each leaf's greatest abs error)."""
    with_stats = [r for r in reports if r.stats is not None]
    if not with_stats:
        return 0.0, 0.0, 0, ()
    landed = iter(on_device.view(-1, 8).tolist()) if on_device is not None else iter(())
    leaves = []
    max_abs = max_rel = 0.0
    mismatched = 0
    for report in with_stats:
        stats = report.stats
        if isinstance(stats, _HostPair):
            values = stats.stats().tolist()
        elif stats.device.type == "cpu":
            values = stats.tolist()
        else:
            values = next(landed)
        bitdiff, bad, nonfinite, first, abs_bits, rel_bits, at_legacy, at_upstream = values
        leaf_abs, leaf_rel = _unbits(abs_bits, report.compute), _unbits(rel_bits, report.compute)
        max_abs, max_rel = max(max_abs, leaf_abs), max(max_rel, leaf_rel)
        leaves.append((report.path, leaf_abs))
        bad = bitdiff if report.exact else bad  # (float32 cannot hold every int64 exactly)
        mismatched += bad
        report.bitwise_equal = report.bitwise_equal and bitdiff == 0
        if nonfinite:
            report.reasons.append("nan")
            report.notes.append(f"NaN/inf differ at {nonfinite} positions")
        if bad > nonfinite:
            report.reasons.append("value")
        if bad:
            where = _unravel(first, report.shape) if first >= 0 else "?"
            report.notes.append(
                f"{bad} / {report.numel} elements differ ({100.0 * bad / max(report.numel, 1):.3g}%), "
                f"first at index {where}: legacy {_unbits(at_legacy, report.compute):.9g}, "
                f"upstream {_unbits(at_upstream, report.compute):.9g}; greatest abs diff {leaf_abs:.3g}, "
                f"rel diff {leaf_rel:.3g} (rtol {report.tolerance.rtol:g}, atol {report.tolerance.atol:g})"
            )
    return max_abs, max_rel, mismatched, tuple(leaves)


def _verdict(
    reports: list[_LeafReport], structure: str | None, errors: tuple[float, float, int, tuple[tuple[str, float], ...]]
) -> Comparison:
    """The outcome: mismatch when any reason was found, match when every leaf is bitwise equal, else close."""
    reasons: set[str] = {"structure"} if structure is not None else set()
    notes: list[str] = [structure] if structure is not None else []
    for report in reports:
        reasons.update(report.reasons)
        if report.notes:
            notes.append(f"{report.path or 'output'}: " + "; ".join(report.notes))
    if reasons:
        outcome = Outcome.MISMATCH
    elif all(r.bitwise_equal for r in reports):
        outcome = Outcome.MATCH
    else:
        outcome = Outcome.CLOSE
    max_abs, max_rel, mismatched, leaves = errors
    return Comparison(
        outcome=outcome.value,
        reasons=_ordered(reasons),
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        mismatched=mismatched,
        numel=sum(r.numel for r in reports),
        detail=bounded(" | ".join(notes)) if notes else "",
        leaf_errors=leaves,
    )


def compare_exceptions(legacy_error: BaseException | None, upstream_error: BaseException | None) -> Comparison:
    """The one rule for calls where a side raised: the same exception type with the same text is a ``match``,
    with another text ``close`` (torch_npu's error-code suffix, say); a different type, or only one side
    raising, is an ``error`` with reason ``exception``."""

    def describe(side: str, exc: BaseException | None) -> str:
        # (each side bounded on its own: a long legacy text, torch_npu's error-code suffix say, never hides upstream's)
        text = f"{side} returned normally" if exc is None else f"{side} raised {type(exc).__name__}: {exc}"
        return bounded(text, DETAIL_LIMIT // 2 - 1)

    detail = f"{describe('legacy', legacy_error)}; {describe('upstream', upstream_error)}"
    if legacy_error is not None and type(legacy_error) is type(upstream_error):
        same_text = str(legacy_error) == str(upstream_error)
        return Comparison((Outcome.MATCH if same_text else Outcome.CLOSE).value, detail=detail)
    return Comparison(Outcome.ERROR.value, ("exception",), detail=detail)


def compare_custom(equality: Any, legacy: Any, upstream: Any) -> Comparison:
    """A target's own comparison (:attr:`shadow.core.model.target.Target.compare`): a ``match`` where it returns None,
    a ``close`` where it returns an :class:`~shadow.core.model.target.Alike` (its note the detail), else a
    ``mismatch`` with reason ``custom`` and its text as the detail. A comparison that raises is this tool's fault (the
    engine counts it)."""
    with torch._C.DisableTorchFunction():  # (this tool's work: no subclass or mode sees it)
        difference = equality(legacy, upstream)
    if difference is None:
        return Comparison(Outcome.MATCH.value)
    if isinstance(difference, Alike):
        return Comparison(Outcome.CLOSE.value, detail=bounded(difference.note))
    return Comparison(Outcome.MISMATCH.value, ("custom",), detail=bounded(str(difference)))


#: The characters one side's value may take in a ``state`` detail (each setting's name and both values come first).
_STATE_VALUE_LIMIT = 160


def _state_value(value: Any, other: Any) -> str:
    """One side's value of a setting, within its bound: for two sequences (warning filters, mode stacks), the
    entries only this side has and how many it has in all, so what differed is what is read."""
    if isinstance(value, (list, tuple)) and isinstance(other, (list, tuple)):
        only = [entry for entry in value if entry not in other]
        text = f"{len(value)} entries, " + (f"{len(only)} not in the other's: {only!r}" if only else "none new")
    else:
        text = str(value)
    return text if len(text) <= _STATE_VALUE_LIMIT else text[: _STATE_VALUE_LIMIT - 3] + "..."


def with_state(found: Comparison, differences: Mapping[str, tuple[Any, Any]]) -> Comparison:
    """``found`` with the torch settings and module attributes each side left behind ({setting: (legacy's,
    upstream's)} where they differ): a caller-visible side effect is behaviour, so any difference is a mismatch
    with reason ``state`` (an error stays an error). The detail names each setting and both values first, each
    within its bound, then what the comparison of the results said."""
    if not differences:
        return found
    note = "; ".join(
        f"{name}: legacy left {_state_value(a, b)}, upstream left {_state_value(b, a)}"
        for name, (a, b) in differences.items()
    )
    outcome = found.outcome if found.outcome == Outcome.ERROR.value else Outcome.MISMATCH.value
    return dataclasses.replace(
        found,
        outcome=outcome,
        reasons=_ordered((*found.reasons, "state")),
        detail=bounded(f"{note} | {found.detail}" if found.detail else note),
    )


def _ordered(reasons: Iterable[str]) -> tuple[str, ...]:
    present = set(reasons)
    return tuple(r for r in MISMATCH_REASONS if r in present)
