"""The single-device oracle: what legacy and upstream share, seen against replica 0 alone on its device."""

import pytest
import torch
from fakes import Recorder
from torch import nn

import shadow
from shadow.core.model import oracle

DEVICES = [0, 1]


class CountingNet(nn.Module):
    """Counts its forwards (replicas share the counter through the module they were copied from)."""

    def __init__(self, forwards):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.forwards = forwards

    def forward(self, x):
        self.forwards.append(x.device)
        return self.linear(x)


def shadowed_calls(oracle_rate, autocast):
    torch.manual_seed(0)
    model = nn.Linear(8, 8).to("npu:0")
    dp = nn.DataParallel(model, device_ids=DEVICES)
    x = torch.randn(4, 8, device="npu:0")
    recorder = Recorder()
    with (
        shadow.install(["parallel_apply", "data_parallel"], sample_rate=1.0, exporters=[recorder], oracle=oracle_rate),
        torch.autocast("npu", dtype=torch.float16, enabled=autocast),
    ):
        got = dp(x), nn.parallel.data_parallel(model, x, DEVICES)
        direct = model(x)
    return got, direct, {o.target: o for o in recorder.observations}


def test_under_autocast_legacy_and_upstream_match_and_the_oracle_finds_the_shared_dtype_divergence(legacy_patches):
    """Both read torch.is_autocast_enabled() with no device type (CUDA's flag): on npu both run the replicas in
    float32, while replica 0 alone under the caller's autocast gives float16."""
    (dp_out, data_parallel_out), direct, observations = shadowed_calls(oracle_rate=0.0, autocast=True)
    assert direct.dtype == torch.float16
    assert dp_out.dtype == data_parallel_out.dtype == torch.float32  # the shared defect
    for target in ("parallel_apply", "data_parallel"):
        observation = observations[target]
        assert observation.signature == "replicas=2+/grad=on/autocast=on"
        assert observation.outcome == "match"
        assert observation.shared_divergence == "dtype", observation
        assert "dtype torch.float32 vs torch.float16" in observation.shared_detail
        assert observation.oracle_seconds > 0
        assert observation.overhead_seconds >= observation.oracle_seconds


def test_without_autocast_there_is_no_shared_divergence(legacy_patches):
    _, _, observations = shadowed_calls(oracle_rate=1.0, autocast=False)
    for target in ("parallel_apply", "data_parallel"):
        assert observations[target].outcome == "match"
        assert observations[target].shared_divergence == ""
        assert observations[target].oracle_seconds > 0  # it ran, and agreed


@pytest.mark.parametrize("oracle_rate, extra", [(None, 0), (0.0, 0), (1.0, 1)])
def test_the_oracle_costs_one_forward_of_replica_0_and_none_when_off(legacy_patches, oracle_rate, extra):
    forwards = []
    model = CountingNet(forwards).to("npu:0")
    dp = nn.DataParallel(model, device_ids=DEVICES)
    with shadow.install(["parallel_apply"], sample_rate=1.0, oracle=oracle_rate) as monitor:
        dp(torch.randn(4, 8, device="npu:0"))
    # legacy's two replicas, upstream's two, and the oracle's replica 0 on npu:0
    assert len(forwards) == 4 + extra
    assert forwards.count(torch.device("npu:0")) == 2 + extra
    assert monitor.stats()["parallel_apply"].oracle_runs == extra


def test_oracle_off_means_off_even_under_autocast(legacy_patches):
    _, _, observations = shadowed_calls(oracle_rate=None, autocast=True)
    assert all(o.shared_divergence == "" and o.oracle_seconds == 0 for o in observations.values())


def test_data_parallel_replica_0_is_the_first_chunk_of_the_gathered_output():
    model = nn.Linear(8, 3).to("npu:0")
    x = torch.randn(5, 8, device="npu:0")
    call = oracle.data_parallel_call((model, x, DEVICES, 1), {})
    assert call.device == 0 and call.args[0].shape == (3, 8)  # scatter: chunks of 3 and 2
    single = call.run()
    gathered = nn.parallel.data_parallel(model, x, DEVICES, output_device=1)
    part = call.legacy_part(gathered, single)
    assert part.device == single.device and part.shape == single.shape
    assert torch.equal(part, single)


def test_a_single_device_data_parallel_call_has_no_oracle():
    model = nn.Linear(8, 3).to("npu:0")
    assert oracle.data_parallel_call((model, torch.randn(2, 8, device="npu:0"), [0]), {}) is None


def test_a_failing_oracle_loses_only_its_own_finding(legacy_patches, monkeypatch):
    def broken(args, kwargs):
        raise RuntimeError("oracle bug")

    target = shadow.core.model.targets.parallel_apply()
    object.__setattr__(target, "oracle", broken)
    model = nn.Linear(8, 8).to("npu:0")
    dp = nn.DataParallel(model, device_ids=DEVICES)
    recorder = Recorder()
    with shadow.install([target], sample_rate=1.0, exporters=[recorder], oracle=1.0):
        dp(torch.randn(4, 8, device="npu:0"))
    (observation,) = recorder.observations
    assert observation.outcome == "match" and observation.shared_divergence == ""
