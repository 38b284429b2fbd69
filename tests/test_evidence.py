"""Evidence that reaches the rare paths and says how sure it is: signatures that separate the known risky paths,
coverage-guided sampling weighted by each signature's share of calls, clustered bounds."""

from __future__ import annotations

import fnmatch
import random
import threading
import types

import pytest
import torch
from commands import npu_shadow_here

import shadow
from shadow.core.model import targets as builtin

pytestmark = pytest.mark.skipif(torch.accelerator.current_accelerator() is None, reason="needs the emulated npu")


def _risky(target: builtin.Target, signature: str) -> list[str]:
    return [p for p in target.risky_signatures if fnmatch.fnmatchcase(signature, p)]


# --------------------------------------------------------------------------- 1. signatures


def test_tensor_type_signatures_separate_the_known_risky_paths():
    """An npu name or class on a tensor on a non-current npu, and torch_npu's own spelling, are paths of their own,
    and they are the risky ones; the common casts are not."""
    target = builtin.tensor_type()
    signature = builtin.tensor_type_signature
    here, there = torch.ones(2, device="npu:0"), torch.ones(2, device="npu:1")
    assert torch.accelerator.current_device_index() == 0
    cases = {
        (there, "torch.npu.HalfTensor"): "npu_name/noncurrent/blocking",
        (here, "torch.npu.HalfTensor"): "npu_name/current/blocking",
        (there, torch.npu.HalfTensor): "npu_class/noncurrent/blocking",
        (here, "torch_npu.npu.HalfTensor"): "torch_npu_name/current/blocking",
        (here.cpu(), "torch.npu.HalfTensor"): "npu_name/cpu/blocking",
        (there, torch.half): "dtype/noncurrent/blocking",
        (here, "torch.FloatTensor"): "name/current/blocking",
        (here, torch.FloatTensor): "class/current/blocking",
        (here,): "none/current/blocking",
    }
    assert {s: signature(args, {}) for args, s in cases.items()} == {s: s for s in cases.values()}
    assert signature((here,), {"dtype": torch.half, "non_blocking": True}) == "dtype/current/nonblocking"
    risky = {s for s in cases.values() if _risky(target, s)}
    assert risky == {"npu_name/noncurrent/blocking", "npu_class/noncurrent/blocking", "torch_npu_name/current/blocking"}
    with torch.npu.device(1):  # what is current decides
        assert signature((there, "torch.npu.HalfTensor"), {}) == "npu_name/current/blocking"


def test_data_parallel_signatures_separate_a_single_replica_and_autocast():
    target = builtin.parallel_apply()
    one = builtin.parallel_apply_signature((None, [1], [], None), {})
    two = builtin.parallel_apply_signature((None, [1, 2], [], None), {})
    many = builtin.parallel_apply_signature((None, list(range(40)), [], None), {})
    with torch.autocast("npu", dtype=torch.float16):
        autocast = builtin.parallel_apply_signature((None, [1, 2], [], None), {})
    with torch.no_grad():
        no_grad = builtin.data_parallel_signature((None, None, [0]), {})
    assert (one, many) == ("replicas=1/grad=on/autocast=off", two) and two == "replicas=2+/grad=on/autocast=off"
    assert (autocast, no_grad) == ("replicas=2+/grad=on/autocast=on", "replicas=1/grad=off/autocast=off")
    assert _risky(target, one) and _risky(target, autocast) and not _risky(target, two)
    # (stated here: one replica, and autocast on)
    assert builtin.data_parallel().risky_signatures == target.risky_signatures == ("replicas=1/*", "*/autocast=on")


# --------------------------------------------------------------------------- 2. coverage-guided sampling


