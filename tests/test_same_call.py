"""Promise 2: the shadow run is the same call in the same context (grad mode, torch's own modes, the starting
state), nested patched calls follow one rule on every thread, and what the monitor cannot undo it does not run.

Each test names the point of the issue it covers ("same call" 1-8)."""

import gc
import types

import pytest
import torch
import torch.nn.utils.prune
from fakes import Recorder
from torch import nn

import shadow
from shadow import Target

DEVICES = [0, 1]


def shadowed(targets, **options):
    recorder = Recorder()
    monitor = shadow.install(targets, sample_rate=1.0, exporters=[recorder], **options)
    return monitor, recorder


# --------------------------------------------------------------------------- 1. grad mode


class NeedsGrad(nn.Module):
    """A forward that only works with grad on, as force-field models are: forces are -dE/dx."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        assert torch.is_grad_enabled(), "this forward needs grad mode"
        x = x.detach().requires_grad_(True)
        energy = self.linear(x).pow(2).sum()
        (forces,) = torch.autograd.grad(energy, x, create_graph=True)
        return -forces


def test_upstream_runs_in_the_callers_grad_mode(legacy_patches):
    torch.manual_seed(0)
    dp = nn.DataParallel(NeedsGrad().to("npu:0"), device_ids=DEVICES)
    x = torch.randn(4, 4, device="npu:0")
    monitor, recorder = shadowed(["parallel_apply", "data_parallel"], oracle=1.0)
    with monitor:
        for _ in range(2):
            out = dp(x)
            nn.parallel.data_parallel(dp.module, x, DEVICES)
    assert out.requires_grad
    # (its forward reads its own graph: a shadow run that keeps no activations finds nothing there, so the first
    # call of each is skipped, and its signature's shadow runs keep them from then on)
    first = {o.target: (o.outcome, o.reasons) for o in recorder.observations[:2]}
    assert first == {"parallel_apply": ("skipped", ("ineligible",)), "data_parallel": ("skipped", ("ineligible",))}
    outcomes = {o.target: (o.outcome, o.reasons, o.shared_divergence) for o in recorder.observations[2:]}
    assert outcomes == {"parallel_apply": ("match", (), ""), "data_parallel": ("match", (), "")}


def test_upstream_runs_in_the_callers_inference_mode():
    modes = []

    def legacy(module, x):
        return module(x)

    def upstream(module, x):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return module(x)

    ops = types.SimpleNamespace(op=legacy)
    monitor, recorder = shadowed([Target("op", ops, "op", upstream)])
    module = nn.Linear(3, 3)
    with monitor:
        with torch.inference_mode():
            out = ops.op(module, torch.randn(2, 3))
        ops.op(module, torch.randn(2, 3))
    assert out.is_inference()
    assert modes == [(True, False), (False, True)]
    assert [o.outcome for o in recorder.observations] == ["match", "match"]


def test_a_grad_dependent_model_is_not_rolled_back(legacy_patches, tmp_path):
    from exporters import JsonlExporter
    from shadow.analysis import sources
    from shadow.analysis.verdict import decide

    dp = nn.DataParallel(NeedsGrad().to("npu:0"), device_ids=DEVICES)
    journal = tmp_path / "j.jsonl"
    exporter = JsonlExporter(str(journal), all_outcomes=True)
    with shadow.install(["parallel_apply"], sample_rate=1.0, exporters=[exporter]):
        for _ in range(5):
            dp(torch.randn(4, 4, device="npu:0"))
    exporter.close()
    counts = sources.from_journal([str(journal)])["parallel_apply"]
    decision = decide("parallel_apply", counts, max_rate=0.001)
    assert (decision.compared, decision.divergent, decision.hard) == (4, 0, {})  # (the first: its graph, ineligible)
    assert decision.decision == "inconclusive"  # 5 calls are too few to promote, and none diverged


def test_the_fused_fast_path_is_taken_by_both_sides_or_neither(legacy_patches):
    """nn.TransformerEncoderLayer in eval() takes its fused path only when grad is off or nothing requires grad:
    an upstream run under no_grad alone would take it and differ in the last bits."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True).to("npu:0").eval()
    dp = nn.DataParallel(layer, device_ids=DEVICES)
    x = torch.randn(4, 5, 16, device="npu:0")
    monitor, recorder = shadowed(["parallel_apply"], oracle=None)
    with monitor:
        dp(x)
    (observation,) = recorder.observations
    assert observation.outcome == "match", observation.detail


