"""Beyond forward equality: gradients compared through both sides' graphs, and a float64 truth run that tells
which side of a value difference is nearer the truth."""

from __future__ import annotations

import json
import types

import faults
import pytest
import torch
from commands import npu_shadow_here
from fakes import Recorder
from torch import nn

import shadow
from exporters.journal import JsonlExporter
from shadow.core.judging import truth

_ScaledGradient = faults.ScaledGradient


def _legacy_linear(module, x):
    return nn.functional.linear(x, _ScaledGradient.apply(module.weight), module.bias)


def _upstream_linear(module, x):
    return module(x)


def _train_once(install_options, legacy=_legacy_linear):
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    ops = types.SimpleNamespace(op=legacy)
    collect = Recorder()
    target = shadow.Target("linear", ops, "op", _upstream_linear)
    rng = None
    if install_options is None:
        out = ops.op(module, x)
        stats = None
    else:
        with shadow.install([target], exporters=[collect], budget=None, **install_options) as monitor:
            out = ops.op(module, x)
            rng = torch.get_rng_state()
            stats = monitor.stats()["linear"]
    out.sum().backward()
    return module.weight.grad.clone(), module.bias.grad.clone(), x.grad.clone(), stats, collect.observations, rng


def test_a_backward_only_difference_is_a_grad_mismatch_naming_the_parameter():
    """The forward outputs are bitwise equal: forward-only comparison says match; with the backward comparison
    the weight's gradient differs (x1.5), a mismatch with reason grad that names it, and neither the bias nor the
    input is blamed."""
    *_, forward_only, _, _ = _train_once({"sample_rate": 1.0})
    assert forward_only.match == 1 and forward_only.backward_runs == 0
    *_, stats, observations, _ = _train_once({"sample_rate": 1.0, "backward_rate": 1.0})
    assert stats.mismatch == 1 and stats.by_reason == {"grad": 1} and stats.backward_runs == 1
    (observation,) = observations
    assert observation.backward and observation.reasons == ("grad",)
    assert "args[0].weight" in observation.detail and "bias" not in observation.detail
    assert "args[1]" not in observation.detail  # (x's gradient goes through the weight's forward value: equal)


def test_equal_backwards_match():
    *_, stats, observations, _ = _train_once({"sample_rate": 1.0, "backward_rate": 1.0}, legacy=_upstream_linear)
    assert stats.match == 1 and stats.backward_runs == 1 and observations[0].backward


def test_the_backward_comparison_never_changes_the_callers_gradients_or_rng():
    """The caller's .grad of every parameter and input, and the global RNG, are as unwrapped."""
    bare = _train_once(None)
    shadowed = _train_once({"sample_rate": 1.0, "backward_rate": 1.0})
    for ours, theirs in zip(bare[:3], shadowed[:3]):
        assert torch.equal(ours, theirs)
    torch.manual_seed(0)
    nn.Linear(4, 3)
    torch.randn(5, 4)
    assert torch.equal(shadowed[5], torch.get_rng_state())


def test_the_backward_comparison_never_runs_the_callers_tensor_hooks():
    seen = []
    module = nn.Linear(4, 3)
    module.weight.register_hook(lambda grad: seen.append("weight"))
    x = torch.randn(5, 4, requires_grad=True)
    x.register_hook(lambda grad: seen.append("x"))
    ops = types.SimpleNamespace(op=_legacy_linear)
    target = shadow.Target("linear", ops, "op", _upstream_linear)
    with shadow.install([target], sample_rate=1.0, backward_rate=1.0, budget=None) as monitor:
        out = ops.op(module, x)
        assert seen == [] and monitor.stats()["linear"].backward_runs == 1
    out.sum().backward()
    assert sorted(seen) == ["weight", "x"]  # (once each: the caller's own backward)