class _Ops:
    """A target of our own: ``op(x, kind)``, whose signature is ``kind``."""

    def __init__(self) -> None:
        self.classified = 0

    @staticmethod
    def op(x: torch.Tensor, kind: str) -> torch.Tensor:
        return x * 2

    def signature(self, args: tuple, kwargs: dict) -> str:
        self.classified += 1
        return args[1]

    def target(self, name: str = "op") -> builtin.Target:
        return builtin.Target(name, self, "op", _Ops.op, isolate=False, signature=self.signature)


def test_the_first_calls_of_every_signature_are_compared_whatever_the_rate():
    """At rate 0 nothing would ever be compared; guided, the first calls of each signature are, a rare one (1% of
    the calls) included. Every call is classified until each signature seen has had its first calls, then one in
    CLASSIFY_ONE_IN; the total is exact, each signature's count an estimate that adds up to it."""
    from shadow.core.calls.gate.coverage import CLASSIFY_ONE_IN

    ops = _Ops()
    x = torch.ones(3)
    kinds = ["common"] * 99 + ["rare"]
    with shadow.install([ops.target()], sample_rate=0.0, first_per_signature=5, seed=0) as monitor:
        # (the rare signature is found on a classified call, one in CLASSIFY_ONE_IN: about 6 of its 400 calls are)
        for kind in kinds * 400:
            assert torch.equal(ops.op(x, kind), x * 2)
        stats = monitor.stats()["op"]
    assert stats.calls == 40_000 and sum(stats.signature_calls.values()) == 40_000
    assert set(stats.signature_calls) == {"common", "rare"}
    assert stats.compared == 5 + 5 and stats.match == 10
    # every call from the rare signature's discovery to its fifth call (500 calls), about one in CLASSIFY_ONE_IN
    # of the others
    assert ops.classified < 5 + 5 * 100 + 2 * 40_000 / CLASSIFY_ONE_IN


def _estimate_sd(calls: int, share: float) -> float:
    """The standard deviation of a signature's estimated calls: systematic sampling with geometric gaps of mean
    CLASSIFY_ONE_IN, each classified call counting its gap (n p (1 - p) E[g^2] / E[g])."""
    from shadow.core.calls.gate.coverage import CLASSIFY_ONE_IN

    q = 1 / CLASSIFY_ONE_IN
    mean_gap, mean_square_gap = 1 / q, (2 - q) / q**2  # (a geometric gap on {1, 2, ...})
    return (calls * share * (1 - share) * mean_square_gap / mean_gap) ** 0.5


def test_sampled_classification_estimates_each_signatures_calls_without_bias():
    """Once the first calls are done, a call that ends a gate counts the gate's calls under its signature: the
    estimate of a signature of share p is within 4 standard deviations of its true count, the variance computed
    here for geometric gaps (systematic sampling: n p (1 - p) E[g^2] / E[g])."""
    from shadow.core.calls.gate.coverage import CLASSIFY_ONE_IN

    ops = _Ops()
    draw = random.Random(7)
    n, share = 100_000, 0.1
    kinds = ["rare" if draw.random() < share else "common" for _ in range(n)]
    x = torch.ones(1)
    with shadow.install([ops.target()], sample_rate=0.0, first_per_signature=1, seed=3) as monitor:
        for kind in kinds:
            ops.op(x, kind)
        stats = monitor.stats()["op"]
    true = kinds.count("rare")
    sd = _estimate_sd(n, true / n)
    assert stats.calls == n and sum(stats.signature_calls.values()) == n
    assert abs(stats.signature_calls["rare"] - true) <= 4 * sd, (stats.signature_calls, true, sd)
    assert ops.classified < 2 * n / CLASSIFY_ONE_IN  # (the signature function ran on about 1 call in CLASSIFY_ONE_IN)


def test_without_guidance_unsampled_calls_are_not_classified():
    ops = _Ops()
    with shadow.install([ops.target()], sample_rate=0.0, first_per_signature=0) as monitor:
        for _ in range(100):
            ops.op(torch.ones(1), "common")
        stats = monitor.stats()["op"]
    assert (ops.classified, stats.calls, stats.compared, dict(stats.signature_calls)) == (0, 100, 0, {})


