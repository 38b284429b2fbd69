import itertools
import math
import operator
import os
import random

import pytest
import torch

from shadow.core.calls.gate.sampling import Sampler


class GateHolder:
    def __init__(self):
        self.gate = itertools.repeat(True, 0)

    def __call__(self, gate):
        self.gate = gate


def drive(sampler, holder, calls):
    """Simulate the wrapper's unsampled path; return how many calls were sampled."""
    sampled = 0
    for _ in range(calls):
        if not next(holder.gate, False):
            sampled += sampler.arrive()
    return sampled


@pytest.mark.parametrize("rate", [0.0, 0.01, 0.3, 1.0])
def test_calls_are_counted_exactly_and_rate_is_respected(rate):
    holder = GateHolder()
    sampler = Sampler(rate, seed=7, stream="t", publish=holder)
    sampled = drive(sampler, holder, 20_000)
    assert sampler.calls() == 20_000
    if rate == 0.0:
        assert sampled == 0
    elif rate == 1.0:
        assert sampled == 20_000
    else:
        expected = 20_000 * rate
        assert abs(sampled - expected) < 5 * math.sqrt(expected), (sampled, expected)


def test_seed_makes_sampling_reproducible_and_streams_differ():
    def pattern(seed, stream):
        holder = GateHolder()
        sampler = Sampler(0.1, seed=seed, stream=stream, publish=holder)
        out = []
        for _ in range(2000):
            out.append(not next(holder.gate, False) and sampler.arrive())
        return out

    assert pattern(1, "a") == pattern(1, "a")
    assert pattern(1, "a") != pattern(2, "a")
    assert pattern(1, "a") != pattern(1, "b")


def test_sampler_never_touches_global_rngs():
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    holder = GateHolder()
    sampler = Sampler(0.5, seed=None, stream="t", publish=holder)
    drive(sampler, holder, 1000)
    assert torch.equal(torch_state, torch.get_rng_state())
    assert py_state == random.getstate()


def test_closed_gate_reopened_by_another_thread_is_not_sampled_again():
    holder = GateHolder()
    sampler = Sampler(0.001, seed=3, stream="t", publish=holder)
    while next(holder.gate, False):
        pass  # exhaust the gate: this call arrived
    assert sampler.arrive() is True  # the sampled call; reopens a (long) gate
    # A call that found the old gate empty before it was reopened arrives late:
    assert operator.length_hint(holder.gate) > 0
    assert sampler.arrive() is False
    assert sampler.calls() == sampler._passed + sampler._gate_size - operator.length_hint(holder.gate)


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), True])
def test_bad_rate_is_rejected(rate):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Sampler(rate, seed=None, stream="t", publish=GateHolder())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_its_own_stream_and_counts_from_zero():
    holder = GateHolder()
    sampler = Sampler(0.2, seed=11, stream="t", publish=holder)
    drive(sampler, holder, 100)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        calls_after_fork = sampler.calls()
        pattern = [not next(holder.gate, False) and sampler.arrive() for _ in range(500)]
        os.write(write_end, repr((calls_after_fork, pattern)).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child_calls, child_pattern = eval(pipe.read())
    os.waitpid(pid, 0)
    parent_pattern = [not next(holder.gate, False) and sampler.arrive() for _ in range(500)]
    assert child_calls == 0
    assert child_pattern != parent_pattern


def test_a_shadow_side_refreshes_the_gates_of_installed_targets_only():
    """Every shadow side closes the gates of every target while it runs (its own runs' calls are not the job's):
    an uninstalled target's gate is no longer among them, so a job that installs and uninstalls many monitors does
    not pay for each of them on every sampled call."""
    import shadow
    from shadow.core.calls.gate.sampling import UNDER_WAY
    from shadow.npu import reference

    patches = reference.patch_torch()
    try:
        with shadow.install(["tensor_type"], sample_rate=1.0) as monitor:
            sampling = monitor.experiment("tensor_type").sampling
            assert sampling in UNDER_WAY
            torch.ones(2).type(torch.float16)
        assert sampling not in UNDER_WAY
    finally:
        patches.undo()