class _LoggingNet(nn.Module):
    """A forward that registers a hook on a tensor it makes (gradient logging): the job's code, run by a backward."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(4, 3), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        y.register_hook(lambda grad: self.seen.append("logged"))
        return y


def _forward(module, x):
    return module(x)


def test_hooks_a_forward_registers_run_only_in_the_jobs_backward():
    seen: list[str] = []
    net, x = _LoggingNet(seen), torch.randn(5, 4)
    original = torch.Tensor.register_hook
    ops = types.SimpleNamespace(op=_forward)
    target = shadow.Target("forward", ops, "op", _forward)
    with shadow.install([target], sample_rate=1.0, backward_rate=1.0, aa_rate=1.0, budget=None) as monitor:
        out = ops.op(net, x)
        stats = monitor.stats()["forward"]
    out.sum().backward()
    assert seen == ["logged"]  # (once: the job's own backward)
    assert stats.match == 1 and stats.backward_skips == {"hooks": 1}
    assert torch.Tensor.register_hook is original  # (put back with the monitor)
    seen.clear()
    with shadow.install([shadow.Target("forward", ops, "op", _forward)], sample_rate=1.0, budget=None):
        assert torch.Tensor.register_hook is original  # (no backward comparison: nothing watched)
        ops.op(net, x).sum().backward()
    assert seen == ["logged"]


def _half_logged_job(tmp_path, calls: int = 40):
    """``calls`` forward calls with a backward comparison planned on each, every second one's forward registering a
    hook on its graph (skipped: hooks); decided from its journal and from its metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters import PrometheusExporter
    from shadow.analysis import sources, verdict

    plain, logged = nn.Linear(4, 3), _LoggingNet([])
    ops = types.SimpleNamespace(op=_forward)
    journal, metrics = JsonlExporter(str(tmp_path / "j.jsonl")), PrometheusExporter(registry=CollectorRegistry())
    target = shadow.Target("forward", ops, "op", _forward)
    with shadow.install([target], sample_rate=1.0, backward_rate=1.0, budget=None, exporters=[journal, metrics]):
        for i in range(calls):
            ops.op(logged if i % 2 else plain, torch.randn(5, 4)).sum().backward()
    journal.close()
    read = [
        sources.from_journal([str(tmp_path / "j.jsonl")]),
        sources.from_exposition(generate_latest(metrics.registry).decode()),
    ]
    return [
        next(p for p in verdict.decide("forward", counts["forward"], 0.01).phases if p.primary.endswith("gradients"))
        for counts in read
    ]


def test_backward_comparisons_not_made_are_the_gradient_evidences_non_response_from_every_source(tmp_path):
    """Half the planned backward comparisons were not made (hooks): the gradient evidence was rated on the other
    half as if it were all of them. Those calls' gradients are now a non-response share of 1/2 in the journal's and
    the metrics' verdict alike, and its upper bound holds them (never agreement)."""
    from_journal, from_metrics = _half_logged_job(tmp_path)
    for phase in (from_journal, from_metrics):
        assert phase.compared == 20 and phase.uncovered_by == pytest.approx({"hooks": 0.5})
        assert phase.upper >= 0.5
    assert (from_journal.lower, from_journal.upper) == pytest.approx((from_metrics.lower, from_metrics.upper))


def test_no_backward_comparison_without_grad_mode():
    ops = types.SimpleNamespace(op=_legacy_linear)
    target = shadow.Target("linear", ops, "op", _upstream_linear)
    with shadow.install([target], sample_rate=1.0, backward_rate=1.0, budget=None) as monitor, torch.no_grad():
        ops.op(nn.Linear(4, 3), torch.randn(5, 4))
    stats = monitor.stats()["linear"]
    assert stats.match == 1 and stats.backward_runs == 0


def _poly(x):
    y = x
    for _ in range(12):
        y = y * 1.1 + x * 0.3
    return y


def _value_target(legacy):
    ops = types.SimpleNamespace(op=legacy)
    return ops, shadow.Target("poly", ops, "op", _poly)


def _sequential_sum(x):
    """A sum rounded to ``x``'s dtype at every step (torch.sum accumulates a float16 tensor in float32)."""
    total = x[0]
    for value in x[1:]:
        total = total + value
    return total


def _cancelling(x):
    """``_poly`` of ``x`` after adding and taking away 1e4: digits lost in float32 (about 1e-3 of x), none that
    matter in float64 (about 2e-12): the two code paths agree in float64, and legacy is the further from it."""
    return _poly((x + 1e4) - 1e4)


def _scaled_in_half(x):
    return (x.half() * 3.14159).to(x.dtype)