def test_a_failing_signature_function_never_reaches_the_job():
    def broken(args: tuple, kwargs: dict) -> str:
        raise RuntimeError("the user's signature function is broken")

    ops = _Ops()
    target = builtin.Target("op", ops, "op", _Ops.op, isolate=False, signature=broken)
    with shadow.install([target], sample_rate=0.0, first_per_signature=2) as monitor:
        outs = [ops.op(torch.ones(1), "x") for _ in range(4)]
        stats = monitor.stats()["op"]
    assert all(torch.equal(o, torch.full((1,), 2.0)) for o in outs)
    assert dict(stats.signature_calls) == {"unclassified": 4} and stats.compared == 2


def test_calls_by_signature_reach_the_metrics_and_weight_the_verdict():
    """npu_shadow_calls_total has a series per signature; the verdict weights each signature by its share of calls,
    so 30 clean comparisons of a signature that is 99.9% of the calls count for it, not 30 of a rare one."""
    from prometheus_client.exposition import generate_latest

    from exporters.prometheus import PrometheusExporter
    from shadow.analysis import sources, verdict

    ops = _Ops()
    exporter = PrometheusExporter()
    with shadow.install([ops.target()], sample_rate=0.0, first_per_signature=30, exporters=[exporter]):
        for i in range(30_000):
            ops.op(torch.ones(1), "rare" if i % 1000 == 0 else "common")
    counts = sources.from_exposition(generate_latest(exporter.registry).decode())["op"]
    assert counts.phase().calls == {"": 0, "common": 29_970, "rare": 30}
    assert counts.compared == 60
    assert counts.phase().cluster_count == 1  # (one process, within a minute)
    counts.phase().cluster_count = 0  # (the weighting is under test here: each comparison counted as independent)
    decision = verdict.decide("op", counts, 0.001)
    # 30 clean comparisons of 99.9% of the calls bound the rate as 30 comparisons do, not as 60
    assert decision.weighted and decision.effective == 60
    one = verdict.decide("op", _one_stratum(counts), 0.001)
    assert not one.weighted and decision.upper > one.upper
    # a divergence in the rare signature weighs its share of calls (0.1%), not half
    counts.add_outcome("rare", "mismatch", 1)
    counts.phase().outcomes[("rare", "match")] -= 1
    assert verdict.decide("op", counts, 0.001).rate == pytest.approx(0.001 / 30)


def _one_stratum(counts):
    """The same comparisons without calls by signature."""
    from shadow.analysis import evidence

    alone = evidence.TargetCounts()
    for (signature, outcome), value in counts.phase().outcomes.items():
        alone.add_outcome(signature, outcome, value)
    return alone


def test_nested_calls_of_a_guided_target_are_not_counted():
    ops = _Ops()

    def legacy(x: torch.Tensor, kind: str) -> torch.Tensor:
        return x * 2 if kind == "inner" else ops.op(x, "inner")  # legacy calls the wrapped function itself

    target = builtin.Target("op", ops, "op", _Ops.op, legacy=legacy, isolate=False, signature=ops.signature)
    with shadow.install([target], sample_rate=1.0, first_per_signature=3) as monitor:
        for _ in range(5):
            ops.op(torch.ones(1), "outer")
        stats = monitor.stats()["op"]
    # (a nested call is not classified at all: the signature function never sees it)
    assert dict(stats.signature_calls) == {"outer": 5} and stats.compared == 5


