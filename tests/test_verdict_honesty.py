"""The verdict a statistician would sign: complete evidence, honest bounds under skips, clusters and repeated
looks, a noise floor that cannot be gamed, phases kept apart. One section per point of the audit, each with the
constructed case it found; the statistics are checked against independent computations (scipy, brute force) and
by simulation."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import types

import journals
import numpy as np
import pytest
import torch
from commands import npu_shadow, npu_shadow_here
from scipy.optimize import brentq
from scipy.stats import beta, mannwhitneyu

import shadow
from exporters import JsonlExporter, PrometheusExporter
from shadow.analysis import bounds, evidence, sources, verdict
from shadow.analysis.bounds import Prior, Stratum
from shadow.analysis.evidence import TargetCounts
from shadow.analysis.verdict import INCONCLUSIVE, PROMOTE, ROLLBACK
from shadow.core.model import contract
from shadow.core.model import targets as builtin
from shadow.core.model.observation import COMPARED_OUTCOMES, DIVERGENT_OUTCOMES

MAX = 0.001
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIOR = Prior.for_max_rate(MAX)


def decide(counts: TargetCounts, max_rate: float = MAX) -> verdict.Decision:
    """The verdict's decision on ``counts`` (its reasons without the ETA's simulation: these tests read decisions and
    bounds; tests/test_verdict_cases.py reads the ETA)."""
    return verdict.decide("op", counts, max_rate, explain=False)


def strata_counts(strata: dict[str, tuple[int, int, int]], primary: str = "legacy") -> TargetCounts:
    """{signature: (calls, compared, divergent)} as a metrics source would give them."""
    counts = TargetCounts()
    for signature, (calls, n, k) in strata.items():
        counts.add_calls(signature, calls, primary)
        counts.add_outcome(signature, "match", n - k, primary)
        counts.add_outcome(signature, "mismatch", k, primary)
        counts.add_reason("value", k, primary)
    return counts


def verdict_cli(*args: str) -> subprocess.CompletedProcess:
    """``npu-shadow verdict ARGS``, in this process: these tests are of what it decides and says."""
    return npu_shadow_here("verdict", *args)


# --------------------------------------------------------------------------- the statistic itself


def _mixture_by_integration(p: float, k: int, n: int, prior: Prior) -> float:
    """The beta-binomial mixture martingale M(p) by numerical integration of the likelihood ratio (independent of
    the closed form with beta functions)."""
    from scipy.integrate import quad

    def ratio(q: float) -> float:
        return math.exp(k * (math.log(q) - math.log(p)) + (n - k) * (math.log1p(-q) - math.log1p(-p)))

    density = beta(prior.a, prior.b).pdf
    points = [min(max(k / n, 1e-9), 1 - 1e-9), p]
    return quad(lambda q: ratio(q) * density(q), 0, 1, points=points, limit=500, epsabs=0, epsrel=1e-10)[0]


@pytest.mark.parametrize("k, n, p", [(0, 3000, 0.001), (3, 1000, 0.01), (2, 30, 0.2), (40, 5000, 0.006)])
def test_the_mixture_martingale_is_the_integral_it_claims(k, n, p):
    closed = math.exp(bounds.log_martingale(p, k, n, PRIOR))
    assert closed == pytest.approx(_mixture_by_integration(p, k, n, PRIOR), rel=1e-6)


@pytest.mark.parametrize("k, n", [(0, 3000), (0, 8_000_000), (1, 50), (3, 1000), (40, 5000), (20, 30), (30, 30)])
def test_the_one_stratum_upper_bound_is_the_greatest_rate_the_martingale_allows(k, n):
    """The greatest p whose mixture martingale, integrated numerically, stays under 1/alpha: found by a root
    finder on that integral (independent of the bound's Newton steps and of its closed form)."""
    if k == n:  # (every comparison diverged: no rate up to 1 is ruled out)
        assert bounds.upper_bound(k, n, PRIOR) == 1.0
        return
    excess = lambda p: math.log(_mixture_by_integration(p, k, n, PRIOR)) - math.log(1 / bounds.ALPHA)  # noqa: E731
    low = max(k / n, 1e-6 / n)  # (the least likely-hood's rate: the martingale is below 1/alpha there)
    high = min((k + 1) / n, (1 + k / n) / 2)
    while excess(high) < 0:
        high = min(2 * high, (1 + high) / 2)
    assert bounds.upper_bound(k, n, PRIOR) == pytest.approx(brentq(excess, low, high, xtol=1e-300), rel=1e-6)


def _log_evidence_by_integration(s1: Stratum, s2: Stratum) -> float:
    """log C of the mixture (3/4 on one shared rate, 1/4 on independent rates), by numerical integration."""
    from scipy.integrate import quad

    density = beta(PRIOR.a, PRIOR.b).pdf

    def likelihood(q, s):
        return math.exp(s.k * math.log(q) + (s.n - s.k) * math.log1p(-q)) if 0 < q < 1 else 0.0

    def integral(f, s):
        # (the likelihood lives within a few standard deviations of k/n: integrate there and beyond apart)
        edge = min(0.5, (s.k + 60 + 10 * math.sqrt(s.k + 1)) / s.n)
        main = quad(lambda q: f(q) * density(q), 0, edge, limit=500, epsabs=0, epsrel=1e-10)[0]
        # (beyond the edge the integrand is nothing next to the main part: an absolute tolerance there)
        return main + quad(lambda q: f(q) * density(q), edge, 1, limit=500, epsabs=1e-12 * main)[0]

    pooled = Stratum(1, s1.k + s2.k, s1.n + s2.n)
    shared = integral(lambda q: likelihood(q, s1) * likelihood(q, s2), pooled)
    apart = integral(lambda q: likelihood(q, s1), s1) * integral(lambda q: likelihood(q, s2), s2)
    return math.log(0.75 * shared + 0.25 * apart)


def _nll(p: float, s: Stratum) -> float:
    return -(s.k * math.log(p) if s.k else 0.0) - (s.n - s.k) * math.log1p(-p)


def _brute_two_strata(s1: Stratum, s2: Stratum, upper: bool) -> float:
    """max/min of w1 p1 + w2 p2 over {p : nll_1(p1) + nll_2(p2) < log(1/alpha) - log C}, by a fine grid over p1 and
    a 1-D root for p2."""
    budget = math.log(1 / bounds.ALPHA) - _log_evidence_by_integration(s1, s2)
    best = None
    mle1, mle2 = s1.k / s1.n, s2.k / s2.n
    floor = budget - _nll(mle2, s2) if mle2 > 0 or s2.k == 0 else budget
    hi1 = brentq(lambda p: _nll(p, s1) - floor, mle1, 1 - 1e-15) if _nll(1 - 1e-15, s1) > floor else 1 - 1e-15
    lo1 = 0.0 if s1.k == 0 else brentq(lambda p: _nll(p, s1) - floor, 1e-300, mle1)
    grid = np.linspace(lo1, hi1, 8001)
    for p1 in grid[:-1] if upper else grid:
        left = budget - (_nll(p1, s1) if p1 > 0 or s1.k == 0 else math.inf)
        if left <= _nll(mle2, s2) if (mle2 > 0 or s2.k == 0) else False:
            continue

        def g(p2, left=left):
            return _nll(p2, s2) - left

        if upper:
            p2 = brentq(g, mle2, 1 - 1e-15, xtol=1e-15) if g(1 - 1e-15) > 0 else 1.0
        else:
            p2 = brentq(g, 1e-300, mle2, xtol=1e-300) if mle2 > 0 and g(1e-300) > 0 else 0.0
        value = s1.weight * p1 + s2.weight * p2
        best = value if best is None else (max(best, value) if upper else min(best, value))
    return best


@pytest.mark.parametrize(
    "s1, s2",
    [
        (Stratum(0.95, 0, 100_000), Stratum(0.05, 0, 30)),
        (Stratum(0.95, 0, 100_000), Stratum(0.05, 2, 30)),
        (Stratum(0.5, 3, 1000), Stratum(0.5, 1, 200)),
    ],
)
def test_the_stratified_bounds_are_the_extremes_of_the_joint_region(s1, s2):
    low, high = bounds.bounds([s1, s2], PRIOR)
    brute = _brute_two_strata(s1, s2, upper=True)  # (a grid: never above the true maximum)
    if s1.k == s2.k == 0:
        assert brute - 1e-12 <= high <= brute * (1 + 1e-3)
    else:  # (the upper bound's budget is larger than the exact one, so that it grows with every divergence)
        assert brute - 1e-12 <= high <= 2 * brute
    each = [bounds.lower_bound(s.k, s.n, bounds.ALPHA * s.weight) for s in (s1, s2)]
    assert low == pytest.approx(s1.weight * each[0] + s2.weight * each[1])


def _jeffreys_lower_by_integration(k: int, n: int, alpha: float) -> float:
    """The least p below k/n whose Jeffreys mixture martingale, integrated numerically, is under 1/alpha."""
    from scipy.integrate import quad

    density = beta(0.5, 0.5).pdf

    def m(p):
        ratio = lambda q: math.exp(k * (math.log(q) - math.log(p)) + (n - k) * (math.log1p(-q) - math.log1p(-p)))  # noqa: E731
        return sum(quad(lambda q: ratio(q) * density(q), lo, hi, limit=500)[0] for lo, hi in ((0, k / n), (k / n, 1)))

    return brentq(lambda p: m(p) - 1 / alpha, 1e-9, k / n * (1 - 1e-9))


@pytest.mark.parametrize("k, n", [(5, 1000), (2, 30), (40, 5000)])
def test_the_lower_bound_is_the_jeffreys_mixtures(k, n):
    assert bounds.lower_bound(k, n) == pytest.approx(_jeffreys_lower_by_integration(k, n, 0.05), rel=1e-5)


def test_a_stratum_never_compared_adds_its_whole_share_to_the_upper_bound_only():
    low, high = bounds.bounds([Stratum(0.7, 0, 50_000), Stratum(0.3, 0, 0)], PRIOR)
    alone_low, alone_high = bounds.bounds([Stratum(0.7, 0, 50_000)], PRIOR)
    assert high == pytest.approx(0.3 + alone_high) and low == alone_low == 0.0


def test_with_a_guided_allocation_the_strata_cost_little():
    """Comparisons in proportion to calls: the joint bound is within a few percent of one stratum's."""
    one = bounds.upper_bound(0, 20_000, PRIOR)
    many = bounds.bounds([Stratum(w, 0, 20_000 * w) for w in (0.5, 0.3, 0.15, 0.05)], PRIOR)[1]
    assert one <= many <= 1.1 * one


# --------------------------------------------------------------------------- 1. a noise floor that cannot be gamed


#: The noise's own generator: not one the isolation restores between runs, so every run draws anew; seeded per
#: pair, so a test's draws never depend on the tests before it.
_NOISE = random.Random()


def _uniform(scale: float) -> float:
    """Noise no RNG state the isolation controls (it restores torch's, NumPy's and Python's global generators)."""
    return (_NOISE.random() - 0.5) * scale


class _Pair:
    """A nondeterministic legacy and an upstream that departs from it in a chosen way."""

    def __init__(self, legacy, upstream) -> None:
        self.legacy, self.upstream_fn = legacy, upstream
        _NOISE.seed(0)

    def op(self, x):  # replaced by the monitor's wrapper
        return self.legacy(x)

    def target(self, name: str = "noisy") -> builtin.Target:
        ops = types.SimpleNamespace(op=self.legacy)
        self.ops = ops
        return builtin.Target(name, ops, "op", self.upstream_fn, exact=True, signature=lambda a, k: "call")


def _shadow(pair: _Pair, inputs, primary: str = "legacy", journal=None, aa_rate: float = 1.0):
    exporters = [journal] if journal is not None else []
    target = pair.target()
    with shadow.install([target], sample_rate=1.0, aa_rate=aa_rate, seed=3, primary=primary, exporters=exporters) as m:
        for x in inputs:
            pair.ops.op(x)
        return m.stats()["noisy"], m._experiments[0]


def test_one_large_input_early_does_not_raise_the_floor_for_the_rest_of_the_run(tmp_path):
    """Legacy's noise scales with its input; one huge input comes first; upstream is off by a constant 2e-3 (1000x
    legacy's own noise on the rest). The running-maximum floor called all 400 calls noise and the verdict promoted."""
    pair = _Pair(
        lambda x: x * 2 + _uniform(1e-6) * x.abs(),
        lambda x: x * 2 + _uniform(1e-6) * x.abs() + 2e-3,
    )
    inputs = [torch.full((4,), 1e4, dtype=torch.float64)] + [torch.ones(4, dtype=torch.float64)] * 400
    journal = JsonlExporter(str(tmp_path / "j.jsonl"))
    stats, _ = _shadow(pair, inputs, journal=journal)
    journal.close()
    assert stats.compared == 401 and stats.noise == 0 and stats.mismatch >= 400
    counts = sources.from_journal([str(tmp_path / "j.jsonl")])["noisy"]
    assert verdict.decide("noisy", counts, MAX).decision != PROMOTE


def test_an_element_near_zero_cannot_make_the_floor_infinite():
    """One output element is sometimes 0 and sometimes 1e-7 in legacy's A/A runs (an infinite relative floor); the
    other is 50% wrong upstream. Judged on absolute errors, that is a mismatch on every call."""

    def legacy(x):
        return torch.stack([x[0] * 2, x[1] * 0 + (1e-7 if _uniform(1) > 0 else 0.0)])

    def upstream(x):
        return torch.stack([x[0] * 3, x[1] * 0 + (1e-7 if _uniform(1) > 0 else 0.0)])

    stats, _ = _shadow(_Pair(legacy, upstream), [torch.ones(2)] * 200)
    assert stats.noise == 0 and stats.mismatch == 200


def test_a_large_relative_error_is_never_promoted():
    """Legacy jitters by 1e-3 around 0.001; upstream is off by 4e-3 (500% relative error) on every call. Inside the
    noise threshold (6 x the A/A errors' 0.995 quantile) call by call, so each call is noise; but every one of them
    lands above legacy's typical A/A error, where legacy's own runs land half the time: the verdict rolls back."""
    pair = _Pair(lambda x: x * 0 + 1e-3 + _uniform(1e-3), lambda x: x * 0 + 5e-3 + _uniform(1e-3))
    stats, _ = _shadow(pair, [torch.ones(3)] * 300)
    checks = stats.noise_checks
    assert checks["forward/ab/within"] == 300 and "forward/ab/below" not in checks, checks  # (every call above)
    decided = verdict.decide("noisy", evidence.from_stats(stats), MAX)
    assert decided.decision == ROLLBACK and "inside the noise thresholds" in decided.why, decided.why


def test_a_shift_inside_the_floor_is_found_by_how_often_its_calls_land_above_the_typical_error(tmp_path, monkeypatch):
    """Upstream is shifted by 0.6x legacy's own jitter: within the threshold call by call (the old floor called it
    noise on every call). Its calls land above legacy's typical A/A error (the burn-in's median) about three times
    in four, legacy's own half the time: from the journal, the verdict rolls it back, and a reviewer can redo the
    comparison of the two samples from the journal's lines."""
    from shadow.core.calls import monitor
    from shadow.core.calls.record import clusters

    clock = iter(range(0, 10**9, 60))  # (a minute a reading: each comparison its own cluster, as over a long job)
    minutes = types.SimpleNamespace(monotonic=lambda: float(next(clock)))
    monkeypatch.setattr(clusters, "time", minutes)
    monkeypatch.setattr(monitor, "time", minutes)  # (and the process time the clusters are counted in)
    pair = _Pair(lambda x: x * 2 + _uniform(1e-3), lambda x: x * 2 + _uniform(1e-3) + 6e-4)
    journal = JsonlExporter(str(tmp_path / "j.jsonl"))
    stats, _ = _shadow(pair, [torch.ones(1)] * 600, journal=journal)
    journal.close()
    counts = sources.from_journal([str(tmp_path / "j.jsonl")])["noisy"]
    assert counts.phase().noise == {tuple(k.split("/")): v for k, v in stats.noise_checks.items()}
    lines = [
        r for r in (json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()) if "outcome" in r
    ]
    aa = [r["aa_abs_error"] for r in lines[200:] if r["aa"]]
    ab = [r["max_abs_error"] for r in lines[200:] if r["outcome"] in ("mismatch", "noise", "close", "match")]
    assert len(aa) == len(ab) == 400 and mannwhitneyu(ab, aa, alternative="greater").pvalue < 1e-6
    decided = verdict.decide("noisy", counts, MAX)
    assert decided.decision == ROLLBACK and "inside the noise thresholds" in decided.why, decided.why


def test_a_shift_inside_the_floor_is_never_promoted_at_the_launchers_aa_rate():
    """At the launcher's A/A rate (0.05) a shift inside the threshold: looked at every 250 calls, the verdict never
    promotes, and it rolls back once the A/A runs after the burn-in tell legacy's own rate above the typical error."""
    pair = _Pair(lambda x: x * 2 + _uniform(1e-3), lambda x: x * 2 + _uniform(1e-3) + 6e-4)
    target = pair.target()
    decisions = []
    with shadow.install([target], sample_rate=1.0, aa_rate=0.05, seed=3) as monitor:
        for call in range(1, 4_001):
            pair.ops.op(torch.ones(1))
            if call % 250 == 0:
                decisions.append(verdict.decide("noisy", evidence.from_stats(monitor.stats()["noisy"]), MAX).decision)
    assert PROMOTE not in decisions and decisions[-1] == ROLLBACK, decisions


def test_honest_noise_is_still_noise():
    """Legacy and upstream jitter alike: after the first A/A runs, value differences are noise (the rank test at
    level 0.001 rejects only by chance)."""
    pair = _Pair(lambda x: x * 2 + _uniform(1e-3), lambda x: x * 2 + _uniform(1e-3))
    stats, experiment = _shadow(pair, [torch.ones(1)] * 200)
    assert stats.noise >= 160  # (the first 10 calls had too few A/A runs; the rank test errs at level 0.001)
    assert experiment.noise_floor()["call"][2] == 200


# --------------------------------------------------------------------------- 2. the A/A run is legacy's


def test_in_a_canary_the_aa_run_repeats_legacy_not_upstream():
    """Legacy is deterministic, upstream noisy and biased: with either primary every call is a mismatch (the old A/A
    ran the primary, so a canary's upstream noise excused its bias: noise on nearly every call)."""
    pair = _Pair(lambda x: x * 2, lambda x: x * 2 + _uniform(1e-3) + 3e-4)
    for primary in ("legacy", "upstream"):
        stats, experiment = _shadow(pair, [torch.ones(1)] * 100, primary=primary)
        # (a jitter that cancels the bias to within float32 rounding, about 1 call in 4,000, is a plain match)
        assert stats.noise == 0 and stats.mismatch == 100 - stats.match and stats.match <= 2, primary
        assert experiment.noise_floor()["call"][3] == 0  # legacy repeated itself bitwise


def test_the_floor_never_crosses_a_rollback():
    pair = _Pair(lambda x: x * 2 + _uniform(1e-3), lambda x: x * 2 + _uniform(1e-3))
    target = pair.target()
    with shadow.install([target], sample_rate=1.0, aa_rate=1.0, seed=3, primary="upstream") as monitor:
        for _ in range(20):
            pair.ops.op(torch.ones(1))
        (experiment,) = monitor._experiments
        assert experiment.noise_floor()["call"][2] == 20
        monitor.roll_back("api:test")
        assert experiment.noise_floor() == {}


# --------------------------------------------------------------------------- 3. monotone in the divergences


def _processes(n_processes: int, per_process: int, mismatches: int = 0) -> TargetCounts:
    records = []
    for pid in range(n_processes):
        k = mismatches if pid == 0 else 0
        records.append(journals.counts({"call": {"match": per_process - k, "mismatch": k}}, pid=pid, timestamp=1.0))
    return records


def test_more_divergences_never_turn_inconclusive_into_promote(tmp_path):
    """100 processes x 1,000 clean: inconclusive. The old cluster bound estimated the design effect from one or two
    events, found ~1 and promoted the same evidence with 1 or 2 mismatches."""
    decisions = []
    for k in (0, 1, 2):
        path = journals.write(tmp_path / f"j{k}.jsonl", _processes(100, 1000, k), all_outcomes=False)
        decisions.append(verdict.decide("op", sources.from_journal([str(path)])["op"], MAX))
    assert [d.decision for d in decisions] == [INCONCLUSIVE] * 3
    assert decisions[0].upper <= decisions[1].upper <= decisions[2].upper


def test_a_real_engine_journal_with_more_mismatches_is_never_promoted(tmp_path):
    """One process, 20,000 comparisons: 0 mismatches was inconclusive, 10 mismatches promoted (here 4,000 and 2)."""
    ops = types.SimpleNamespace(op=lambda x: x * 2)
    upstream = {0: lambda x: x * 2, 2: lambda x: x * 2 + (x == 7).float()}
    decisions = []
    for k, wrong in upstream.items():
        path = tmp_path / f"j{k}.jsonl"
        journal = JsonlExporter(str(path))
        with shadow.install([shadow.Target("op", ops, "op", wrong, exact=True)], sample_rate=1.0, exporters=[journal]):
            for i in range(4_000):
                ops.op(torch.tensor([7.0 if i % 2000 == 0 else 1.0]))
        journal.close()
        decisions.append(verdict.decide("op", sources.from_journal([str(path)])["op"], MAX))
    assert [(d.compared, d.divergent) for d in decisions] == [(4_000, 0), (4_000, 2)]
    assert decisions[1].decision != PROMOTE and decisions[1].upper >= decisions[0].upper


def _random_counts(rng: random.Random) -> TargetCounts:
    counts = TargetCounts()
    for primary in rng.sample(["legacy", "upstream"], rng.randint(1, 2)):
        for s in range(rng.randint(1, 4)):
            signature = f"s{s}"
            n = rng.choice([0, 5, 30, 300, 3000, 20_000])
            k = min(n, rng.choice([0, 0, 0, 1, 2, 5]))
            counts.add_calls(signature, n + rng.randint(0, 3 * n + 10), primary)
            counts.add_outcome(signature, "match", n - k, primary)
            counts.add_outcome(signature, "mismatch", k, primary)
            counts.add_reason("value", k, primary)
            if rng.random() < 0.3:
                counts.add_skip(rng.choice(["oom", "budget", "comparator"]), rng.randint(1, 50), primary, signature)
        if rng.random() < 0.5:  # clusters: the phase's comparisons spread over processes
            phase = counts.phase(primary)
            compared = phase.by_signature(COMPARED_OUTCOMES)
            divergent = phase.by_signature(DIVERGENT_OUTCOMES)
            processes = rng.randint(1, 50)
            for index in range(processes):
                share = 1 / processes
                counts.add_to_cluster(
                    ("h", index), sum(compared.values()) * share, sum(divergent.values()) * share, primary
                )
    return counts


def _copy_with(counts: TargetCounts, primary: str, signature: str, outcome: str, change: int) -> TargetCounts:
    """``counts`` with one comparison of ``outcome`` added (+1) or removed (-1), in its phase and a cluster."""
    import copy

    changed = copy.deepcopy(counts)
    changed.add_outcome(signature, outcome, change, primary)
    if outcome == "mismatch":
        changed.add_reason("value", change, primary)
    clusters = changed.phase(primary).clusters
    if clusters:
        first = next(iter(clusters.values()))
        first[0] += change
        first[1] += change if outcome == "mismatch" else 0
    return changed


#: How far the joint bound may move against a change (the mixture's marginal likelihood moves with every
#: comparison; docs/operations.md): a thousandth of the bound.
WOBBLE = 1e-3


def _phase(decision: verdict.Decision, primary: str) -> verdict.PhaseDecision:
    return next(p for p in decision.phases if p.primary == primary)


def test_property_a_divergence_never_makes_promote_likelier_and_less_evidence_never_narrows():
    """Over random evidence (phases, signatures, calls, skips, clusters): turning a match into a divergence never
    turns a decision into promote nor lowers the phase's upper bound; removing a divergence never raises the
    lower bound; removing a match never lowers the upper bound beyond the mixture's wobble (docs/operations.md)."""
    rng = random.Random(26)
    checked = 0
    for _ in range(150):
        counts = _random_counts(rng)
        before = decide(counts)
        for primary, phase in counts.phases.items():
            if phase.empty():
                continue
            old = _phase(before, primary)
            matched = [s for (s, o), v in phase.outcomes.items() if o == "match" and v >= 1]
            if matched:
                signature = rng.choice(matched)
                fewer = _copy_with(counts, primary, signature, "match", -1)
                worse = decide(_copy_with(fewer, primary, signature, "mismatch", 1))
                assert _phase(worse, primary).upper >= old.upper - 1e-12
                assert not (worse.decision == PROMOTE and before.decision != PROMOTE)
                assert _phase(decide(fewer), primary).upper >= old.upper * (1 - WOBBLE) - 1e-12
                checked += 1
            diverged = [s for (s, o), v in phase.outcomes.items() if o == "mismatch" and v >= 1]
            if diverged:
                fewer = decide(_copy_with(counts, primary, rng.choice(diverged), "mismatch", -1))
                assert _phase(fewer, primary).lower <= old.lower + 1e-15
                assert not (fewer.decision == ROLLBACK and before.decision != ROLLBACK)
    assert checked > 110


# --------------------------------------------------------------------------- 4. what was never compared


def test_calls_skipped_for_reasons_tied_to_the_call_stop_a_promote():
    """99% of sampled calls skipped oom: the old verdict promoted on the 1% compared."""
    counts = strata_counts({"": (10_000_000, 10_000, 0)})
    counts.add_skip("oom", 990_000)
    decision = decide(counts)
    assert decision.decision == INCONCLUSIVE and decision.upper >= 0.99
    assert decision.phases[0].uncovered_by == pytest.approx({"oom": 0.99})
    budget = strata_counts({"": (10_000_000, 10_000, 0)})
    budget.add_skip("budget", 990_000)  # the budget skips whatever the call holds: the rest is still a sample
    assert decide(budget).decision == PROMOTE


def test_calls_skipped_for_a_reason_this_version_does_not_know_are_never_agreement():
    """A later version's skip reason, read from its metrics: those calls were never compared either."""
    counts = strata_counts({"": (10_000_000, 10_000, 0)})
    counts.add_skip("a_later_reason", 990_000)
    decision = decide(counts)
    assert decision.decision == INCONCLUSIVE and decision.upper >= 0.99


def test_gradients_no_comparison_reached_are_non_response_but_for_no_grad_and_a_diverged_forward():
    """The gradient evidence of 1,000 backward comparisons, all agreeing, beside 1,000 planned and not made."""

    def gradients(reason: str | None) -> verdict.PhaseDecision:
        counts = TargetCounts()
        counts.add_outcome("", "match", 100_000)
        counts.add_backward("", "match", 1_000)
        counts.add_clusters(100_000)
        if reason:
            counts.add(contract.BACKWARD_SKIPS, {"reason": reason}, 1_000)
        return next(p for p in decide(counts).phases if p.primary.endswith(verdict.GRADIENTS))

    unskipped = gradients(None)
    for reason in ("memory", "deadline", "a_later_reason"):  # (calls the job backpropagates through, never compared)
        assert gradients(reason).upper >= 0.5 > unskipped.upper
        assert gradients(reason).uncovered_by == pytest.approx({reason: 0.5})
    for reason in verdict.NO_GRADIENT_SKIPS:  # (no gradient to compare; a forward that diverged is the finding)
        assert gradients(reason).upper == unskipped.upper


def test_a_signature_with_calls_and_no_comparison_is_unknown_evidence():
    """A signature with 30% of the calls was never compared: the old verdict dropped it from the weights."""
    counts = strata_counts({"common": (700_000, 50_000, 0), "rare": (300_000, 0, 0)})
    decision = decide(counts)
    assert decision.decision == INCONCLUSIVE and decision.upper >= 0.3
    assert decision.phases[0].uncovered_by == pytest.approx({"never sampled": 0.3})
    done = verdict_cli_from_counts(counts)
    assert "calls never compared: 0.3 of all (never sampled 0.3)" in done


def verdict_cli_from_counts(counts: TargetCounts) -> str:
    """The verdict's table for these counts (the command's own printing)."""
    import contextlib
    import io

    from shadow.launcher.commands import verdict as verdict_command

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for line in verdict_command.evidence_lines(decide(counts)):
            print(line)
    return out.getvalue()


# --------------------------------------------------------------------------- 5 and 11. under-sampled signatures


def test_an_under_sampled_signature_bounds_the_rate_as_its_own_evidence_allows():
    """5% of calls, 30 comparisons, none divergent: Kish's bound was 5.3e-4 (promote); the exact fixed-n bound is
    4.75e-3 and ours is at least that."""
    counts = strata_counts({"common": (950_000, 100_000, 0), "rare": (50_000, 30, 0)})
    exact = 0.05 * (1 - 0.05 ** (1 / 30))
    decision = decide(counts)
    assert exact == pytest.approx(4.75e-3, rel=1e-3) and decision.upper >= exact
    assert decision.decision == INCONCLUSIVE


def test_at_twice_the_max_rate_in_the_under_sampled_signature_promote_stays_rare():
    """The rare signature diverges at 4% (2x the max rate overall): 0 of its 30 comparisons diverge 29% of the time,
    and the old bound then promoted. Now at most 5% of such runs promote (Monte Carlo)."""
    rng = np.random.default_rng(5)
    promoted = 0
    runs = 400
    for k_rare in rng.binomial(30, 0.04, size=runs):
        counts = strata_counts({"common": (950_000, 100_000, 0), "rare": (50_000, 30, int(k_rare))})
        promoted += decide(counts).decision == PROMOTE
    assert promoted / runs <= 0.05


def test_divergences_in_an_under_sampled_signature_do_not_roll_back():
    """2 of 30 divergent in a 5% signature: Kish's lower bound was 2.18e-3 > max (rollback); the exact test of
    rate <= max has p = 0.12. The joint bound's lower end stays below the max rate."""
    counts = strata_counts({"common": (950_000, 100_000, 0), "rare": (50_000, 30, 2)})
    decision = decide(counts)
    assert decision.lower < MAX and decision.decision == INCONCLUSIVE


# --------------------------------------------------------------------------- 6. phases and rollbacks


def _canary_then_clean(tmp_path, rollback: bool, reset: bool = False):
    """A canary (upstream primary) with 3 divergences in 2,000 comparisons, then clean legacy-primary evidence over
    5,000 processes, optionally with the rollback event between them (and a person's reset)."""
    records = [journals.counts({"call": {"match": 1997, "mismatch": 3}}, primary="upstream", pid=0, timestamp=1.0)]
    if rollback:
        records.append({"event": "rollback", "target": "op", "by": "http:alertmanager", "timestamp": 2.0,
                        **journals.process(0)})  # fmt: skip
    if reset:
        records.append({"event": "reset", "target": "op", "by": "api:person", "timestamp": 3.0, **journals.process(0)})
    records += [journals.counts({"call": {"match": 200}}, pid=p, timestamp=4.0) for p in range(1, 5001)]
    return journals.write(tmp_path / "j.jsonl", records, all_outcomes=False)


def test_a_canary_rolled_back_then_clean_shadowing_is_not_promoted(tmp_path):
    counts = sources.from_journal([str(_canary_then_clean(tmp_path, rollback=True))])["op"]
    decision = verdict.decide("op", counts, MAX)
    assert decision.decision == ROLLBACK and "http:alertmanager" in decision.why
    assert {p.primary: p.decision for p in decision.phases} == {"legacy": PROMOTE, "upstream": INCONCLUSIVE}


def test_phases_are_never_pooled(tmp_path):
    """Without the rollback event: pooled, the canary's 3 divergences vanish in a million clean comparisons."""
    counts = sources.from_journal([str(_canary_then_clean(tmp_path, rollback=False))])["op"]
    decision = verdict.decide("op", counts, MAX)
    assert decision.decision == INCONCLUSIVE and "upstream phase" in decision.why


def test_a_reset_sets_the_canarys_evidence_aside_and_fresh_evidence_decides(tmp_path):
    counts = sources.from_journal([str(_canary_then_clean(tmp_path, rollback=True, reset=True))])["op"]
    decision = verdict.decide("op", counts, MAX)
    assert decision.decision == PROMOTE and decision.set_aside == 2000 and decision.resets
    assert [p.primary for p in decision.phases] == ["legacy"]


def test_the_verdict_and_the_report_show_phases_and_rollbacks(tmp_path):
    path = _canary_then_clean(tmp_path, rollback=True)
    done = verdict_cli("--journal", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "upstream phase: rate" in done.stdout and "legacy phase: rate" in done.stdout
    assert "rollbacks not reset: http:alertmanager" in done.stdout
    report = npu_shadow_here("report", "--journal", str(path))
    assert "## Phases" in report.stdout and "## Rollbacks and resets" in report.stdout
    assert "| op | upstream | inconclusive |" in report.stdout


def test_a_rollback_in_the_metrics_blocks_promote():
    counts = strata_counts({"": (10_000_000, 100_000, 0)})
    counts.rollbacks.append("1 by http (npu_shadow_rollbacks_total)")
    assert decide(counts).decision == ROLLBACK


# --------------------------------------------------------------------------- 7. repeated looks


def test_looking_every_1000_comparisons_promotes_at_most_5_percent_at_the_max_rate():
    """At a true rate equal to the max, reading the bound every 1,000 comparisons up to 20,000: a fixed-n
    Clopper-Pearson bound promotes about 25% of sequences; the confidence sequence at most 5% (+ Monte Carlo)."""
    rng = np.random.default_rng(7)
    sequences, looks = 4000, np.arange(1000, 20_001, 1000)
    steps = rng.binomial(1000, MAX, size=(sequences, len(looks))).cumsum(axis=1)
    ks = range(int(steps.max()) + 1)
    ours = {(k, n): bounds.upper_bound(k, n, PRIOR) < MAX for n in looks for k in ks}
    fixed = {(k, n): beta.ppf(0.95, k + 1, n - k) < MAX for n in looks for k in ks}
    promoted_ours = np.mean([any(ours[(k, n)] for k, n in zip(row, looks)) for row in steps])
    promoted_fixed = np.mean([any(fixed[(k, n)] for k, n in zip(row, looks)) for row in steps])
    assert promoted_fixed > 0.1  # (the simulation can see the problem)
    assert promoted_ours <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / sequences)


def test_the_verdict_says_its_bounds_are_anytime_valid(tmp_path):
    path = journals.write(tmp_path / "j.jsonl", _processes(3, 100), all_outcomes=False)
    assert "anytime-valid 95%" in verdict_cli("--journal", str(path)).stdout


# --------------------------------------------------------------------------- 8 and 10. clusters


def test_a_record_without_its_process_is_refused(tmp_path):
    """5,000 comparisons in one process (inconclusive), plus one record without pid: the old verdict dropped
    clustering for the whole target and promoted."""
    path = journals.write(tmp_path / "j.jsonl", [journals.line(timestamp=1.0 + i * 0.01) for i in range(5000)])
    assert verdict_cli("--journal", str(path)).returncode == 3
    with path.open("a") as handle:
        handle.write(json.dumps({"target": "op", "outcome": "match", "signature": "call", "reasons": []}) + "\n")
    done = verdict_cli("--journal", str(path))
    assert done.returncode == 2 and f"{path}:5002" in done.stderr and "without its process" in done.stderr


def _burst_journal(path, start: float):
    """A process that starts at ``start`` and counts every second for 100 s; 10 s of it fully divergent."""
    records, matched, diverged = [], 0, 0
    for second in range(1, 101):
        if 40 <= second < 50:
            diverged += 10
        else:
            matched += 10
        records.append(journals.counts({"call": {"match": matched, "mismatch": diverged}}, timestamp=start + second))
    return journals.write(path, [journals.header(all_outcomes=False, timestamp=start), *records[:]], False)


def test_a_burst_is_one_incident_wherever_the_wall_clock_minute_falls(tmp_path):
    """The same process, its clock shifted so that the burst straddles a wall-clock minute or not: the same
    clusters and bounds (blocks count from the process's own start, and a burst is never cut)."""
    inside = sources.from_journal([str(_burst_journal(tmp_path / "a.jsonl", 60_000.0 + 1))])["op"]
    straddling = sources.from_journal([str(_burst_journal(tmp_path / "b.jsonl", 60_000.0 + 15))])["op"]
    a, b = verdict.decide("op", inside, 0.05), verdict.decide("op", straddling, 0.05)
    assert (a.clusters, a.lower, a.upper, a.decision) == (b.clusters, b.lower, b.upper, b.decision)
    divergent_blocks = [c for c in inside.phase().clusters.values() if c[1] > 0]
    assert len(divergent_blocks) == 1 and divergent_blocks[0][1] == 100


# --------------------------------------------------------------------------- 9, 12, 13. complete journals


def _guided_job(path, calls: int = 4000, all_outcomes: bool = False, **journal_options):
    """A coverage-guided target whose rare signature always diverges, shadowed at rate 0.05."""
    ops = types.SimpleNamespace(op=lambda x: x * 2)

    def upstream(x):
        return x * 2 + (x.numel() == 1)

    target = shadow.Target("op", ops, "op", upstream, exact=True, signature=lambda a, k: f"n{a[0].numel()}")
    journal = JsonlExporter(str(path), all_outcomes=all_outcomes, **journal_options)
    prometheus = PrometheusExporter()
    with shadow.install([target], sample_rate=0.05, seed=9, exporters=[journal, prometheus]) as monitor:
        for i in range(calls):
            ops.op(torch.ones(1 if i % 400 == 0 else 4))
    journal.close()
    from prometheus_client import generate_latest

    return monitor.stats()["op"], generate_latest(prometheus.registry).decode()


def test_a_journal_without_every_outcome_counts_every_comparison_and_weights_as_the_metrics(tmp_path):
    stats, exposition = _guided_job(tmp_path / "j.jsonl")
    from_journal = sources.from_journal([str(tmp_path / "j.jsonl")])["op"]
    from_metrics = sources.from_exposition(exposition)["op"]
    assert from_journal.compared == from_metrics.compared == stats.compared
    assert from_journal.divergent == from_metrics.divergent == stats.mismatch
    metrics_calls = {s: v for s, v in from_metrics.phase().calls.items() if v}
    assert from_journal.phase().calls == metrics_calls == {"n1": 10, "n4": 3990}
    j, m = verdict.decide("op", from_journal, MAX), verdict.decide("op", from_metrics, MAX)
    assert j.rate == pytest.approx(m.rate) == pytest.approx(10 / 4000) and j.weighted and m.weighted


def test_a_journal_that_cannot_count_every_comparison_is_refused(tmp_path):
    """Mismatch lines only (no count record, no header saying every outcome is there): the old verdict read 10 of 10
    divergent and said rollback."""
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(journals.line("mismatch", timestamp=i)) + "\n" for i in range(10)))
    done = verdict_cli("--journal", str(path))
    assert done.returncode == 2 and "matches are not known" in done.stderr


