import collections
import dataclasses
import importlib
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from shadow import Tolerance
from shadow.core.judging.compare import SMALL_ON_HOST, compare

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    label: str


def test_bitwise_equal_is_match():
    x = torch.randn(100)
    assert compare(x, x.clone()).outcome == "match"


def test_within_tolerance_is_close_and_reports_errors():
    x = torch.ones(1000)
    y = x + 1e-6
    result = compare(x, y)
    assert result.outcome == "close"
    assert result.reasons == ()
    assert result.max_abs_error == pytest.approx(1e-6, rel=0.2)
    assert result.numel == 1000


@pytest.mark.parametrize(
    "dtype, rtol, atol",
    [
        (torch.float16, 1e-3, 1e-5),
        (torch.bfloat16, 1.6e-2, 1e-5),
        (torch.float32, 1.3e-6, 1e-5),
        (torch.float64, 1e-7, 1e-7),
    ],
)
def test_default_tolerances_are_assert_close_defaults(dtype, rtol, atol):
    legacy = torch.full((4,), 100.0, dtype=dtype)
    inside = legacy + (atol + rtol * 100.0) * 0.5
    outside = legacy.to(torch.float64) + (atol + rtol * 100.0) * 4
    assert compare(legacy, inside.to(dtype)).outcome in ("match", "close")
    result = compare(legacy, outside.to(dtype))
    assert result.outcome == "mismatch" and result.reasons == ("value",)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(outside.to(dtype), legacy)


def test_value_mismatch_says_where_and_by_how_much():
    legacy = torch.zeros(3, 4)
    upstream = legacy.clone()
    upstream[1, 2] = 0.5
    result = compare(legacy, upstream)
    assert result.outcome == "mismatch" and result.reasons == ("value",)
    assert result.mismatched == 1
    assert result.max_abs_error == 0.5
    assert "(1, 2)" in result.detail and "legacy 0" in result.detail and "upstream 0.5" in result.detail
    assert "1 / 12 elements" in result.detail


def test_integers_compare_exactly():
    legacy = torch.arange(10)
    assert compare(legacy, legacy.clone()).outcome == "match"
    result = compare(legacy, legacy + torch.eye(10, dtype=torch.long)[3])
    assert result.reasons == ("value",) and result.mismatched == 1


def test_nan_positions_must_agree():
    legacy = torch.tensor([1.0, float("nan"), 3.0])
    assert compare(legacy, legacy.clone()).outcome == "match"
    moved = torch.tensor([float("nan"), 2.0, 3.0])
    result = compare(legacy, moved)
    assert "nan" in result.reasons
    assert compare(legacy, legacy.clone(), tolerance=Tolerance(1e-3, 1e-3, equal_nan=False)).reasons == ("nan",)


def test_infinities_must_agree_in_sign():
    legacy = torch.tensor([float("inf"), 1.0])
    assert compare(legacy, legacy.clone()).outcome == "match"
    assert "nan" in compare(legacy, torch.tensor([float("-inf"), 1.0])).reasons
    assert "nan" in compare(legacy, torch.tensor([1e30, 1.0])).reasons


def test_metadata_mismatches():
    x = torch.ones(2, 3)
    assert compare(x, x.half()).reasons == ("dtype",)
    assert compare(x, torch.ones(3, 2)).reasons == ("shape",)
    assert compare(x, x.to("meta")).reasons == ("device",)
    assert compare(x, x.to_sparse()).reasons == ("type",)
    assert compare(x, torch.nn.Parameter(x.clone(), requires_grad=False)).reasons == ("type",)
    assert compare(x, x.clone().requires_grad_()).reasons == ("requires_grad",)


def test_dtype_mismatch_still_reports_values():
    x = torch.tensor([1.0001, 2.0])
    result = compare(x, x.half())
    assert result.reasons == ("dtype",)
    assert result.max_abs_error > 0
    assert "float32 vs torch.float16" in result.detail


def test_structure_of_nested_outputs():
    x = torch.ones(2)
    assert compare((x, [x, {"a": x}]), (x, [x, {"a": x}])).outcome == "match"
    result = compare((x, [x, {"a": x}]), (x, [x, {"b": x}]))
    assert result.reasons == ("structure",)
    assert "only legacy has" in result.detail
    assert compare((x, x), [x, x]).reasons == ("structure",)
    assert compare(Pair(x, x), (x, x)).reasons == ("structure",)