def test_guided_counts_add_up_under_threads():
    ops = _Ops()
    with shadow.install([ops.target()], sample_rate=0.01, first_per_signature=10, seed=1) as monitor:
        # (all four alive before any call: a thread started while an upstream run is under way counts as that run's
        # own, as DataParallel's workers are)
        ready = threading.Barrier(4)

        def work(kind: str) -> None:
            ready.wait()
            for _ in range(500):
                ops.op(torch.ones(1), kind)

        threads = [threading.Thread(target=work, args=(k,)) for k in ("a", "b", "a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = monitor.stats()["op"]
    # the total exact, the estimates by signature adding up to it (each within 4 standard deviations)
    assert stats.calls == 2000 and sum(stats.signature_calls.values()) == 2000
    sd = _estimate_sd(2000, 0.5)
    assert set(stats.signature_calls) == {"a", "b"} and abs(stats.signature_calls["a"] - 1000) <= 4 * sd
    assert stats.compared >= 20


def test_first_per_signature_is_checked_at_start_up():
    with pytest.raises(ValueError, match="first_per_signature"):
        shadow.install([_Ops().target()], first_per_signature=-1)


# --------------------------------------------------------------------------- 4. clustered bounds


def _journal(path, windows: int, per_window: int, divergent_windows: int = 0, pids: int = 1, stride: int = 1):
    """Every outcome of ``pids`` processes, ``per_window`` comparisons in each of ``windows`` minutes; one divergence
    in each of the first ``divergent_windows`` minutes ``stride`` apart."""
    import journals

    lines = []
    for pid in range(pids):
        for w in range(windows):
            for i in range(per_window):
                diverging = w % stride == 0 and w // stride < divergent_windows
                outcome = "mismatch" if diverging and i == 0 else "match"
                lines.append(journals.line(outcome, timestamp=1_699_999_980.0 + 60 * w + i * 0.01, pid=100 + pid))
    return journals.write(path, lines)


def test_a_clean_million_calls_from_one_process_minute_are_not_a_million_trials(tmp_path):
    from shadow.analysis import sources, verdict

    one_window = sources.from_journal([_journal(tmp_path / "a.jsonl", 1, 5000)])["op"]
    decision = verdict.decide("op", one_window, 0.001)
    assert decision.compared == 5000 and decision.clusters == 1 and decision.effective == 1
    assert decision.decision == verdict.INCONCLUSIVE and decision.upper > 0.9
    spread = sources.from_journal([_journal(tmp_path / "b.jsonl", 5000, 1)])["op"]
    decision = verdict.decide("op", spread, 0.001)
    assert (decision.clusters, decision.effective, decision.decision) == (5000, 5000, verdict.PROMOTE)
    by_process = sources.from_journal([_journal(tmp_path / "c.jsonl", 2, 10, pids=3)], window=0)["op"]
    assert verdict.decide("op", by_process, 0.001).clusters == 3


def test_each_cluster_counts_as_one_comparison_at_its_rate(tmp_path):
    """10 divergences spread over 10 of 1,000 minutes or bunched in one: 1,000 effective comparisons either way
    (each cluster one observation in [0, 1], whatever the correlation inside it), never the 10,000 calls. (Spread
    100 minutes apart: divergences in consecutive minutes would be one incident, one cluster.)"""
    from shadow.analysis import sources, verdict

    spread = sources.from_journal([_journal(tmp_path / "s.jsonl", 1000, 10, 10, stride=100)])["op"]
    spread = verdict.decide("op", spread, 0.5)
    path = _journal(tmp_path / "b.jsonl", 1000, 10)
    lines = path.read_text().splitlines()
    lines[1:11] = [
        line.replace('"match"', '"mismatch"').replace('"reasons": []', '"reasons": ["value"]') for line in lines[1:11]
    ]
    path.write_text("\n".join(lines) + "\n")
    bunched = verdict.decide("op", sources.from_journal([path])["op"], 0.5)
    assert spread.divergent == bunched.divergent == 10 and spread.compared == bunched.compared == 10_000
    assert spread.effective == bunched.effective == spread.clusters == bunched.clusters == 1000


def test_the_cluster_window_can_only_widen_the_bound(tmp_path):
    """`--cluster-window 0.5` made ten clusters of each process-minute below and turned inconclusive into promote on
    the same journal: a window shorter than the default counts the default's clusters; a longer one, fewer."""
    import journals

    from shadow.analysis import sources, verdict

    lines = [journals.line("match", timestamp=1_699_999_980.0 + 60 * w + 6 * i) for w in range(40) for i in range(10)]
    path = journals.write(tmp_path / "j.jsonl", lines)
    decided = {
        window: verdict.decide("op", sources.from_journal([path], window=window)["op"], 0.05)
        for window in (0.5, 10, 60, 120)
    }
    assert decided[0.5].clusters == decided[10].clusters == decided[60].clusters == 40 > decided[120].clusters
    assert decided[0.5].upper == decided[60].upper <= decided[120].upper
    assert decided[0.5].decision == decided[60].decision == verdict.INCONCLUSIVE


def test_the_verdict_names_its_statistic_and_effective_sample_size(tmp_path):

    path = _journal(tmp_path / "j.jsonl", 40, 10)
    done = npu_shadow_here("verdict", "--journal", str(path), "--cluster-window", "120")
    assert "legacy phase: rate 0 over 20.0 effective comparisons (one stratum)" in done.stdout
    assert "20 clusters (process x 120 s blocks from its start), each counted as one comparison" in done.stdout
    bad = npu_shadow_here("verdict", "--journal", str(path), "--cluster-window", "-1")
    assert bad.returncode == 2 and "--cluster-window" in bad.stderr


# --------------------------------------------------------------------------- 3. the noise floor (A/A)


#: The jitter's own generator: not one the isolation restores between runs (torch's, NumPy's, Python's global
#: one), so every run draws anew; seeded per target, so a test's draws never depend on the tests before it.
_JITTER = random.Random()


def _jitter(scale: float) -> float:
    """Noise no RNG state the isolation controls: what a nondeterministic kernel (atomics, reduction order) looks
    like from outside."""
    return (_JITTER.random() - 0.5) * scale


class _Noisy:
    """A deliberately nondeterministic target: legacy and upstream add a jitter of their own to ``2 x``;
    ``offset`` moves upstream beyond it (a real divergence)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        _JITTER.seed(0)

    @staticmethod
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + _jitter(1e-3)

    def upstream(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + _jitter(1e-3) + self.offset

    def target(self) -> builtin.Target:
        return builtin.Target("noisy", self, "op", self.upstream, exact=True, signature=lambda a, k: "call")


def test_a_nondeterministic_targets_own_noise_is_measured_and_not_called_a_divergence():
    noisy = _Noisy()
    with shadow.install([noisy.target()], sample_rate=1.0, aa_rate=1.0, seed=3) as monitor:
        for _ in range(200):
            noisy.op(torch.ones(4))
        stats = monitor.stats()["noisy"]
        (experiment,) = monitor._experiments
        floor = experiment.noise_floor()["call"]
    assert floor[2] == 200 and floor[3] >= 190 and 5e-4 < floor[0] <= 1e-3  # (two jitters may round alike)
    assert stats.compared == 200 and stats.noise >= 190  # (the very first call had no floor yet)
    # (two jitters rounding to one float32, about 1 call in 4,000, compare as a plain match)
    assert stats.mismatch == 200 - stats.noise - stats.match and stats.mismatch <= 10 and stats.match <= 2


def test_a_difference_beyond_the_noise_floor_stays_a_divergence():
    beyond = _Noisy(offset=0.01)
    with shadow.install([beyond.target()], sample_rate=1.0, aa_rate=1.0, seed=3) as monitor:
        for _ in range(250):  # (held until the burn-in's 200 A/A runs fix the thresholds, then judged)
            beyond.op(torch.ones(4))
        stats = monitor.stats()["noisy"]
    assert (stats.mismatch, stats.noise) == (250, 0)
    assert stats.noise_checks["forward/ab/beyond"] == 250, stats.noise_checks


def test_a_deterministic_target_has_a_floor_of_zero_and_its_differences_stay_mismatches():
    """On the emulated npu the ops are deterministic: the floor is 0, so nothing is excused as noise."""
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    target = builtin.Target("det", ops, "op", lambda x: x * 2 + 1e-3, exact=True, signature=lambda a, k: "call")
    with shadow.install([target], sample_rate=1.0, aa_rate=1.0) as monitor:
        for _ in range(20):
            ops.op(torch.ones(4, device="npu:0"))
        stats = monitor.stats()["det"]
        (experiment,) = monitor._experiments
        assert experiment.noise_floor() == {"call": (0.0, 0.0, 20, 0)}
    assert (stats.mismatch, stats.noise) == (20, 0)


def test_the_noise_floor_is_exported_and_journaled(tmp_path):
    import json

    from prometheus_client.exposition import generate_latest

    from exporters.journal import JsonlExporter
    from exporters.prometheus import PrometheusExporter
    from shadow.analysis import sources

    noisy = _Noisy()
    exporter = PrometheusExporter()
    journal = JsonlExporter(str(tmp_path / "j.jsonl"), all_outcomes=True)
    with shadow.install([noisy.target()], sample_rate=1.0, aa_rate=0.5, seed=5, exporters=[exporter, journal]):
        for _ in range(400):
            noisy.op(torch.ones(4))
    journal.close()
    text = generate_latest(exporter.registry).decode()
    floor = [line for line in text.splitlines() if line.startswith('npu_shadow_noise_floor{measure="abs"')]
    assert len(floor) == 1 and 5e-4 < float(floor[0].split()[-1]) <= 1e-3
    runs = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("npu_shadow_aa_runs_total{"))
    assert 260 < runs < 340  # (every call of the burn-in's 200, then about half the others)
    records = [r for r in map(json.loads, (tmp_path / "j.jsonl").read_text().splitlines()) if "outcome" in r]
    assert sum(r["aa"] for r in records) == runs and max(r["aa_abs_error"] for r in records) > 5e-4
    # (the calls and A/A runs after the burn-in's 200 A/A runs, judged against the levels it fixed: about half of
    # each side above the typical error)
    judged = {(r["noise_check"], r["aa_check"]) for r in records}
    assert {("below", None), ("within", None), ("below", "within"), ("within", "below")} <= judged, judged
    counts = sources.from_exposition(text)["noisy"]
    from_journal = sources.from_journal([str(tmp_path / "j.jsonl")])["noisy"]
    assert counts.phase().noise == from_journal.phase().noise  # (one count, every source)
    ab = sum(counts.phase().noise.get(("forward", "ab", check), 0) for check in ("below", "within", "beyond"))
    assert counts.compared == 400 and ab == sum(1 for r in records if r["noise_check"]) > 100


def test_aa_rate_is_checked_at_start_up():
    with pytest.raises(ValueError, match="aa_rate"):
        shadow.install([_Noisy().target()], aa_rate=2.0)


# --------------------------------------------------------------------------- 5. suite A/B


AB_SUITE = """
import torch


def test_cast_in_compiled_code():
    torch.accelerator.set_device_index(0)
    compiled = torch.compile(lambda a: a.type("torch.npu.HalfTensor"), backend="eager")
    out = compiled(torch.ones(3, device="npu:1"))
    assert out.device == torch.device("npu:0")  # what the job relies on: legacy casts onto the current npu


def test_plain():
    assert torch.ones(2).type(torch.float16).dtype == torch.float16
"""


@pytest.mark.slow
def test_a_suite_ab_finds_the_difference_compiled_code_hides_from_call_level_shadowing(tmp_path):
    """In compiled code the legacy patch is traced into the graph: no call reaches the shadow wrapper, and
    ``--npu-shadow`` alone reports no divergence. Run with and without the patches, the test's outcome changes, and
    the A/B says so in the journal that the verdict and the report read."""
    import json
    import subprocess
    import sys

    from torch_npu_wheels import wheel

    (tmp_path / "test_suite.py").write_text(AB_SUITE)
    journal = tmp_path / "j.jsonl"
    legacy = ["-q", "--npu-shadow-emulate-npu", "2", "--npu-shadow-legacy-from", wheel("2.12.0")]
    done = subprocess.run(
        [sys.executable, "-m", "shadow", "ab", "--journal", str(journal), "--", *legacy],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 tests, 1 changed their outcome without the patches" in done.stdout
    assert "test_suite.py::test_cast_in_compiled_code: legacy world: passed; upstream world: failed" in done.stdout
    records = [r for r in map(json.loads, journal.read_text().splitlines()) if "outcome" in r]
    call_level = [r for r in records if r["target"] == "tensor_type"]
    assert call_level and all(r["outcome"] == "match" for r in call_level)  # what call-level shadowing saw
    ab = {r["test"]: r for r in records if r["target"] == "suite_ab"}
    assert ab["test_suite.py::test_plain"]["outcome"] == "match"
    changed = ab["test_suite.py::test_cast_in_compiled_code"]
    assert (changed["outcome"], changed["reasons"], changed["signature"]) == (
        "mismatch",
        ["exception"],
        "test/passed->failed",
    )
    assert "assert device(type='npu', index=1) == device(type='npu', index=0)" in changed["detail"]
    verdict = npu_shadow_here("verdict", "--journal", str(journal))
    assert verdict.returncode == 1 and "suite_ab" in verdict.stdout and "hard mismatches: 1 exception" in verdict.stdout


# --------------------------------------------------------------------------- 7. a report people look at


def test_an_exception_divergence_shows_both_sides_however_long_legacys_text():
    from shadow.core.judging.compare import compare_exceptions
    from shadow.core.model.observation import DETAIL_LIMIT

    legacy = RuntimeError("torch_npu says no " + "[ERR00001] PTA invalid parameter " * 40)
    found = compare_exceptions(legacy, TypeError("upstream: 'torch_npu.npu.HalfTensor' is not a type"))
    assert found.outcome == "error" and len(found.detail) <= DETAIL_LIMIT
    assert found.detail.startswith("legacy raised RuntimeError: torch_npu says no")
    assert found.detail.endswith("; upstream raised TypeError: upstream: 'torch_npu.npu.HalfTensor' is not a type")


def test_a_fire_drill_is_named_in_the_verdict_and_the_report(tmp_path):

    import journals

    lines = [
        journals.line("mismatch", drill=True, detail="(drill) value 1 of 4 differs " + "x" * 400) for _ in range(3)
    ] + [journals.line("match", drill=False)] * 10
    journal = journals.write(tmp_path / "j.jsonl", lines)
    verdict = npu_shadow_here("verdict", "--journal", str(journal))
    assert "FIRE DRILL: 3 comparisons carry synthetic divergence injected by a fire drill (op)" in verdict.stdout
    assert verdict.stdout.rstrip().endswith("- a FIRE DRILL")
    report = npu_shadow_here(
        "report", "--journal", str(journal), "--html", str(tmp_path / "r.html"), "--markdown", str(tmp_path / "r.md")
    )
    assert report.returncode == 0, report.stderr
    markdown = (tmp_path / "r.md").read_text()
    assert "**FIRE DRILL: 3 comparisons carry synthetic divergence" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| op | call | mismatch"))
    assert len(row) < 300 and "characters more in the HTML report" in row  # the repeated details folded
    assert "<details><summary>(drill) value 1 of 4 differs" in (tmp_path / "r.html").read_text()


def test_the_metrics_of_a_drill_name_it_too():
    from shadow.analysis import sources, verdict
    from shadow.analysis.decisions import drill_note

    text = (
        'npu_shadow_comparisons_total{target="op",outcome="mismatch",signature="call"} 5\nnpu_shadow_drill_active 1\n'
    )
    decisions = verdict.decide_all(sources.from_exposition(text), 0.001, {}, 30)
    assert decisions[0].drilled == -1
    assert drill_note(decisions).startswith("FIRE DRILL: the metrics show synthetic divergence")


def test_a_drill_names_only_the_targets_it_drilled_and_its_difference_never_reads_as_a_cause(capsys):
    """The demo's ``--drill value:1.0``: the FIRE DRILL line listed eleven targets, six never called; the drilled
    foreach device list read as a real hard mismatch with its meaning ("deleting the patch changes whether the
    optimizers run their foreach kernels"), and its evidence as "clusters: not counted by this source (processes of a
    version before clusters were counted)"."""
    from shadow.analysis import sources, verdict
    from shadow.analysis.decisions import drill_note
    from shadow.launcher.commands import verdict as verdict_command

    series = 'target="foreach_devices",signature="devices",primary="legacy"'
    text = (
        f'npu_shadow_comparisons_total{{{series},outcome="mismatch"}} 32\n'
        f'npu_shadow_mismatches_total{{target="foreach_devices",primary="legacy",reason="custom"}} 32\n'
        f'npu_shadow_drilled_total{{{series},outcome="mismatch"}} 32\n'
        'npu_shadow_clusters_total{target="foreach_devices",primary="legacy"} 0\n'
        'npu_shadow_comparisons_total{target="lstm_forward",signature="s",primary="legacy",outcome="match"} 0\n'
        "npu_shadow_drill_active 1\n"
    )
    decisions = verdict.decide_all(sources.from_exposition(text), 0.001, {}, 30)
    by_target = {d.target: d for d in decisions}
    assert drill_note(decisions).startswith("FIRE DRILL: 32 comparisons carry synthetic divergence injected "
                                                    "by a fire drill (foreach_devices):")  # fmt: skip
    drilled = by_target["foreach_devices"]
    assert drilled.decision == verdict.ROLLBACK and "a rehearsal, not a cause" in drilled.why
    assert verdict.CUSTOM_MEANING["foreach_devices"] not in drilled.why
    (evidence,) = verdict_command.evidence_lines(drilled)
    assert "no clusters (a fire drill's comparisons are no evidence" in evidence
    nothing_compared = verdict_command.evidence_lines(by_target["lstm_forward"])
    assert "version before" not in "".join(nothing_compared)  # (no clause)


def test_a_wall_clock_that_jumps_makes_no_clusters_and_is_said(tmp_path):
    """A process whose wall clock jumps an hour between count records, its monotonic clock advancing 30 s: its
    comparisons are as many clusters as on a steady clock (before, each record opened a cluster of its own: more
    evidence from a broken clock), and the verdict says the jump."""
    import journals

    from shadow.analysis import sources, verdict

    def journal(name: str, jump: float) -> str:
        records = []
        for i in range(1, 41):
            record = journals.counts({"call": {"match": 10 * i}}, timestamp=1_700_000_000.0 + (30 + jump) * i)
            record["mono"] = 5_000.0 + 30.0 * i
            record["clusters"] = 0
            records.append(record)
        return str(journals.write(tmp_path / name, records))

    steady = verdict.decide("op", sources.from_journal([journal("steady.jsonl", 0)])["op"], 0.05)
    jumping_counts = sources.from_journal([journal("jumping.jsonl", 3600)])["op"]
    jumping = verdict.decide("op", jumping_counts, 0.05)
    assert steady.clusters == jumping.clusters == 20  # (20 minutes of process time, one cluster a minute)
    assert steady.upper == jumping.upper
    assert any("the wall clock jumped +3600 s" in note for note in jumping_counts.notes)
    assert jumping_counts.process_seconds == steady.clusters * 60 - 30  # (its own time, not ten hours)