def test_pytorchs_data_parallel_no_grad_holds_under_the_monitor(legacy_patches):
    """PyTorch's test_data_parallel_no_grad (test/distributed/test_data_parallel.py), cuda -> npu."""

    class Layer(nn.Module):
        def forward(self, x):
            assert not torch.is_grad_enabled()
            return x

    layer = Layer()
    i = torch.randn(20, 10, dtype=torch.float, device="npu")
    monitor, recorder = shadowed(["data_parallel", "parallel_apply"])
    with monitor:
        with torch.no_grad():
            nn.parallel.data_parallel(layer, i, (0, 1))
        with pytest.raises(AssertionError):
            nn.parallel.data_parallel(layer, i, (0, 1))
    divergent = [o for o in recorder.observations if o.outcome in ("mismatch", "error")]
    assert not divergent, divergent
    assert len(recorder.of("data_parallel")) == 2


def test_requires_grad_is_part_of_the_comparison():
    def legacy(x):
        return x * 2

    def upstream(x):
        return (x * 2).detach()

    ops = types.SimpleNamespace(op=legacy)
    monitor, recorder = shadowed([Target("op", ops, "op", upstream)])
    x = torch.ones(3, requires_grad=True)
    with monitor:
        out = ops.op(x)
        with torch.no_grad():
            ops.op(x)  # no grad: neither requires grad
    assert out.grad_fn is not None
    first, second = recorder.observations
    assert first.outcome == "mismatch" and first.reasons == ("requires_grad",)
    assert "requires_grad True vs False" in first.detail
    assert second.outcome == "match"


def test_the_upstream_graph_never_reaches_the_callers_tensors():
    seen = []

    def legacy(module, x):
        return module(x)

    def upstream(module, x):
        out = module(x)
        seen.append(out)
        out.sum().backward()  # upstream's own backward must not touch the caller's leaves
        return out

    ops = types.SimpleNamespace(op=legacy)
    module = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    monitor, recorder = shadowed([Target("op", ops, "op", upstream)])
    with monitor:
        ops.op(module, x)  # (upstream reads its graph: ineligible once, its activations kept from then on)
        out = ops.op(module, x)
    assert [o.outcome for o in recorder.observations] == ["skipped", "match"]
    assert module.weight.grad is None and x.grad is None
    assert seen[1].requires_grad and seen[1].grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(module.weight.grad, torch.ones(3, 1) * x.detach().sum(0), rtol=0, atol=1e-6)


def test_tensor_type_runs_upstream_in_grad_mode_on_a_detached_leaf(legacy_patches):
    x = torch.randn(3, device="npu:0", requires_grad=True)
    monitor, recorder = shadowed(["tensor_type"])
    with monitor:
        y = x.type(torch.float16)
    assert y.grad_fn is not None
    assert [o.outcome for o in recorder.observations] == ["match"]


# --------------------------------------------------------------------------- 2. nested calls by rule


class CastsInForward(nn.Module):
    def forward(self, x):
        return x.type("torch_npu.npu.HalfTensor").float() * 2


@pytest.mark.parametrize("batch", [1, 2], ids=["one replica", "two replicas"])
def test_a_nested_divergence_is_reported_against_its_own_target(torch_npu_legacy, batch):
    """torch_npu's legacy accepts the 'torch_npu.npu.*' spelling, upstream Tensor.type does not: that divergence
    belongs to tensor_type, never to the parallel_apply call whose forward made it, on any thread."""
    patches = torch_npu_legacy.patch_torch()
    try:
        dp = nn.DataParallel(CastsInForward(), device_ids=DEVICES)
        monitor, recorder = shadowed(["parallel_apply", "tensor_type"], oracle=1.0)
        with monitor:
            dp(torch.randn(batch, 4, device="npu:0"))
    finally:
        patches.undo()
    (parallel,) = recorder.of("parallel_apply")
    assert (parallel.outcome, parallel.shared_divergence) == ("match", ""), parallel.detail
    assert parallel.oracle_seconds > 0 and monitor.stats()["parallel_apply"].oracle_runs == 1
    casts = recorder.of("tensor_type")
    assert len(casts) == batch  # the calls legacy's replicas made, as the job makes them unwrapped
    assert all(o.outcome == "error" and o.signature.startswith("torch_npu_name/") for o in casts)
    assert monitor.stats()["tensor_type"].calls == batch


