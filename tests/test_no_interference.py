"""Promise 1: a training loop shadowed at sample_rate=1.0 ends bitwise where the unshadowed loop ends."""

import copy
import random

import numpy as np
import pytest
import standins
import torch
from torch import nn

import shadow
from shadow import targets as builtin

STEPS = 24


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        h = h.type(torch.float32)  # legacy code casts inside forward, too
        return self.head(h.flatten(1))


def train(shadowed: bool):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = Net()
    dp = nn.DataParallel(model)  # on the CPU: no device ids; we call its parallel_apply directly
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor = None
    if shadowed:
        monitor = shadow.install(
            [
                builtin.parallel_apply(apply=standins.upstream_parallel_apply),
                builtin.data_parallel(function=standins.upstream_data_parallel),
                "tensor_type",
            ],
            sample_rate=1.0,
            seed=1,
        )
    losses = []
    try:
        for step in range(STEPS):
            x = torch.randn(8, 3, 8, 8).type("torch.npu.FloatTensor")  # legacy: onto the current device
            y = torch.randint(0, 4, (8,)).type(torch.int64)
            if step % 3 == 0:
                out = torch.nn.parallel.data_parallel(model, x)
            elif step % 3 == 1:
                # DataParallel's replica 0 is the module itself (shared storage); one replica keeps the
                # CPU's single generator deterministic (on devices each replica has its own).
                (out,) = dp.parallel_apply([model], [(x,)], None)
            else:
                out = model(x)
            loss = nn.functional.cross_entropy(out, y).type(torch.float64)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            _ = loss.type()  # the type name, a string
    finally:
        stats = monitor.stats() if monitor else None
        if monitor:
            monitor.uninstall()
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    return model, losses, rng, stats


def test_training_is_bitwise_identical_with_every_builtin_target_at_rate_one(fake_torch_npu):
    plain_model, plain_losses, plain_rng, _ = train(shadowed=False)
    model, losses, rng, stats = train(shadowed=True)

    assert [loss.item() for loss in losses] == [loss.item() for loss in plain_losses]
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    plain_state, state = plain_model.state_dict(), model.state_dict()
    assert plain_state.keys() == state.keys()
    for name in state:
        assert torch.equal(state[name], plain_state[name]), name
    assert state["bn.num_batches_tracked"].item() == STEPS
    assert torch.equal(rng[0], plain_rng[0])
    assert rng[1] == plain_rng[1]
    assert all(np.array_equal(a, b) for a, b in zip(rng[2], plain_rng[2]))

    # every sampled call was compared, and the shadow agreed where the two implementations agree
    dp_calls = STEPS // 3
    assert stats["data_parallel"].calls == stats["data_parallel"].sampled == dp_calls
    assert stats["data_parallel"].match == dp_calls
    assert stats["parallel_apply"].sampled == stats["parallel_apply"].match == dp_calls
    tensor_type = stats["tensor_type"]
    assert tensor_type.calls == tensor_type.sampled
    # forwards run by the upstream side call .type() on the same thread: those are the only skips
    assert tensor_type.skipped == tensor_type.by_reason["reentrant"] == 2 * dp_calls
    # 'torch.npu.FloatTensor' cannot be cast by upstream on a CPU: an honest error, every step
    assert tensor_type.error == STEPS
    assert tensor_type.match == tensor_type.sampled - tensor_type.skipped - tensor_type.error


def test_two_replicas_in_threads_leave_shared_buffers_untouched(fake_torch_npu):
    """Replica 0 shares its buffers with the module; the upstream run must not update them again."""

    def run(shadowed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        replica = copy.deepcopy(model)
        dp = nn.DataParallel(model)
        monitor = (
            shadow.install([builtin.parallel_apply(apply=standins.upstream_parallel_apply)], sample_rate=1.0)
            if shadowed
            else None
        )
        versions = {}
        try:
            for _ in range(3):
                x = torch.randn(8, 4)
                outs = dp.parallel_apply([model, replica], [(x[:4],), (x[4:],)], None)
                torch.cat(outs).sum().backward()
                versions = {k: v._version for k, v in model.named_buffers()}
        finally:
            stats = monitor.stats() if monitor else None
            if monitor:
                monitor.uninstall()
        return model.state_dict(), replica.state_dict(), versions, stats

    plain, plain_replica, plain_versions, _ = run(False)
    state, replica_state, versions, stats = run(True)
    for name in plain:
        assert torch.equal(plain[name], state[name]), name
        assert torch.equal(plain_replica[name], replica_state[name]), name
    assert versions == plain_versions  # no copy-back bumped an autograd version counter
    assert stats["parallel_apply"].match == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_upstream_autocast_defect_is_caught_as_dtype_and_training_unchanged(fake_torch_npu, dtype):
    """Upstream reads torch.is_autocast_enabled() without a device type: replicas run without autocast."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    dp = nn.DataParallel(model)
    replica = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=dtype):
        expected = dp.parallel_apply([model, replica], [(x,), (x,)], None)
    target = builtin.parallel_apply(apply=standins.upstream_parallel_apply)
    recorder = []
    exporter = type("Rec", (), {"export": lambda self, o: recorder.append(o)})()
    with shadow.install([target], sample_rate=1.0, exporters=[exporter]), torch.autocast("cpu", dtype=dtype):
        got = dp.parallel_apply([model, replica], [(x,), (x,)], None)
    assert all(g.dtype == dtype and torch.equal(g, e) for g, e in zip(got, expected))
    (observation,) = recorder
    assert observation.outcome == "mismatch" and "dtype" in observation.reasons
    assert observation.signature == "replicas=2/grad=on/autocast=on"
    assert "bfloat16 vs torch.float32" in observation.detail
    assert "autocast legacy: cpu=on/bfloat16" in observation.detail


def test_torch_upstream_parallel_apply_refuses_the_cpu_as_an_error_not_a_crash(fake_torch_npu):
    model = nn.Linear(2, 2)
    dp = nn.DataParallel(model)
    x = torch.randn(3, 2)
    expected = dp.parallel_apply([model], [(x,)], None)
    with shadow.install(["parallel_apply", "data_parallel"], sample_rate=1.0) as monitor:
        got = dp.parallel_apply([model], [(x,)], None)
        got_dp = torch.nn.parallel.data_parallel(model, x)
    assert torch.equal(got[0], expected[0]) and torch.equal(got_dp, model(x))
    stats = monitor.stats()
    assert stats["parallel_apply"].error == 1 and stats["data_parallel"].error == 1
