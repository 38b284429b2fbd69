"""The same call for a module's state and every ending: a forward that changes its module's Python state starts each
run from what legacy started from and leaves the caller's module as an unwrapped call does; the autocast flag both
legacies read is in the shadow run; every ending of a call has its state compared; a ``state`` detail names what
differed."""

import copy
import types
import warnings

import pytest
import torch
from fakes import shadowed
from torch import nn

import shadow
from shadow import Target

DEVICES = [0, 1]


class Stateful(nn.Module):
    """A forward that counts its calls in a plain attribute and steps a plain tensor attribute in place, and whose
    output depends on both (a warm-up schedule)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0
        self.steps = torch.zeros((), dtype=torch.int64)

    def forward(self, x):
        self.calls += 1
        self.steps += 1
        return self.linear(x) * self.calls + self.steps


class Counting(Stateful):
    """The same, with an output that depends on the call count alone (DataParallel's replicas share ``steps``,
    and the order their threads step it in is not fixed)."""

    def forward(self, x):
        self.calls += 1
        self.steps += 1
        return self.linear(x) * self.calls


def _attributes(module):
    return {
        name: (value.clone() if isinstance(value, torch.Tensor) else value)
        for m_name, m in module.named_modules()
        for name, value in ((f"{m_name}.{k}", v) for k, v in vars(m).items() if not k.startswith("_"))
    }


def _assert_same_attributes(module, unwrapped):
    mine, theirs = _attributes(module), _attributes(unwrapped)
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mine[name], value), name
        elif not isinstance(value, nn.Module):
            assert mine[name] == value, name


def test_a_forward_that_changes_its_modules_python_state_is_compared_from_the_same_start(legacy_patches):
    torch.manual_seed(0)
    module = Stateful().to("npu:0")
    unwrapped = copy.deepcopy(module)
    xs = [torch.randn(2, 4, device="npu:0") for _ in range(3)]
    expected = [nn.parallel.data_parallel(unwrapped, x, [0]) for x in xs]
    monitor, recorder = shadowed(["data_parallel"], truth_rate=1.0, oracle=None)
    with monitor:
        got = [nn.parallel.data_parallel(module, x, [0]) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [o.outcome for o in recorder.observations] == ["match"] * 3, [o.detail for o in recorder.observations]
    assert not any(o.nearer for o in recorder.observations)
    assert module.calls == 3 and int(module.steps) == 3
    _assert_same_attributes(module, unwrapped)


def test_parallel_apply_replicas_start_from_the_state_legacy_started_from(legacy_patches):
    torch.manual_seed(0)
    dp = nn.DataParallel(Counting().to("npu:0"), device_ids=DEVICES)
    unwrapped = copy.deepcopy(dp)
    x = torch.randn(4, 4, device="npu:0")
    expected = unwrapped(x)
    monitor, recorder = shadowed(["parallel_apply"], oracle=None)
    with monitor:
        got = dp(x)
    assert torch.equal(got, expected)
    assert [(o.outcome, o.reasons) for o in recorder.observations] == [("match", ())], recorder.observations[0].detail
    _assert_same_attributes(dp, unwrapped)


def test_attributes_the_two_sides_change_differently_are_a_state_mismatch_naming_them():
    class Mode(nn.Module):
        def __init__(self):
            super().__init__()
            self.mode = "start"
            self.scale = torch.ones(2)

    def legacy(module, x):
        module.mode = "legacy"
        module.scale.mul_(2)
        return x + 1

    def upstream(module, x):
        module.mode = "upstream"
        module.scale.mul_(2)
        return x + 1

    ops = types.SimpleNamespace(op=legacy)
    module = Mode()
    monitor, recorder = shadowed([Target("op", ops, "op", upstream)])
    with monitor:
        ops.op(module, torch.ones(2))
    (observation,) = recorder.observations
    assert (observation.outcome, observation.reasons) == ("mismatch", ("state",))
    assert observation.detail.startswith("Mode.mode: legacy left 'legacy', upstream left 'upstream'")
    assert "scale" not in observation.detail  # (doubled alike)
    assert module.mode == "legacy" and torch.equal(module.scale, torch.full((2,), 2.0))


# --------------------------------------------------------------------------- 2. the CUDA autocast flag


@pytest.fixture
def cuda_autocast_flag():
    """``torch.autocast("cuda")``'s flag, as it is set on a CUDA machine (this CPU build's autocast("cuda")
    refuses to set it), with float16 or bfloat16 on the npu."""
    states = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("npu"))

    def set_flag(npu_dtype=torch.float16):
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("npu", npu_dtype)

    yield set_flag
    torch.set_autocast_enabled("cuda", states[0])
    torch.set_autocast_dtype("npu", states[1])


def test_torch_npus_parallel_apply_under_the_cuda_autocast_flag_matches(torch_npu_legacy, cuda_autocast_flag):
    patches = torch_npu_legacy.patch_torch()
    try:
        torch.manual_seed(0)
        dp = nn.DataParallel(nn.Linear(4, 4).to("npu:0"), device_ids=DEVICES)
        x = torch.randn(4, 4, device="npu:0")
        monitor, recorder = shadowed(["parallel_apply"], oracle=None)
        with monitor:
            cuda_autocast_flag()
            out = dp(x)
        assert out.dtype == torch.float16  # (both legacies read this flag)
        (observation,) = recorder.observations
        assert (observation.outcome, observation.reasons) == ("match", ()), observation.detail
        assert "cuda=on/" in observation.signature or observation.signature  # (the flag is part of the call)
    finally:
        patches.undo()


def test_a_real_autocast_dtype_difference_under_the_cuda_flag_is_reported_as_it_is(
    torch_npu_legacy, cuda_autocast_flag
):
    patches = torch_npu_legacy.patch_torch()
    try:
        torch.manual_seed(0)
        dp = nn.DataParallel(nn.Linear(4, 4).to("npu:0"), device_ids=[0])
        x = torch.randn(4, 4, device="npu:0")
        monitor, recorder = shadowed(["parallel_apply"], oracle=None)
        with monitor:
            # (one replica runs on the caller's thread: torch_npu's autocast is float16 always, upstream's the
            # caller's npu autocast dtype)
            cuda_autocast_flag(torch.bfloat16)
            (out,) = dp.parallel_apply([dp.module], [(x,)], None)
        assert out.dtype == torch.float16
        (observation,) = recorder.observations
        assert observation.outcome == "mismatch" and "dtype" in observation.reasons
        assert "bfloat16" in observation.detail and "float32" not in observation.detail, observation.detail
    finally:
        patches.undo()


# --------------------------------------------------------------------------- 4. every ending has its state compared


class Exits(nn.Module):
    def forward(self, x):
        raise SystemExit(3)


def test_a_replica_raising_system_exit_has_the_state_it_leaves_compared(torch_npu_legacy):
    patches = torch_npu_legacy.patch_torch()
    try:
        dp = nn.DataParallel(Exits().to("npu:1"), device_ids=[1])
        x = torch.randn(2, 4, device="npu:1")
        torch.accelerator.set_device_index(0)
        unwrapped_device = None
        try:
            dp.parallel_apply([dp.module], [(x,)], None)
        except SystemExit:
            unwrapped_device = torch.accelerator.current_device_index()
        torch.accelerator.set_device_index(0)
        monitor, recorder = shadowed(["parallel_apply"], oracle=None)
        with monitor, pytest.raises(SystemExit):
            dp.parallel_apply([dp.module], [(x,)], None)
        assert torch.accelerator.current_device_index() == unwrapped_device == 1  # (legacy's set_device, kept)
        (observation,) = recorder.observations
        assert "state" in observation.reasons, observation
        assert observation.detail.startswith("current device: legacy left 1, upstream left 0"), observation.detail
    finally:
        torch.accelerator.set_device_index(0)
        patches.undo()


# --------------------------------------------------------------------------- 6. a state detail within its bound


def test_a_warning_filter_difference_names_the_filter_within_the_bound():
    def legacy(x):
        for index in range(40):  # (a long list of filters before it: the detail must still show the new one)
            warnings.filterwarnings("ignore", message=f"filler filter number {index} with a long message")
        warnings.filterwarnings("ignore", message="legacy's own filter", append=True)  # (last of 40-odd)
        return x + 1  # (a value difference too: its detail comes after the state's)

    def upstream(x):
        for index in range(40):
            warnings.filterwarnings("ignore", message=f"filler filter number {index} with a long message")
        return x

    ops = types.SimpleNamespace(op=legacy)
    monitor, recorder = shadowed([Target("op", ops, "op", upstream, isolate=False)])
    with warnings.catch_warnings(), monitor:
        ops.op(1)
    (observation,) = recorder.observations
    assert "state" in observation.reasons
    assert observation.detail.startswith("warning filters: legacy left ")
    assert "legacy's own filter" in observation.detail


# --------------------------------------------------------------------------- 5. every skipped backward comparison


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.linear, x, use_reentrant=True)


class SparseLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4, sparse=True)

    def forward(self, x):
        return self.embedding(x)


@pytest.mark.parametrize(
    ("make", "argument", "reason"),
    [
        (Checkpointed, lambda: torch.randn(2, 4, requires_grad=True), "reentrant"),
        (SparseLookup, lambda: torch.tensor([1, 2, 3]), "sparse"),
    ],
)
def test_a_backward_comparison_that_cannot_be_made_is_a_counted_reason(make, argument, reason):
    ops = types.SimpleNamespace(op=lambda module, x: module(x))
    monitor, recorder = shadowed([Target("op", ops, "op", lambda module, x: module(x))], backward_rate=1.0)
    module = make()
    with monitor, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (checkpoint's warning that no input requires grad)
        ops.op(module, argument()).sum().backward()
        stats = monitor.experiment("op").stats()
    (observation,) = recorder.observations
    assert observation.outcome == "match" and not observation.backward
    assert observation.backward_skip == reason
    assert dict(stats.backward_skips) == {reason: 1}


class Raises(nn.Module):
    def forward(self, x):
        raise ValueError("no forward here")


def _raising(module, x):
    try:
        return module(x)
    except ValueError:
        return None


@pytest.mark.parametrize(
    ("make", "upstream", "grad", "reason"),
    [
        (lambda: nn.Linear(4, 4), lambda module, x: module(x), False, "no_grad"),
        (Raises, lambda module, x: module(x), True, "raised"),
        (lambda: nn.Linear(4, 4), lambda module, x: module(x) + 1, True, "diverged"),
    ],
)
def test_every_compared_call_drawn_for_a_backward_comparison_has_one_or_a_counted_reason(make, upstream, grad, reason):
    """PyTorch's test_data_parallel at backward rate 1: 20 of 274 compared calls had no backward comparison and no
    reason (a forward that raised, a call under no_grad)."""
    ops = types.SimpleNamespace(op=lambda module, x: module(x))
    monitor, recorder = shadowed([Target("op", ops, "op", upstream)], backward_rate=1.0)
    module = make()
    with monitor, torch.set_grad_enabled(grad):
        _raising(lambda x: ops.op(module, x), torch.randn(2, 4, requires_grad=True))
        stats = monitor.experiment("op").stats()
    (observation,) = recorder.observations
    assert observation.outcome != "skipped" and not observation.backward
    assert observation.backward_skip == reason
    assert dict(stats.backward_skips) == {reason: 1}


# --------------------------------------------------------------------------- 3. the job's calls, counted as made


def _step_job(steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to("npu:0")
    dp = nn.DataParallel(model, device_ids=DEVICES)
    for _ in range(steps):
        x = torch.randn(4, 6, device="npu:0")
        out = dp(x).float()
        out.type(torch.float16)
        nn.parallel.data_parallel(model, x, device_ids=DEVICES).sum().backward()
        out.sum().backward()


def _type_calls_unwrapped():
    counted = [0]
    original = vars(torch.Tensor)["type"]

    def counting(self, *args, **kwargs):
        counted[0] += 1
        return original(self, *args, **kwargs)

    torch.Tensor.type = counting
    try:
        _step_job()
    finally:
        torch.Tensor.type = original
    return counted[0]


@pytest.mark.parametrize("first_per_signature", [0, 30])
def test_a_jobs_call_counts_are_the_calls_it_made(legacy_patches, first_per_signature):
    expected = _type_calls_unwrapped()
    with shadow.install(
        ["parallel_apply", "data_parallel", "tensor_type"],
        sample_rate={"parallel_apply": 1.0, "data_parallel": 1.0, "tensor_type": 0.01},
        first_per_signature=first_per_signature, backward_rate=1.0, truth_rate=1.0, aa_rate=1.0, seed=0,
    ) as monitor:  # fmt: skip
        _step_job()
        stats = monitor.stats()
    assert stats["parallel_apply"].calls == stats["data_parallel"].calls == 4
    assert stats["parallel_apply"].backward_runs == 4
    assert stats["tensor_type"].calls == expected > 100