# --------------------------------------------------------------------------- 3. the oracle with a negative dim


def test_the_oracle_handles_a_negative_dim(legacy_patches):
    module = nn.Identity()
    x = torch.randn(3, 4, device="npu:0")
    monitor, recorder = shadowed(["data_parallel"], oracle=1.0)
    with monitor:
        out = nn.parallel.data_parallel(module, x, DEVICES, dim=-1)
    assert out.shape == (3, 4)
    (observation,) = recorder.observations
    assert observation.outcome == "match" and observation.oracle_seconds > 0
    assert observation.shared_divergence == "", observation.shared_detail


# --------------------------------------------------------------------------- 4. no reference cycles


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("batch", [1, 4])
def test_pytorchs_no_refcycles_test_holds_under_the_monitor(legacy_patches, batch):
    """PyTorch's test_data_parallel_model_no_refcycles, cuda -> npu, at sample rate 1 with the oracle."""
    model = nn.DataParallel(OneLinear().to("npu:0"))
    data = torch.randn(batch, 1, device="npu:0")
    monitor, recorder = shadowed(["parallel_apply", "tensor_type"], oracle=1.0)
    with monitor:
        model(data)  # warm-up: first-use caches are not cycles of a call
        gc.collect()
        gc.disable()
        try:
            model(data)
            refcycles = gc.collect()
        finally:
            gc.enable()
    assert refcycles == 0
    assert recorder.observations  # the calls were compared


def test_a_compared_mismatch_leaves_no_cycle():
    ops = types.SimpleNamespace(op=lambda x: {"a": [x * 2, (x, 3)]})
    target = Target("op", ops, "op", lambda x: {"a": [x * 3, (x, 3)]})
    monitor, recorder = shadowed([target])
    with monitor:
        ops.op(torch.ones(3))
        gc.collect()
        gc.disable()
        try:
            ops.op(torch.ones(3))
            refcycles = gc.collect()
        finally:
            gc.enable()
    assert recorder.observations[-1].outcome == "mismatch"
    assert refcycles == 0


# --------------------------------------------------------------------------- 5. side effects are behaviour


@pytest.mark.parametrize("how", ["DataParallel", "parallel_apply", "data_parallel"])
def test_the_current_device_legacy_leaves_behind_is_compared(legacy_patches, how):
    """With one replica legacy runs its worker in the caller's thread, and its set_device stays; upstream's does
    not. The caller still ends where legacy left it."""
    torch.manual_seed(0)
    module = nn.Linear(4, 4).to("npu:1")
    x = torch.randn(1, 4, device="npu:1")
    target = "data_parallel" if how == "data_parallel" else "parallel_apply"
    monitor, recorder = shadowed([target], oracle=None)
    torch.accelerator.set_device_index(0)
    try:
        with monitor:
            if how == "DataParallel":
                nn.DataParallel(module, device_ids=[1, 0])(x)
            elif how == "parallel_apply":
                nn.DataParallel(module, device_ids=[1, 0]).parallel_apply([module], [(x,)], None)
            else:
                nn.parallel.data_parallel(module, x, [1, 0])
        after = torch.accelerator.current_device_index()
    finally:
        torch.accelerator.set_device_index(0)
    assert after == 1  # legacy's side effect is the caller's, as unwrapped
    (observation,) = recorder.observations
    assert observation.outcome == "mismatch" and observation.reasons == ("state",)
    assert "current device: legacy left 1, upstream left 0" in observation.detail


def test_upstream_starts_from_the_state_the_caller_had_before_the_call():
    starts = []

    def legacy(x):
        torch.set_default_dtype(torch.float64)
        return x + 1

    def upstream(x):
        starts.append(torch.get_default_dtype())
        return x + 1

    ops = types.SimpleNamespace(op=legacy)
    monitor, recorder = shadowed([Target("op", ops, "op", upstream)])
    try:
        with monitor:
            ops.op(torch.ones(2))
        assert torch.get_default_dtype() == torch.float64  # legacy's
    finally:
        torch.set_default_dtype(torch.float32)
    assert starts == [torch.float32]
    (observation,) = recorder.observations
    assert observation.reasons == ("state",) and "default dtype" in observation.detail


# --------------------------------------------------------------------------- 6. torch's own modes