def test_a_process_killed_before_its_last_count_record_never_rolls_back_on_its_tail(tmp_path):
    """Lines after the last count record (the process died) count their divergences as comparisons whose matches
    are unknown: they raise the upper bound, never the lower one."""
    records = [journals.counts({"call": {"match": 999, "mismatch": 1}}, timestamp=1.0)]
    records += [journals.line("mismatch", timestamp=2.0 + i) for i in range(5)]
    path = journals.write(tmp_path / "j.jsonl", records, all_outcomes=False)
    counts = sources.from_journal([str(path)])["op"]
    decision = verdict.decide("op", counts, 0.01)
    assert counts.phase().unmatched == {"call": 5} and decision.decision == INCONCLUSIVE
    assert "did not exit cleanly" in " ".join(decision.notes)


@pytest.mark.slow
def test_the_launchers_journal_and_its_metrics_give_the_same_counts(tmp_path):
    """`npu-shadow run --journal` on the example job: every comparison is in the journal's counts."""
    textfile = tmp_path / "metrics.prom"
    job = [os.path.join(ROOT, "examples", "train_dataparallel.py"), "--epochs", "1", "--samples", "64"]
    done = npu_shadow(
        "run",
        "--sample-rate",
        "0.5",
        "--textfile",
        str(textfile),
        "--journal",
        str(tmp_path / "journal-{pid}.jsonl"),
        "--",
        sys.executable,
        *job,
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--out",
        str(tmp_path / "w.pt"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    journal_paths = [str(p) for p in tmp_path.glob("journal-*.jsonl")]
    from_journal = json.loads(verdict_cli("--format", "json", "--journal", *journal_paths).stdout)
    from_metrics = json.loads(verdict_cli("--format", "json", "--metrics-file", str(textfile)).stdout)
    by_target = {t["target"]: t for t in from_metrics["targets"]}
    assert from_journal["targets"]
    for target in from_journal["targets"]:
        other = by_target[target["target"]]
        assert (target["compared"], target["divergent"]) == (other["compared"], other["divergent"])
        assert target["compared"] > 0 and target["decision"] != ROLLBACK


def test_rotated_journals_are_read_with_the_current_one(tmp_path):
    path = tmp_path / "j.jsonl"
    stats, _ = _guided_job(path, calls=4000, all_outcomes=True, max_bytes=40_000, backups=50)
    assert (tmp_path / "j.jsonl.1").exists()
    counts = sources.from_journal([str(path)])["op"]
    assert counts.compared == stats.compared and counts.divergent == stats.mismatch
    assert any("rotated files" in note and "j.jsonl.1" in note for note in counts.notes)


def test_outcome_lines_are_not_parsed_where_count_records_cover_them(tmp_path, monkeypatch):
    """The fast path that decides a 10,000,000-comparison journal in seconds (benchmarks/bench_verdict.py): only
    headers, count records, events and the lines after a process's last count record are parsed."""
    stats, _ = _guided_job(tmp_path / "j.jsonl", calls=4000, all_outcomes=True, count_interval=0)
    parsed = []
    from shadow.analysis.sources import journal_lines, journals

    real = journal_lines.record_of
    counting = lambda raw, where: parsed.append(raw) or real(raw, where)  # noqa: E731
    for module in (journal_lines, journals):  # (the reader's fast path, and the checked read of a whole line)
        monkeypatch.setattr(module, "record_of", counting)
    counts = sources.from_journal([str(tmp_path / "j.jsonl")])["op"]
    lines = (tmp_path / "j.jsonl").read_text().splitlines()
    assert counts.compared == stats.compared and len(lines) > 2 * stats.compared
    assert all(not raw.startswith(b'{"time"') for raw in parsed)


def test_what_is_missing_is_said_in_the_bounds_units(tmp_path):
    """Clean comparisons in 10 processes: what is missing is clusters (each process's time blocks), not
    comparisons, and the number asked for is the effective number the bound needs less those there are."""
    path = journals.write(tmp_path / "j.jsonl", _processes(10, 1000), all_outcomes=False)
    decision = verdict.decide("op", sources.from_journal([str(path)])["op"], MAX)
    needed = verdict.comparisons_needed(MAX)
    assert f"about {needed - 10:,} more clusters" in decision.why