@pytest.mark.parametrize(
    ("dtype", "legacy", "upstream", "expected"),
    [
        (torch.float16, _sequential_sum, torch.sum, "upstream"),  # one sum, legacy rounding at every step
        (torch.float16, torch.sum, _sequential_sum, "legacy"),
        # upstream rounds by design: its own path in float64 still rounds, so it is no truth to judge by
        (torch.float32, lambda x: x * 3.14159, _scaled_in_half, "differs-in-float64"),
        (torch.float32, lambda x: _poly(x.half()).float(), _poly, "differs-in-float64"),
    ],
    ids=["legacy-rounds-each-step", "upstream-rounds-each-step", "upstream-in-float16", "legacy-in-float16"],
)
def test_a_truth_run_tells_which_side_is_nearer_float64(tmp_path, dtype, legacy, upstream, expected):
    """Both code paths run in float64: where they agree that is the truth; where they do not, the difference is in
    the algorithm (a run on upstream's path alone judged an upstream that rounds by design nearer)."""
    torch.manual_seed(0)
    ops = types.SimpleNamespace(op=legacy)
    target = shadow.Target("poly", ops, "op", upstream)
    journal = tmp_path / "journal.jsonl"
    collect = Recorder()
    with shadow.install(
        [target], sample_rate=1.0, truth_rate=1.0, budget=None, exporters=[collect, JsonlExporter(str(journal))]
    ) as monitor:
        for _ in range(4):
            ops.op(torch.rand(512, dtype=dtype) * 4)
        stats = monitor.stats()["poly"]
    assert stats.compared == 4 and stats.match == 0
    assert stats.truth_runs == {expected: 4}, stats
    for observation in collect.observations:
        errors = (observation.legacy_truth_error, observation.upstream_truth_error)
        assert observation.nearer == expected, errors
        if expected in ("legacy", "upstream"):
            assert (errors[0] < errors[1]) == (expected == "legacy"), errors
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [line["nearer"] for line in lines if line.get("nearer")] == [expected] * 4
    said = npu_shadow_here("verdict", "--journal", str(journal), "--min-per-signature", "1")
    assert said.returncode in (0, 1, 3), said.stderr
    if expected == "differs-in-float64":
        assert "the two code paths differ in float64 too in 4" in said.stdout, said.stdout
    else:
        assert f"upstream nearer in {4 if expected == 'upstream' else 0} of 4" in said.stdout, said.stdout


def test_no_truth_run_for_a_match_or_a_difference_in_kind():
    ops, target = _value_target(lambda x: _poly(x).to(torch.float64))  # (a dtype mismatch: no float64 question)
    with shadow.install([target], sample_rate=1.0, truth_rate=1.0, budget=None) as monitor:
        ops.op(torch.rand(8))
        same_ops, same = _value_target(_poly)
    stats = monitor.stats()["poly"]
    assert stats.mismatch == 1 and stats.by_reason == {"dtype": 1} and stats.truth_runs == {}
    with shadow.install([same], sample_rate=1.0, truth_rate=1.0, budget=None) as monitor:
        same_ops.op(torch.rand(8))
    assert monitor.stats()["poly"].match == 1 and monitor.stats()["poly"].truth_runs == {}


def test_nearer_against_an_independent_computation():
    """The error of each side against float64, computed here by hand with NumPy."""
    import numpy as np

    reference = np.linspace(-3, 5, 50)
    legacy = torch.tensor(reference, dtype=torch.float16)
    upstream = torch.tensor(reference + 1e-6, dtype=torch.float32)
    judged = truth.judge(legacy, upstream, torch.tensor(reference))
    scale = np.abs(reference).max()
    assert judged.legacy_error == pytest.approx(np.abs(legacy.double().numpy() - reference).max() / scale)
    assert judged.upstream_error == pytest.approx(np.abs(upstream.double().numpy() - reference).max() / scale)
    assert judged.nearer == "upstream"
    assert truth.nearer([0.1], [0.105]).nearer == "tie" and truth.nearer([0.1], [0.2]).nearer == "legacy"
    assert truth.nearer([float("inf")], [0.2]).nearer == "upstream"