def test_a_default_device_is_torchs_own_mode_and_the_call_is_compared(legacy_patches):
    torch.set_default_device("npu")
    try:
        x = torch.randn(4, 4)
        dp = nn.DataParallel(nn.Linear(4, 4), device_ids=DEVICES)
        monitor, recorder = shadowed(["parallel_apply", "tensor_type"], oracle=None)
        with monitor:
            dp(x)
            x.type(torch.float16)
            x.type("torch.npu.HalfTensor")
    finally:
        torch.set_default_device(None)
    outcomes = [(o.target, o.outcome) for o in recorder.observations]
    assert ("parallel_apply", "match") in outcomes and ("tensor_type", "match") in outcomes
    assert not any(o.outcome == "skipped" for o in recorder.observations), outcomes


def test_a_users_mode_still_skips():
    from torch.overrides import TorchFunctionMode

    class Users(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ops = types.SimpleNamespace(op=lambda x: x * 2)
    monitor, recorder = shadowed([Target("op", ops, "op", lambda x: x * 2)])
    with monitor, Users():
        ops.op(torch.ones(2))
    assert [o.reasons for o in recorder.observations] == [("mode",)]


# --------------------------------------------------------------------------- 7. hooks and plain attributes


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.last_batch = x.shape[0]
        return self.linear(x)


def test_plain_attributes_a_forward_sets_are_set_once(legacy_patches):
    module = Counted().to("npu:0")
    monitor, recorder = shadowed(["data_parallel"], oracle=1.0)
    with monitor:
        nn.parallel.data_parallel(module, torch.randn(2, 4, device="npu:0"), [0])
        nn.parallel.data_parallel(module, torch.randn(3, 4, device="npu:0"), [0])
    assert module.calls == 2 and module.last_batch == 3
    assert [o.outcome for o in recorder.observations] == ["match", "match"]


def test_a_user_forward_hook_skips_the_call_and_runs_once_per_forward(legacy_patches):
    features = []
    model = Counted().to("npu:0")
    handle = model.linear.register_forward_hook(lambda m, i, o: features.append(o.detach()))
    dp = nn.DataParallel(model, device_ids=DEVICES)
    monitor, recorder = shadowed(["parallel_apply", "data_parallel"], oracle=1.0)
    with monitor:
        dp(torch.randn(4, 4, device="npu:0"))
        nn.parallel.data_parallel(model, torch.randn(4, 4, device="npu:0"), DEVICES)
    handle.remove()
    assert len(features) == 4  # two replicas, two calls: what the job sees unwrapped
    assert [(o.outcome, o.reasons) for o in recorder.observations] == [("skipped", ("hooks",))] * 2
    assert monitor.stats()["parallel_apply"].by_reason == {"hooks": 1}


def test_the_verdict_shows_hook_skips_as_missing_coverage(tmp_path):
    from exporters import JsonlExporter
    from shadow.analysis import sources
    from shadow.analysis.verdict import decide

    ops = types.SimpleNamespace(op=lambda module, x: module(x))
    model = nn.Linear(4, 4)
    handle = model.register_forward_hook(lambda m, i, o: None)
    exporter = JsonlExporter(str(tmp_path / "j.jsonl"), all_outcomes=True)
    with shadow.install([Target("op", ops, "op", lambda module, x: module(x))], sample_rate=1.0, exporters=[exporter]):
        ops.op(model, torch.randn(2, 4))
        handle.remove()
        for _ in range(700):  # enough clean comparisons to promote at 1%, were it not for the skipped call
            ops.op(model, torch.randn(2, 4))
    exporter.close()
    counts = sources.from_journal([str(tmp_path / "j.jsonl")])["op"]
    phase = counts.phase()
    phase.clusters.clear()  # (one process, one second: here the calls count as independent)
    phase.cluster_count = 0
    decision = decide("op", counts, max_rate=0.01)
    assert decision.uncovered == {"hooks": 1} and decision.compared == 700
    assert decision.decision == "inconclusive"
    assert decision.why.startswith("1 sampled calls not compared (hooks: user module hooks; declare them free of ")
    counts.phase().skipped.clear()
    assert decide("op", counts, max_rate=0.01).decision == "promote"


@pytest.mark.parametrize(
    "register",
    [
        nn.modules.module.register_module_forward_hook,
        nn.modules.module.register_module_forward_pre_hook,
        nn.modules.module.register_module_full_backward_hook,
    ],
    ids=["global forward", "global pre-forward", "global backward"],
)
def test_global_user_hooks_skip_too(legacy_patches, register):
    dp = nn.DataParallel(nn.Linear(4, 4).to("npu:0"), device_ids=DEVICES)
    handle = register(lambda *a: None)
    try:
        monitor, recorder = shadowed(["parallel_apply"], oracle=None)
        with monitor:
            dp(torch.randn(4, 4, device="npu:0"))
    finally:
        handle.remove()
    assert [o.reasons for o in recorder.observations] == [("hooks",)]


def test_hooks_declared_pure_are_compared(legacy_patches):
    features = []
    model = nn.Linear(4, 4).to("npu:0")
    handle = model.register_forward_hook(lambda m, i, o: features.append(o.shape))
    dp = nn.DataParallel(model, device_ids=DEVICES)
    monitor, recorder = shadowed(["parallel_apply"], oracle=None, pure_hooks=True)
    with monitor:
        dp(torch.randn(4, 4, device="npu:0"))
    handle.remove()
    assert [o.outcome for o in recorder.observations] == ["match"]
    assert len(features) == 4  # the user said running them again is harmless


def test_torchs_own_hooks_are_not_user_hooks(legacy_patches):
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.ReLU()).to("npu:0")
    nn.utils.prune.l1_unstructured(model[0], "bias", amount=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = nn.DataParallel(model, device_ids=DEVICES)
    monitor, recorder = shadowed(["parallel_apply"], oracle=1.0)
    with monitor:
        dp(torch.randn(4, 4, device="npu:0"))
    assert [(o.outcome, o.shared_divergence) for o in recorder.observations] == [("match", "")]
    # spectral_norm's power iteration ran once (legacy's replica 0 shares the buffers): u moved once
    torch.manual_seed(0)
    twin = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.ReLU()).to("npu:0")
    nn.utils.prune.l1_unstructured(twin[0], "bias", amount=0.5)
    twin.load_state_dict(before)
    nn.DataParallel(twin, device_ids=DEVICES)(torch.randn(4, 4, device="npu:0"))
    for key, value in twin.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