def test_dataclasses_are_opened():
    x = torch.ones(2)
    assert compare(Result(x, "a"), Result(x.clone(), "a")).outcome == "match"
    result = compare(Result(x, "a"), Result(x + 1, "a"))
    assert result.reasons == ("value",)
    assert "logits" in result.detail
    assert compare(Result(x, "a"), Result(x, "b")).reasons == ("value",)


def test_non_tensor_leaves():
    assert compare("torch.FloatTensor", "torch.FloatTensor").outcome == "match"
    assert compare("torch.FloatTensor", "torch.HalfTensor").reasons == ("value",)
    assert compare(1, 1.0).reasons == ("type",)
    assert compare(torch.ones(1), [1.0]).reasons == ("structure",)
    assert compare(float("nan"), float("nan")).outcome == "match"


@pytest.mark.parametrize(
    "value", ["torch.npu.FloatTensor", b"x", 3, True, None, torch.float16, torch.device("cpu"), torch.Size([2, 3])]
)
def test_equal_plain_values_compare_as_their_full_comparison_would(value):
    """A pair of equal plain values (a type name, a size) is found a match without flattening: the same outcome,
    errors and detail as the full comparison (the value inside a list takes the full path), and a pair that differs
    still says how."""
    quick, full = compare(value, value), compare([value], [value])
    assert quick.outcome == full.outcome == "match"
    assert (quick.reasons, quick.numel, quick.detail, quick.mismatched, quick.leaf_errors) == (
        full.reasons, full.numel, full.detail, full.mismatched, full.leaf_errors,
    )  # fmt: skip
    assert compare(value, "another value").outcome == "mismatch"
    assert compare(True, 1).reasons == ("type",)  # (equal, of different types: the full path)


def test_aliasing_is_compared_against_each_sides_inputs():
    legacy_input, upstream_input = torch.ones(3), torch.ones(3)
    same = compare(legacy_input, upstream_input, legacy_inputs=(legacy_input,), upstream_inputs=(upstream_input,))
    assert same.outcome == "match"
    result = compare(
        legacy_input, upstream_input.clone(), legacy_inputs=(legacy_input,), upstream_inputs=(upstream_input,)
    )
    assert result.reasons == ("alias",)
    view = compare(
        legacy_input[1:], upstream_input[1:], legacy_inputs=(legacy_input,), upstream_inputs=(upstream_input,)
    )
    assert view.outcome == "match"


def test_exact_mode_rejects_anything_not_bitwise_equal():
    x = torch.tensor([0.0, 1.0])
    assert compare(x, torch.tensor([-0.0, 1.0])).outcome == "close"
    assert compare(x, torch.tensor([-0.0, 1.0]), exact=True).reasons == ("value",)


def test_complex_and_bool():
    c = torch.randn(4, dtype=torch.complex64)
    assert compare(c, c.clone()).outcome == "match"
    assert compare(c, c + 1j).reasons == ("value",)
    b = torch.tensor([True, False])
    assert compare(b, b.clone()).outcome == "match"
    assert compare(b, ~b).reasons == ("value",)


def test_large_tensors_are_chunked_and_still_find_the_first_difference():
    legacy = torch.randn(3 * (1 << 18) + 5)
    upstream = legacy.clone()
    upstream[-2] += 1.0
    upstream[(1 << 18) + 1] += 0.25
    result = compare(legacy, upstream)
    assert result.mismatched == 2
    assert result.max_abs_error == pytest.approx(1.0, rel=1e-6)
    assert f"first at index ({(1 << 18) + 1},)" in result.detail  # in the second chunk, before the larger one
    assert f"upstream {upstream[(1 << 18) + 1].item():.9g}" in result.detail


def test_many_leaves_on_a_device_cost_one_host_synchronisation_and_none_before_they_are_read():
    """On the emulated npu with an asynchronous queue: launching a comparison of small and large leaves makes the
    host wait for nothing; reading it waits once (one device), however many leaves; and the result is the host's."""
    from shadow.core.judging.compare import start
    from shadow.npu import emulated

    big = torch.randn(SMALL_ON_HOST + 5)
    legacy = {"a": torch.randn(5), "b": [big, torch.arange(4)], "c": torch.randn(2).half()}
    upstream = {"a": legacy["a"] + 1, "b": [big.clone(), torch.arange(4)], "c": legacy["c"].clone()}
    on_host = compare(legacy, upstream)
    on_npu = [tree_map(lambda t: t.to("npu:0"), side) for side in (legacy, upstream)]
    emulated.set_kernel_time(0.05)
    try:
        before = emulated.host_syncs()
        pending = start(*on_npu)
        launched = emulated.host_syncs()
        found = pending.finish()
        read = emulated.host_syncs()
    finally:
        emulated.set_kernel_time(0.0)
    assert launched[0] == before[0]  # (started: nothing waited for)
    assert read[0] - launched[0] == 1  # (read: one wait, for every leaf)
    assert found == on_host and found.reasons == ("value",)