def test_the_truth_run_puts_the_module_and_rng_back():
    module = nn.Linear(3, 3)
    weight, rng = module.weight, torch.get_rng_state()

    def forward(m, x):
        torch.rand(1)  # (draws from the global RNG)
        assert m.weight.dtype == torch.float64 and m.weight.device.type == "cpu"
        return m(x)

    result = truth.run_in_float64(forward, (module, torch.ones(2, 3)), {})
    assert result.dtype == torch.float64 and module.weight is weight and module.weight.dtype == torch.float32
    assert torch.equal(torch.get_rng_state(), rng)


def _truth_journal(tmp_path, calls=4):
    ops, target = _value_target(_cancelling)  # legacy loses digits in float32: upstream nearer
    journal = tmp_path / "journal.jsonl"
    torch.manual_seed(0)
    with shadow.install(
        [target], sample_rate=1.0, truth_rate=1.0, budget=None, exporters=[JsonlExporter(str(journal))]
    ):
        for _ in range(calls):
            ops.op(torch.rand(64) * 4)
    return journal


def test_the_verdict_shows_per_signature_which_side_is_nearer_and_by_how_much(tmp_path):
    """From the journal's count records (every truth run) and, with the CLI, as a line under the decision."""

    from shadow.analysis import sources, verdict

    journal = _truth_journal(tmp_path)
    (decision,) = verdict.decide_all(sources.from_journal([str(journal)]), 0.001, {}, 30)
    (summary,) = decision.truth
    assert (summary.signature, summary.upstream, summary.legacy, summary.tie) == ("call", 4, 0, 0)
    assert summary.decade is not None and summary.decade <= -2  # (float32 against its digits lost: decades apart)
    assert decision.divergent == 4  # (shown beside the decision, never folded into it)
    printed = npu_shadow_here("verdict", "--journal", str(journal)).stdout
    assert "float64 truth, call: upstream nearer in 4 of 4, legacy nearer in 0, tie 0 (upstream's error ~10^" in (
        printed
    ), printed


def test_the_report_has_the_truth_table_and_chart(tmp_path):
    from shadow.analysis import report

    journal = _truth_journal(tmp_path, calls=3)
    _, sections = report.build(report.collect([str(journal)]), [str(journal)])
    (table,) = [s for s in sections if s.title == "Float64 truth"]
    assert table.rows[0][:5] == ["poly", "call", "3", "0", "0"]
    (charts,) = [s for s in sections if s.title == "Charts"]
    assert any("the side nearer the truth" in figure for figure in charts.figures)


def test_a_truth_count_of_an_unknown_side_is_refused(tmp_path):
    """A journal is data: a count record naming a side that is neither is an error, not a new side."""
    from shadow.analysis import sources

    journal = _truth_journal(tmp_path, calls=1)
    text = journal.read_text()
    assert '"truth":{"call":{"upstream":1}}' in text
    journal.write_text(text.replace('"truth":{"call":{"upstream":1}}', '"truth":{"call":{"both":1}}'))
    with pytest.raises(sources.SourceError, match="unknown nearer"):
        sources.from_journal([str(journal)])


def test_truth_runs_reach_the_verdict_through_a_metrics_exposition():
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters import PrometheusExporter
    from shadow.analysis import sources, verdict

    registry = CollectorRegistry()
    ops, target = _value_target(_cancelling)
    with shadow.install(
        [target], sample_rate=1.0, truth_rate=1.0, budget=None, exporters=[PrometheusExporter(registry=registry)]
    ):
        for _ in range(2):
            ops.op(torch.rand(64) * 4)
    counts = sources.from_exposition(generate_latest(registry).decode())
    (decision,) = verdict.decide_all(counts, 0.001, {}, 30)
    assert [(t.signature, t.upstream, t.decade) for t in decision.truth] == [("call", 2, None)]


def test_a_module_called_as_the_truth_runs_function_is_upcast_too():
    """The DataParallel targets' truth is replica 0's module called on its inputs: the module is the function."""
    module = nn.Linear(3, 2)
    result = truth.run_in_float64(module, (torch.ones(1, 3),), {})
    assert result.dtype == torch.float64 and module.weight.dtype == torch.float32


