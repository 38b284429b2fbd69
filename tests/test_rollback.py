"""A canary (upstream as the primary, legacy compared as the shadow) and the rollback switch that returns a running
job to legacy: in the engine, through the exporters and journal, and through the file and HTTP switch."""

from __future__ import annotations

import json
import types
import urllib.error
import urllib.request

import pytest
import torch
from metrics_helpers import without_run
from prometheus_client.exposition import generate_latest

import shadow
from exporters.journal import JsonlExporter
from exporters.prometheus import PrometheusExporter
from shadow.analysis import sources
from shadow.core.model.targets import Target
from shadow.launcher.switch import RollbackSwitch


def pair() -> tuple[types.SimpleNamespace, Target]:
    ops = types.SimpleNamespace(op=lambda x: x * 2)  # legacy
    return ops, Target("op", ops, "op", lambda x: x * 3, isolate=False, signature=lambda a, k: "call")


def test_a_canary_returns_upstreams_result_and_compares_legacys(tmp_path):
    ops, target = pair()
    exporter, journal = PrometheusExporter(), JsonlExporter(str(tmp_path / "j.jsonl"), all_outcomes=True)
    with shadow.install([target], sample_rate=0.5, seed=1, primary="upstream", exporters=[exporter, journal]) as m:
        outs = [ops.op(torch.ones(1)).item() for _ in range(40)]
        assert outs == [3.0] * 40  # sampled or not, the caller gets upstream's
        stats = m.stats()["op"]
        assert stats.primary == "upstream" and stats.mismatch == stats.compared > 0
        assert m.roll_back("api:test") == ["op"] and m.roll_back("api:again") == []  # only toward legacy, once
        assert [ops.op(torch.ones(1)).item() for _ in range(20)] == [2.0] * 20  # from the next call on
        assert m.stats()["op"].primary == "legacy"
    journal.close()
    text = without_run(generate_latest(exporter.registry).decode())
    assert 'npu_shadow_rollbacks_total{source="api",target="op"} 1.0' in text
    assert 'npu_shadow_primary{side="legacy",target="op"} 1.0' in text
    assert 'npu_shadow_primary{side="upstream",target="op"} 0.0' in text
    assert 'outcome="mismatch",primary="upstream",signature="call",target="op"' in text
    # every count names the side the caller got: upstream's before the rollback, legacy's after
    for side in ("upstream", "legacy"):
        assert f'npu_shadow_mismatches_total{{primary="{side}",reason="value",target="op"}}' in text
        assert f'npu_shadow_calls_total{{primary="{side}",signature="call",target="op"}}' in text
    records = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") in ("rollback", "reset")]
    assert [(e["event"], e["target"], e["by"]) for e in events] == [("rollback", "op", "api:test")]
    lines = [r for r in records if "outcome" in r]
    assert {r["primary"] for r in lines} == {"upstream", "legacy"}
    counts = sources.from_journal([str(tmp_path / "j.jsonl")])["op"]  # the verdict reads both phases, apart
    assert len(counts.rollbacks) == 1 and counts.rollbacks[0].startswith("api:test at ")
    assert counts.compared == len(lines) and set(counts.phases) == {"upstream", "legacy"}


def test_the_isolation_holds_for_legacy_as_the_shadow():
    """In a canary legacy is the isolated side: BatchNorm's statistics and the RNG are what upstream alone leaves."""

    def run(shadowed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
        ops = types.SimpleNamespace(op=lambda m, x: m(x) + 1)  # legacy: another result, the same side effects
        target = Target("op", ops, "op", lambda m, x: m(x))
        x = torch.randn(8, 4)
        if shadowed:
            with shadow.install([target], sample_rate=1.0, primary="upstream"):
                out = ops.op(model, x)
        else:
            out = target.upstream(model, x)
        return out.detach(), model[1].running_mean.clone(), torch.rand(3)

    unwrapped, canary = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(unwrapped, canary))


def test_primary_is_checked_at_start_up():
    with pytest.raises(ValueError, match="primary"):
        shadow.install([pair()[1]], primary="both")


# --------------------------------------------------------------------------- the switch


def post(url: str, token: str | None = None, by: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=b"{}", method="POST")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if by:
        request.add_header("X-NPU-Shadow-By", by)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_switch_needs_its_token_and_refuses_anything_else():
    thrown, reset = [], []
    switch = RollbackSwitch(thrown.append, reset.append, port=0, token="t" * 24)
    try:
        base = f"http://127.0.0.1:{switch.port}"
        assert switch.server.server_address[0] == "127.0.0.1"
        assert post(base + "/rollback")[0] == 403 and post(base + "/rollback", "wrong" * 5)[0] == 403
        assert post(base + "/elsewhere", "t" * 24)[0] == 404
        assert thrown == [] and switch.refused == 3
        code, body = post(base + "/rollback", "t" * 24, by="alertmanager:NpuShadowHardMismatch")
        assert code == 200 and thrown == ["http:alertmanager:NpuShadowHardMismatch"] and body["rolled_back"]
        assert post(base + "/reset", "t" * 24, by="alice")[0] == 200 and reset == ["http:alice"]
    finally:
        switch.close()
    with pytest.raises(ValueError, match="token"):
        RollbackSwitch(thrown.append, reset.append, port=0)


def test_the_file_switch_throws_when_the_file_appears(tmp_path):
    import threading

    thrown = threading.Event()
    seen = []
    switch = RollbackSwitch(lambda by: (seen.append(by), thrown.set()), lambda by: None, file=str(tmp_path / "stop"))
    try:
        assert not thrown.wait(0.5)
        (tmp_path / "stop").write_text("oncall: bob\n")
        assert thrown.wait(10) and seen == ["file:oncall: bob"]
    finally:
        switch.close()


def test_doctor_on_a_torch_npu_without_the_patches_names_the_canary_and_the_wheel(tmp_path, monkeypatch):
    """torch_npu 2.13 deleted the patches: doctor says so, and how to run the canary instead."""
    import sys

    from shadow.launcher import doctor

    info = tmp_path / "torch_npu-2.13.0.dist-info"  # an installed distribution's metadata, nothing to import
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # (importing it fails here, as without CANN)
    _, lines = doctor.diagnose(port=0)
    text = "\n".join(lines)
    assert "torch_npu 2.13.0 has no legacy patches (they were removed in 2.13): run a canary" in text
    assert "--primary upstream --legacy-from" in text and "torch_npu-2.12.0" in text