# --------------------------------------------------------------------------- 8. subclasses everywhere


class Counting(torch.Tensor):
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _count(run):
    Counting.calls = 0
    run()
    return Counting.calls


class WithSubclassBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4).as_subclass(Counting))

    def forward(self, x):
        return self.linear(x) * self.scale.as_subclass(torch.Tensor)


class ReturnsSubclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).as_subclass(Counting)


@pytest.mark.parametrize("make", [WithSubclassBuffer, ReturnsSubclass], ids=["buffer", "output"])
def test_subclasses_reached_through_the_module_or_returned_see_nothing_of_the_shadow(legacy_patches, make):
    torch.manual_seed(0)
    dp = nn.DataParallel(make().to("npu:0"), device_ids=DEVICES)
    x = torch.randn(4, 4, device="npu:0")
    plain = _count(lambda: dp(x))
    monitor, recorder = shadowed(["parallel_apply"], oracle=1.0)
    with monitor:
        shadowed_count = _count(lambda: dp(x))
    assert shadowed_count == plain
    assert [o.reasons for o in recorder.observations] == [("mode",)]


def test_a_parameter_subclass_through_data_parallel_sees_nothing(legacy_patches):
    class CountingParameter(nn.Parameter):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            CountingParameter.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    module = nn.Linear(4, 4).to("npu:0")
    module.weight = CountingParameter(module.weight.detach())
    x = torch.randn(4, 4, device="npu:0")

    def run():
        CountingParameter.calls = 0
        nn.parallel.data_parallel(module, x, DEVICES)
        return CountingParameter.calls

    plain = run()
    monitor, recorder = shadowed(["data_parallel"], oracle=1.0)
    with monitor:
        assert run() == plain
    assert [o.reasons for o in recorder.observations] == [("mode",)]


def test_the_comparator_never_calls_into_a_subclass():
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    target = Target("op", ops, "op", lambda x: (x * 2).as_subclass(Counting))
    monitor, recorder = shadowed([target])
    with monitor:
        Counting.calls = 0
        ops.op(torch.ones(3))
    (observation,) = recorder.observations
    assert observation.reasons == ("type",)
    # upstream's own as_subclass result is all upstream did; the comparator added nothing
    assert Counting.calls == 0


