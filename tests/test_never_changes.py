"""Promise 1 at its edges: what the shadow side does (raise anything, change global or module state) never
reaches the job."""

import types

import pytest
import torch

import shadow
from shadow import Target


def twice(x):
    return x * 2


def op_with(upstream, **target_options):
    ops = types.SimpleNamespace(op=twice)
    return ops, Target("op", ops, "op", upstream, **target_options)


class Recorder:
    def __init__(self):
        self.observations = []

    def export(self, observation):
        self.observations.append(observation)


@pytest.mark.parametrize("error", [SystemExit(3), GeneratorExit(), StopIteration()])
def test_anything_upstream_raises_is_counted_and_swallowed(error):
    def upstream(x):
        raise error

    ops, target = op_with(upstream)
    with shadow.install([target], sample_rate=1.0) as monitor:
        assert torch.equal(ops.op(torch.ones(2)), torch.full((2,), 2.0))
    stats = monitor.stats()["op"]
    assert stats.error == 1 and stats.by_reason == {"exception": 1}


@pytest.mark.parametrize("error", [SystemExit(3), GeneratorExit()])
def test_an_exporter_or_a_signature_raising_anything_is_counted_and_swallowed(error):
    class Raising:
        def export(self, observation):
            raise error

    def signature(args, kwargs):
        raise error

    ops, target = op_with(twice)
    with shadow.install([target], sample_rate=1.0, exporters=[Raising()]) as monitor:
        ops.op(torch.ones(2))
    assert monitor.stats()["op"].by_reason == {"export": 1}
    ops, target = op_with(twice, signature=signature)
    with shadow.install([target], sample_rate=1.0) as monitor:
        ops.op(torch.ones(2))
    assert monitor.stats()["op"].by_reason == {"comparator": 1}


def test_keyboard_interrupt_still_stops_the_job():
    def upstream(x):
        raise KeyboardInterrupt

    ops, target = op_with(upstream)
    with shadow.install([target], sample_rate=1.0), pytest.raises(KeyboardInterrupt):
        ops.op(torch.ones(2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sample_rate": 1.5}, "sample_rate: expected a number in"),
        ({"sample_rate": {"tensor_type": 2}}, r"sample_rate\['tensor_type'\]: expected a number in"),
        ({"sample_rate": {"nope": 0.5}}, r"sample_rate: unknown target\(s\) \['nope'\]"),
        ({"tolerance": "tight"}, "tolerance"),
    ],
)
def test_bad_arguments_fail_even_where_no_target_is_active(kwargs, message):
    assert shadow.install().targets == ()  # nothing active in this process
    with pytest.raises(ValueError, match=message):
        shadow.install(**kwargs)


def test_an_exporter_that_raises_on_attribute_lookup_is_a_value_error():
    class Hostile:
        def __getattr__(self, name):
            raise RuntimeError("no attributes here")

    _, target = op_with(twice)
    with pytest.raises(ValueError, match="exporters: Hostile raised looking up export"):
        shadow.install([target], exporters=[Hostile()])


def test_a_per_target_rate_may_name_a_target_whose_legacy_comes_later():
    from shadow import reference

    assert shadow.install(sample_rate={"tensor_type": 0.5}).targets == ()
    patches = reference.patch_torch()
    try:
        with shadow.install(sample_rate={"tensor_type": 0.5}) as monitor:
            assert monitor.shadow("tensor_type").sampler.rate == 0.5
    finally:
        patches.undo()
