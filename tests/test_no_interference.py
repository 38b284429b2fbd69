"""Promise 1 on the emulated npu: a DataParallel training loop shadowed at sample_rate=1.0, with torch's
real upstream parallel_apply and data_parallel running on two devices and the single-device oracle on every
DataParallel call, ends bitwise where the unshadowed loop ends: over our reference legacy and over torch_npu's
own."""

import copy
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import shadow

STEPS = 21
DEVICES = [0, 1]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        h = h.type("torch.npu.FloatTensor")  # legacy code casts inside forward, on each replica's device
        return self.head(h.flatten(1))


def every_rng():
    return (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
        [torch.npu.get_rng_state(i) for i in DEVICES],
    )


class CountingType:
    """Counts the job's own Tensor.type calls in the unshadowed run (torch's comm code makes some too)."""

    def __init__(self):
        self.legacy, self.calls = torch.Tensor.type, 0

    def __enter__(self):
        def counting_type(tensor, *args, **kwargs):
            self.calls += 1
            return self.legacy(tensor, *args, **kwargs)

        torch.Tensor.type = counting_type
        return self

    def __exit__(self, *exc):
        torch.Tensor.type = self.legacy


def train(shadowed: bool):
    torch.manual_seed(0)  # seeds every npu generator too (torch.npu.manual_seed_all)
    random.seed(0)
    np.random.seed(0)
    model = Net().to("npu:0")
    dp = nn.DataParallel(model, device_ids=DEVICES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor = shadow.install(sample_rate=1.0, seed=1, oracle=1.0) if shadowed else None
    losses, grads = [], []
    try:
        for step in range(STEPS):
            x = torch.randn(8, 3, 8, 8).type("torch.npu.FloatTensor")  # legacy: onto the current npu
            x = x.type(torch.npu.HalfTensor).type(torch.float32)  # an npu class, and a dtype
            y = torch.randint(0, 4, (8,)).type(torch.npu.LongTensor)
            # dp(x): DataParallel.forward -> replicate, scatter, the wrapped parallel_apply, gather
            with torch.autocast("npu", dtype=torch.float16, enabled=step % 4 == 1):
                out = torch.nn.parallel.data_parallel(model, x, device_ids=DEVICES) if step % 3 == 0 else dp(x)
            loss = nn.functional.cross_entropy(out, y).type(torch.float64)
            optimizer.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            losses.append(loss.detach())
            _ = loss.type()  # the type name, a string
    finally:
        stats = monitor.stats() if monitor else None
        if monitor:
            monitor.uninstall()
    return model, losses, grads, every_rng(), stats


def test_dataparallel_training_on_two_npus_is_bitwise_identical_with_every_builtin_target_at_rate_one(
    legacy_patches,
):
    start_rng = (torch.manual_seed(0), [torch.npu.get_rng_state(i) for i in DEVICES])[1]
    with CountingType() as job_casts:
        plain_model, plain_losses, plain_grads, plain_rng, _ = train(shadowed=False)
    model, losses, grads, rng, stats = train(shadowed=True)

    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    for step_grads, plain_step_grads in zip(grads, plain_grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_grads, plain_step_grads))
    plain_state, state = plain_model.state_dict(), model.state_dict()
    assert plain_state.keys() == state.keys()
    for name in state:
        assert torch.equal(state[name], plain_state[name]), name
    assert state["bn.num_batches_tracked"].item() == STEPS  # replica 0's in-place updates persist, once
    assert torch.equal(rng[0], plain_rng[0])
    assert rng[1] == plain_rng[1]
    assert all(np.array_equal(a, b) for a, b in zip(rng[2], plain_rng[2]))
    for index in DEVICES:
        assert torch.equal(rng[3][index], plain_rng[3][index]), f"npu:{index} generator"
        # dropout drew from both devices' generators: both replicas were stochastic
        assert not torch.equal(rng[3][index], start_rng[index]), f"npu:{index} generator never used"

    # every sampled call was compared with torch's own upstream, and agreed
    dp_steps = len(range(0, STEPS, 3))
    data_parallel, parallel_apply = stats["data_parallel"], stats["parallel_apply"]
    assert data_parallel.calls == data_parallel.sampled == data_parallel.match == dp_steps
    assert parallel_apply.calls == parallel_apply.sampled == parallel_apply.match == STEPS - dp_steps
    # the oracle ran on every call; the autocast steps show the defect both sides share
    assert data_parallel.oracle_runs + parallel_apply.oracle_runs == STEPS
    autocast_steps = [s for s in range(STEPS) if s % 4 == 1]
    assert data_parallel.shared_divergences == {"dtype": len([s for s in autocast_steps if s % 3 == 0])}
    assert parallel_apply.shared_divergences == {"dtype": len([s for s in autocast_steps if s % 3 != 0])}
    tensor_type = stats["tensor_type"]
    # Every call of the job was compared and matched, and only the job's calls were counted: the casts in the
    # replicas' forwards when upstream runs them (on upstream's own worker threads) and in the oracle's forward
    # (on the calling thread, inside the shadow side) are part of the shadow side's work.
    assert tensor_type.calls == tensor_type.sampled == tensor_type.match == job_casts.calls
    assert tensor_type.skipped == 0