# --------------------------------------------------------------------------- a real model trains the same


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18 (BasicBlock, [2, 2, 2, 2], 11.2M parameters), with Dropout before the classifier
    and a counter attribute its forward increments."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
        layers, inplanes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(512, num_classes))
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.head(x)


def _train(rate, hook, steps=3, **options):
    torch.manual_seed(0)
    model = ResNet18().to("npu:0")
    features = []
    if hook:
        model.layer4.register_forward_hook(lambda module, inputs, output: features.append(output.detach().sum()))
    dp = nn.DataParallel(model, device_ids=DEVICES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # (uniform sampling: at rate 0 nothing is compared, at rate 1 everything)
    with shadow.install(
        ["parallel_apply", "tensor_type"], sample_rate=rate, oracle=1.0, first_per_signature=0, **options
    ) as monitor:
        for _ in range(steps):
            x = torch.randn(4, 3, 32, 32, device="npu:0")
            y = torch.randint(0, 10, (4,), device="npu:0")
            loss = nn.functional.cross_entropy(dp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    state["forwards"] = torch.tensor(model.forwards)
    stats = monitor.stats()
    _train.tensor_type_calls = stats["tensor_type"].calls  # (the job's own casts, counted)
    return state, torch.stack(features).cpu() if features else None, stats["parallel_apply"]


#: The ResNet-18 trainings test the isolation's mechanics, the same whichever legacy runs: torch_npu's own code.
ONE_LEGACY = pytest.mark.parametrize("legacy_patches", ["torch_npu 2.12.0 source"], indirect=True)


@ONE_LEGACY
@pytest.mark.parametrize("hook", [True, False], ids=["feature hook", "no hook"])
def test_resnet18_in_dataparallel_trains_bitwise_identically_at_rate_0_and_1(legacy_patches, hook):
    unshadowed, features_unshadowed, quiet = _train(0.0, hook)
    shadowed_state, features_shadowed, stats = _train(1.0, hook)
    assert quiet.sampled == 0 and stats.sampled == 3
    if hook:  # the hook's effects cannot be undone: the calls are skipped, the hook runs as often as unwrapped
        assert stats.skipped == 3 and stats.by_reason == {"hooks": 3}
        assert torch.equal(features_unshadowed.sort().values, features_shadowed.sort().values)  # (threads' order)
    else:  # compared, BatchNorm statistics, Dropout's RNG and all
        assert stats.match == 3 and stats.oracle_runs == 3
    assert unshadowed.keys() == shadowed_state.keys()
    for key, value in unshadowed.items():
        assert torch.equal(value, shadowed_state[key]), key


@ONE_LEGACY
def test_resnet18_in_dataparallel_trains_bitwise_identically_with_backward_and_truth_runs(legacy_patches):
    """Every call compared forward and backward (legacy run again for its graph, the products through both
    graphs), a truth run wherever values differ: the caller's gradients, BatchNorm statistics, Dropout's RNG and
    the optimizer's steps are as unwrapped."""
    from shadow.core.calls.sampled.drill import Drill

    unshadowed, _, _ = _train(0.0, hook=False)
    job_casts = _train.tensor_type_calls
    shadowed_state, _, stats = _train(1.0, hook=False, backward_rate=1.0, truth_rate=1.0)
    assert stats.sampled == 3 and stats.backward_runs == 3 and stats.match == 3, stats
    # (the backward runs' own .type() calls, made by DataParallel's backward on the autograd engine's device
    # threads, are theirs: never counted as the job's)
    assert _train.tensor_type_calls == job_casts > 0
    # (a fire drill's value divergence in upstream's result: every call a value mismatch, each run in float64 too,
    # replica 0's module upcast on the CPU and put back)
    drilled_state, _, drilled = _train(1.0, hook=False, truth_rate=1.0, drill=Drill("value", 1.0))
    assert drilled.mismatch == 3 and sum(drilled.truth_runs.values()) == 3, drilled
    for state in (shadowed_state, drilled_state):
        assert unshadowed.keys() == state.keys()
        for key, value in unshadowed.items():
            assert torch.equal(value, state[key]), key


def test_the_backward_runs_casts_on_autograd_threads_are_never_counted_as_the_jobs(legacy_patches):
    """``data_parallel``'s backward (Broadcast's, reducing the replicas' gradients) casts with ``t.type()`` on the
    autograd engine's device threads. Those of a backward comparison's runs are the comparison's, nested calls:
    the job's casts are counted as many times as without it."""

    def casts(backward_rate):
        torch.manual_seed(0)
        model = nn.Linear(6, 3).to("npu:0")
        with shadow.install(
            ["data_parallel", "tensor_type"], sample_rate=1.0,
            first_per_signature=0, backward_rate=backward_rate,
        ) as monitor:  # fmt: skip
            for _ in range(3):
                out = nn.parallel.data_parallel(model, torch.randn(4, 6, device="npu:0"), device_ids=DEVICES)
                out.sum().backward()
            stats = monitor.stats()
        return stats["tensor_type"].calls, stats["data_parallel"]

    plain, _ = casts(0.0)
    with_backward, stats = casts(1.0)
    assert stats.backward_runs == 3 and stats.match == 3, stats
    assert with_backward == plain > 0


# --------------------------------------------------------------------------- 7. another thread's settings


#: Process-wide settings a job thread changes, each with its reader and its change back.
_JOB_THREAD_CHANGES = {
    "default dtype": (lambda: torch.set_default_dtype(torch.float64), torch.get_default_dtype,
                      lambda: torch.set_default_dtype(torch.float32)),
    "float32 matmul precision": (lambda: torch.set_float32_matmul_precision("medium"),
                                 torch.get_float32_matmul_precision,
                                 lambda: torch.set_float32_matmul_precision("highest")),
    "deterministic algorithms": (lambda: torch.use_deterministic_algorithms(True),
                                 torch.are_deterministic_algorithms_enabled,
                                 lambda: torch.use_deterministic_algorithms(False)),
    "print options": (lambda: torch.set_printoptions(precision=2), lambda: torch._tensor_str.PRINT_OPTS.precision,
                      lambda: torch.set_printoptions(precision=4)),
}  # fmt: skip


@pytest.mark.parametrize("setting", sorted(_JOB_THREAD_CHANGES))
@pytest.mark.parametrize("upstream_on", ["worker", "caller"], ids=["on-a-worker", "on-the-callers-thread"])
def test_a_setting_another_job_thread_changes_during_the_shadow_side_stays_changed(setting, upstream_on):
    """While a sampled call's shadow run is under way, another thread of the job changes a process-wide setting:
    the change stays (the shadow side puts back only what its own code wrote), and it is no difference of the
    call's: the two runs did not start from the same settings, so the call is skipped, never a false mismatch."""
    import threading

    change, read, undo = _JOB_THREAD_CHANGES[setting]
    changing, changed = threading.Event(), threading.Event()

    def upstream(x):
        changing.set()
        assert changed.wait(10)
        return x * 2

    def job_thread():
        assert changing.wait(10)
        change()
        changed.set()

    options = {"never_blocks": lambda a, k: True} if upstream_on == "caller" else {}
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    monitor, recorder = shadowed([Target("op", ops, "op", upstream, **options)], budget=None)
    expected = None
    other = threading.Thread(target=job_thread)
    try:
        other.start()
        with monitor:
            ops.op(torch.ones(2))
            expected = read()
            other.join(10)
            assert read() == expected  # (still the other thread's value after the call)
    finally:
        other.join(10)
        undo()
    change()
    try:
        assert expected == read()  # (the value the other thread wrote, not the one from before)
    finally:
        undo()
    (observation,) = recorder.observations
    assert observation.outcome == "skipped" and observation.reasons == ("ineligible",), observation.detail
    assert setting in observation.detail and "another thread" in observation.detail


def test_a_call_that_changes_a_process_wide_setting_while_other_job_threads_live_is_skipped():
    """Running it again from the old value would show that value to the other threads for a moment: the call is
    skipped with the reason, and legacy's change is the job's."""
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, args=(10,))

    def legacy(x):
        torch.set_default_dtype(torch.float64)
        return x + 1

    ops = types.SimpleNamespace(op=legacy)
    monitor, recorder = shadowed([Target("op", ops, "op", lambda x: x + 1)])
    other.start()
    try:
        with monitor:
            ops.op(torch.ones(2))
        assert torch.get_default_dtype() == torch.float64  # legacy's
    finally:
        stop.set()
        other.join()
        torch.set_default_dtype(torch.float32)
    (observation,) = recorder.observations
    assert observation.outcome == "skipped" and observation.reasons == ("ineligible",)
    assert "default dtype" in observation.detail and "other threads" in observation.detail