def test_large_integers_compare_exactly_not_through_float32():
    legacy = torch.tensor([2**40, 7], dtype=torch.int64)
    upstream = torch.tensor([2**40 + 1, 7], dtype=torch.int64)  # equal once rounded to float32
    result = compare(legacy, upstream)
    assert result.outcome == "mismatch" and result.reasons == ("value",) and result.mismatched == 1


@pytest.mark.parametrize(
    "layout",
    [
        lambda t: t.t(),  # non-contiguous: transposed
        lambda t: t.reshape(2, 3, 2, 2).contiguous(memory_format=torch.channels_last),
        lambda t: t[:1].expand(4, 6),  # zero strides
    ],
    ids=["transposed", "channels_last", "expanded"],
)
def test_strides_are_behaviour_for_exact_targets(layout):
    """Equal values, other strides: .view() works on one and raises on the other, so an exact target mismatches."""
    base = torch.arange(24.0).reshape(4, 6)
    legacy = layout(base)
    upstream = legacy.contiguous()
    assert legacy.stride() != upstream.stride()
    exact = compare(legacy, upstream, exact=True)
    assert exact.outcome == "mismatch"
    assert exact.reasons == ("stride",)
    assert f"strides {legacy.stride()} vs {upstream.stride()}" in exact.detail
    tolerant = compare(legacy, upstream)
    assert tolerant.outcome == "match"  # the values are bitwise equal; the layout is noted
    assert "strides" in tolerant.detail and "layout only" in tolerant.detail


def test_strides_of_size_one_dimensions_do_not_matter():
    a = torch.randn(1, 5)
    b = torch.as_strided(a.clone(), (1, 5), (99, 1))
    assert compare(a, b, exact=True).outcome == "match"


# --------------------------------------------------------------------------- host and device statistics

_compare_module = importlib.import_module("shadow.core.judging.compare")