def test_dataparallel_replicas_leave_the_module_buffers_untouched_by_the_upstream_run(fake_torch_npu):
    """Replica 0 shares its buffers with the module; the upstream run must not update them again."""

    def run(shadowed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to("npu")
        dp = nn.DataParallel(model, device_ids=DEVICES)
        monitor = shadow.install(["parallel_apply"], sample_rate=1.0) if shadowed else None
        versions = {}
        try:
            for _ in range(3):
                dp(torch.randn(8, 4, device="npu")).sum().backward()
                versions = {k: v._version for k, v in model.named_buffers()}
        finally:
            stats = monitor.stats() if monitor else None
            if monitor:
                monitor.uninstall()
        return model.state_dict(), versions, stats

    plain, plain_versions, _ = run(False)
    state, versions, stats = run(True)
    for name in plain:
        assert torch.equal(plain[name], state[name]), name
    assert versions == plain_versions  # no copy-back bumped an autograd version counter
    assert stats["parallel_apply"].match == 3


@pytest.mark.slow
def test_on_a_cpu_only_host_torch_upstream_refuses_and_that_is_an_error_not_a_crash():
    """The emulator cannot serve a host without an accelerator, so this runs in a fresh process without it."""
    script = textwrap.dedent(
        """
        import sys, torch
        from torch import nn
        sys.path.insert(0, "tests/fake_torch_npu")
        import torch_npu  # the fake: shadow.npu.reference's legacy
        import shadow
        assert torch.accelerator.current_accelerator() is None
        model = nn.Linear(2, 2)
        dp = nn.DataParallel(model)
        x = torch.randn(3, 2)
        expected = dp.parallel_apply([model], [(x,)], None)
        with shadow.install(["parallel_apply", "data_parallel"], sample_rate=1.0) as monitor:
            got = dp.parallel_apply([model], [(x,)], None)
            got_dp = torch.nn.parallel.data_parallel(model, x)
        assert torch.equal(got[0], expected[0]) and torch.equal(got_dp, model(x))
        stats = monitor.stats()
        print(stats["parallel_apply"].error, stats["data_parallel"].error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def test_replicate_shares_replica_zero_with_the_module_as_on_cuda():
    """The collectives the CPU build lacks keep CUDA's aliasing: replica 0 is the module's own storage."""
    model = nn.BatchNorm1d(3).to("npu:0")
    replicas = torch.nn.parallel.replicate(copy.deepcopy(model), DEVICES)
    assert [r.running_mean.device.index for r in replicas] == DEVICES
    original = nn.BatchNorm1d(3).to("npu:0")
    replicas = torch.nn.parallel.replicate(original, DEVICES)
    assert replicas[0].running_mean.data_ptr() == original.running_mean.data_ptr()
    assert replicas[1].running_mean.data_ptr() != original.running_mean.data_ptr()