def test_a_truth_run_abandoned_at_its_deadline_leaves_the_callers_module_as_it_was():
    """The modules are swapped for upcast copies on the caller's thread, around the run: a truth run that hangs
    past the deadline is abandoned, and the caller's module has its own parameters back at once."""
    import threading

    release = threading.Event()
    module = nn.Linear(3, 3)
    weight = module.weight

    def upstream(m, x):
        if m.weight.dtype == torch.float64:  # (the truth run: it hangs)
            release.wait(30)
        return m(x) * (1 + 1e-6)  # (close to legacy's: a value difference, so a truth run)

    ops = types.SimpleNamespace(op=lambda m, x: m(x))
    target = shadow.Target("op", ops, "op", upstream)
    try:
        with shadow.install([target], sample_rate=1.0, truth_rate=1.0, budget=None, deadline=0.5) as monitor:
            ops.op(module, torch.ones(2, 3))
            assert module.weight is weight and module.weight.dtype == torch.float32
        stats = monitor.stats()["op"]
        assert stats.compared == 1 and stats.truth_runs == {}
    finally:
        release.set()


class _JitteryDouble(torch.autograd.Function):
    """``y = 2x`` whose backward's last bits vary from run to run, as a device's nondeterministic backward kernels
    do (the relative size an H200 showed under cudnn.benchmark): call ``i`` scales the gradient by
    ``1 + 2e-4 * (i % 3 - 1)``; ``scale`` makes a side's gradient differ for real."""

    calls = [0]

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _JitteryDouble.calls[0] += 1
        return grad * 2 * ctx.scale * (1 + 2e-4 * (_JitteryDouble.calls[0] % 3 - 1)), None


def _jittery_job(legacy_scale: float, calls: int = 400):
    ops = types.SimpleNamespace(op=lambda x: _JitteryDouble.apply(x, legacy_scale))
    target = shadow.Target("jittery", ops, "op", lambda x: _JitteryDouble.apply(x, 1.0), isolate=True)
    torch.manual_seed(0)
    with shadow.install([target], sample_rate=1.0, backward_rate=1.0, aa_rate=1.0, budget=None, seed=0) as monitor:
        for _ in range(calls):
            ops.op(torch.randn(8, requires_grad=True))
        monitor.flush()
        return monitor.stats()["jittery"]


def test_gradient_jitter_that_legacy_shows_against_itself_is_noise_not_a_mismatch():
    """Nondeterministic backward kernels on both sides (legacy's own gradients differ run to run by 2e-4): the
    backward comparison runs legacy's backward twice too, the gradients' thresholds fixed by their own burn-in; a
    difference within them is noise (it was 400 grad mismatches of 400, and a rollback of an honest job)."""
    stats = _jittery_job(legacy_scale=1.0)
    assert stats.compared == 400 and stats.mismatch == 0 and stats.backward_runs == 400, stats


def test_a_real_gradient_difference_beyond_the_jitter_is_still_a_mismatch_every_time():
    """Legacy's gradient 1% larger (as jittery as upstream): every comparison is a grad mismatch, those made before
    the burn-in fixed the gradients' thresholds included (held, then judged)."""
    stats = _jittery_job(legacy_scale=1.01, calls=260)
    assert stats.compared == 260 and stats.mismatch == 260 and stats.by_reason.get("grad") == 260, stats
    assert stats.noise_checks.get("gradients/ab/beyond") == 260, stats.noise_checks


def test_a_canarys_truth_runs_are_its_phase_s_alike_from_the_journal_and_the_metrics(tmp_path):
    """The truth runs' series had no primary label: read from metrics, a canary's truth runs (upstream returned)
    were counted in legacy's phase, where its journal counted them in upstream's."""
    from prometheus_client import CollectorRegistry, generate_latest

    from exporters import JsonlExporter, PrometheusExporter
    from shadow.analysis import sources

    registry, journal = CollectorRegistry(), tmp_path / "j.jsonl"
    ops, target = _value_target(_cancelling)
    exporters = [PrometheusExporter(registry=registry), JsonlExporter(str(journal))]
    with shadow.install(
        [target], sample_rate=1.0, truth_rate=1.0, budget=None, primary="upstream", exporters=exporters
    ):
        for _ in range(2):
            ops.op(torch.rand(64) * 4)
    exporters[1].close()
    read = [sources.from_exposition(generate_latest(registry).decode()), sources.from_journal([str(journal)])]
    phases = [{p: dict(phase.truth) for p, phase in counts["poly"].phases.items() if phase.truth} for counts in read]
    assert phases[0] == phases[1] == {"upstream": {("call", "upstream"): 2}}, phases