def _special_pair(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair with every kind of element: close, far, equal, signed zeros, NaN (one or both sides, bit-equal or
    not), equal and opposite infinities, infinity against a finite value, zero legacy."""
    generator = torch.Generator().manual_seed(seed)
    legacy = torch.randn(n, generator=generator, dtype=torch.float64)
    upstream = legacy * (1 + 1e-7 * torch.randn(n, generator=generator, dtype=torch.float64))
    picks = torch.randperm(n, generator=generator)[:80].view(10, 8)
    nan, inf = math.nan, math.inf
    specials = [(nan, nan), (nan, 1.0), (2.0, nan), (inf, inf), (-inf, inf), (inf, 3.0), (4.0, -inf), (0.0, -0.0),
                (0.0, 1e-6), (5.0, 9.0)]  # fmt: skip
    for (x, y), where in zip(specials, picks, strict=True):
        legacy[where], upstream[where] = x, y
    legacy, upstream = legacy.to(dtype), upstream.to(dtype)
    nan_bits = torch.tensor(nan, dtype=dtype)
    upstream[picks[0, :4]] = -nan_bits  # NaN with another sign bit: not bit-equal
    return legacy, upstream


_DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float64, torch.float32),
]
_TOLERANCES = [Tolerance(1.3e-6, 1e-5), Tolerance(0.0, 0.0), Tolerance(0.1, 0.5)]


@pytest.mark.parametrize("equal_nan", [True, False])
@pytest.mark.parametrize("legacy_dtype, upstream_dtype", _DTYPE_PAIRS)
def test_host_and_device_statistics_agree(monkeypatch, legacy_dtype, upstream_dtype, equal_nan):
    """The host path (numpy, chunked) and the device path (torch, whole tensors) give the same statistics."""
    monkeypatch.setattr(_compare_module, "_HOST_CHUNK", 1000)  # several chunks, the last one short
    for seed in range(3):
        legacy, upstream = _special_pair(torch.float64, 4321, seed)
        legacy, upstream = legacy.to(legacy_dtype), upstream.to(upstream_dtype)
        for tolerance in (Tolerance(1.3e-6, 1e-5, equal_nan), Tolerance(0.0, 0.0, equal_nan), Tolerance(0.1, 0.5)):
            compute = _compare_module._compute_dtype(legacy.dtype, upstream.dtype)
            same = legacy.dtype == upstream.dtype
            host = _compare_module._host_stats(legacy, upstream, tolerance, compute, same).tolist()
            device = _compare_module._device_stats(legacy, upstream, tolerance, compute, same).tolist()
            assert host == device, (seed, tolerance)
            assert host[1] > host[2] > 0  # out of tolerance, some of them with NaN or inf


def test_bit_equal_nan_disagrees_unless_equal_nan():
    legacy = torch.tensor([1.0, math.nan])
    upstream = legacy.clone()  # the same NaN, bit for bit
    assert compare(legacy, upstream, tolerance=Tolerance(1e-3, 1e-3, equal_nan=False)).reasons == ("nan",)
    assert compare(legacy, upstream, tolerance=Tolerance(1e-3, 1e-3, equal_nan=True)).outcome == "match"


def test_conjugate_and_negative_views_are_compared_by_value():
    z = torch.randn(6, dtype=torch.complex64)
    assert compare(z.conj(), z.conj().resolve_conj()).outcome == "match"
    assert compare(z.conj().imag, -z.imag).outcome == "match"  # a negative view


def test_host_comparison_does_the_same_torch_work_whatever_the_size():
    """On the CPU the values are reduced by numpy on one thread: the torch operations a comparison dispatches
    (each a parallel region that waits for every core, busy or not) do not grow with the tensors."""

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (1_000, 2_000_000):
        legacy = torch.randn(n)
        upstream = legacy + 1e-7
        with CountOps() as mode:
            result = compare(legacy, upstream)
        assert result.outcome == "close"
        counts.append(mode.ops)
    assert counts[0] == counts[1] <= 30, counts


# --------------------------------------------------------------------------- fused kernels

_fused = importlib.import_module("shadow.core.judging.fused")


@pytest.mark.parametrize("equal_nan", [True, False])
@pytest.mark.parametrize("legacy_dtype, upstream_dtype", _DTYPE_PAIRS)
def test_the_emulated_npus_fused_kernel_gives_the_host_statistics(legacy_dtype, upstream_dtype, equal_nan):
    kernel = _fused.kernel_for("npu")
    assert kernel is not None  # (the emulated npu is installed in every test process)
    for seed in range(3):
        legacy, upstream = _special_pair(torch.float64, 40_000, seed)  # (more than one of the kernel's chunks)
        legacy, upstream = legacy.to(legacy_dtype), upstream.to(upstream_dtype)
        on_npu = legacy.to("npu:1"), upstream.to("npu:1")
        for tolerance in _TOLERANCES:
            tolerance = dataclasses.replace(tolerance, equal_nan=equal_nan)
            compute = _compare_module._compute_dtype(legacy.dtype, upstream.dtype)
            same = legacy.dtype == upstream.dtype
            host = _compare_module._host_stats(legacy, upstream, tolerance, compute, same).tolist()
            fused = kernel(*on_npu, tolerance, compute, same)
            assert fused.device == on_npu[0].device
            assert fused.cpu().tolist() == host, (seed, tolerance)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_integers_bools_and_complex_compare_on_the_emulated_npu_as_on_the_host(dtype, recwarn):
    generator = torch.Generator().manual_seed(3)
    legacy = torch.randn(SMALL_ON_HOST * 2, generator=generator, dtype=torch.complex64) * 50
    legacy = legacy if dtype.is_complex else legacy.real.to(dtype)
    upstream = legacy.clone()
    upstream[SMALL_ON_HOST + 7] = upstream[3]  # (a difference, unless the two were equal)
    upstream[-1:] = ~upstream[-1:] if dtype == torch.bool else upstream[-1:] + 1
    on_host = compare(legacy, upstream)
    assert on_host.outcome == "mismatch"
    assert compare(legacy.to("npu:0"), upstream.to("npu:0")) == on_host
    assert not [str(w.message) for w in recwarn]  # (a view that fell back to the CPU would say so)


def test_a_large_leaf_on_the_emulated_npu_is_one_kernel_of_the_device(monkeypatch):
    """On the emulated npu, the kernels a comparison queues are counted where a device's profiler would: a large leaf
    is one pass (its fused kernel; then a copy of its statistics to the host), not torch's twenty-odd reductions
    (what the eager reduction queues, counted alike)."""
    from shadow.npu import emulated

    legacy = torch.randn(SMALL_ON_HOST * 4, device="npu:0")
    upstream = legacy + 1e-3
    before = emulated.kernels()
    found = compare(legacy, upstream)
    fused = emulated.kernels() - before

    monkeypatch.setattr(_fused, "_emulated_npu", lambda *args: None)  # (no fused kernel: torch's reductions)
    before = emulated.kernels()
    eager = compare(legacy, upstream)
    reductions = emulated.kernels() - before
    assert fused == 1 and reductions > 20, (fused, reductions)
    assert found == eager == compare(legacy.cpu(), upstream.cpu())


def test_a_fused_kernel_that_fails_gives_way_to_the_eager_reduction(monkeypatch):
    tried = []

    def broken(*args):
        tried.append(args)
        raise RuntimeError("no compiler on this host")

    monkeypatch.setattr(_fused, "_emulated_npu", broken)
    monkeypatch.setattr(_fused, "FAILURES", {})
    legacy = torch.randn(SMALL_ON_HOST * 2)
    upstream = legacy * (1 + 1e-3)
    on_host = compare(legacy, upstream)
    assert [compare(legacy.to("npu:0"), upstream.to("npu:0")) for _ in range(2)] == [on_host, on_host]
    assert len(tried) == 1  # (given up after its failure, for this process)
    assert _fused.FAILURES == {"npu": "RuntimeError: no compiler on this host"}


_TRITON_CHECK = """
import dataclasses, sys, torch
sys.path.insert(0, sys.argv[1])
from test_compare import _DTYPE_PAIRS, _TOLERANCES, _compare_module, _special_pair
from shadow.core.judging import triton_pass

checked = 0
for legacy_dtype, upstream_dtype in _DTYPE_PAIRS:
    if torch.float64 in (legacy_dtype, upstream_dtype):
        continue  # (computed in float64: the eager reduction's)
    for seed in range(2):
        legacy, upstream = _special_pair(torch.float64, 5000, seed)
        legacy, upstream = legacy.to(legacy_dtype), upstream.to(upstream_dtype)
        same = legacy_dtype == upstream_dtype
        for tolerance in _TOLERANCES:
            for equal_nan in (True, False):
                tolerance = dataclasses.replace(tolerance, equal_nan=equal_nan)
                host = _compare_module._host_stats(legacy, upstream, tolerance, torch.float32, same).tolist()
                fused = triton_pass.leaf_statistics(legacy, upstream, tolerance.rtol, tolerance.atol, equal_nan, same)
                assert fused.tolist() == host, (legacy_dtype, upstream_dtype, seed, tolerance, fused.tolist(), host)
                checked += 1
print("checked", checked)
"""


@pytest.mark.slow
def test_the_triton_pass_gives_the_host_statistics():
    """The CUDA kernel's logic, run by Triton's interpreter on the host (CI has no GPU; the device check runs the
    compiled kernel on one)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK, os.path.dirname(__file__)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["checked", str(4 * 2 * 3 * 2)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_triton_pass_compiles_for_a_gpu_without_a_warning(dtype):
    """Triton's own compiler (and ptxas, which its wheel carries) builds both kernels for an H100/H200 (sm_90) here,
    where there is no GPU: what the interpreter cannot check (types, bit casts, int64 atomics) is checked so."""
    triton = pytest.importorskip("triton")
    import warnings

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shadow.core.judging import triton_pass

    pointers = {"legacy": f"*{dtype}", "upstream": f"*{dtype}", "out": "*i64", "n": "i32"}
    flags = {"EQUAL_NAN": True, "BITWISE": True, "BITS": triton_pass._BITS[4 if dtype == "fp32" else 2]}
    signature = {**pointers, "rtol": "fp32", "atol": "fp32", **dict.fromkeys([*flags, "BLOCK"], "constexpr")}
    constants = {(list(signature).index(name),): value for name, value in {**flags, "BLOCK": triton_pass.BLOCK}.items()}
    target, options = GPUTarget("cuda", 90, 32), {"enable_fp_fusion": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for source in (
            ASTSource(fn=triton_pass._leaf_pass, signature=signature, constexprs=constants),
            ASTSource(fn=triton_pass._leaf_finish, signature=pointers, constexprs={}),
        ):
            assert triton.compile(source, target=target, options=options).asm["cubin"]
