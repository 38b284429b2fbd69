"""The divergence rate under a device's noise: A/B exceedances beyond legacy's own A/A rate, bounded at every look.

On a nondeterministic device both sides of every comparison jitter, and a heavy tail puts even legacy's own A/A runs
beyond its noise threshold now and then (:mod:`shadow.core.judging.noise`: the threshold is ``FACTOR`` times a
high quantile of a signature's first A/A errors). A call beyond the threshold is therefore evidence only relative to how
often legacy's own runs land there. Of a phase's ``n`` compared calls, ``k`` diverged (every mismatch and error: an
A/B exceedance is a value mismatch); ``n_t`` of them were judged against thresholds, and of ``n_aa`` A/A runs judged
against the same thresholds ``k_aa`` landed beyond. Under noise alone a judged call is an exceedance with the A/A
rate ``p_aa``, so the divergence rate beyond the noise is

    excess = p_ab - w p_aa,   w = n_t / n (the share of compared calls that noise could have put beyond),

where ``p_ab`` is the rate the calls diverge at (signatures weighted by their share of calls, calls never compared as
non-response, clusters: :mod:`shadow.analysis.bounds`).

**The bound.** A union of two anytime-valid confidence sequences, at ``alpha / 2`` each: the A/B side's joint bound
over strata (Howard, Ramdas, McAuliffe and Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic confidence
sequences", the beta-binomial mixture martingale) and the A/A rate's own (the same construction, one stratum, Jeffreys'
mixture for its lower bound). With probability at least ``1 - alpha``, at every look at once, ``p_ab`` and ``p_aa``
are inside theirs, so

    upper = U_ab - w L_aa,    lower = L_ab - w U_aa

hold the excess at every look, the A/A estimate's own uncertainty included (Waudby-Smith and Ramdas, "Estimating
means of bounded random variables by betting", JRSS-B 2024, bound a difference of two means the same way: each
sequence at half the level).

**The detection limit.** ``width = w (U_aa - L_aa)`` is how much of the bound is the noise's own uncertainty: an
excess below it cannot be told from the noise with this evidence, however many A/B calls are compared. A promote
needs ``upper`` below the max rate *and* ``width`` below it (otherwise the noise hides what the max rate needs, and
the decision is inconclusive, saying how many more A/A runs would do: ``--aa-rate``, a factor). Where a signature
repeats itself bitwise nothing is judged against a threshold (``n_t = n_aa = 0``) and the verdict is the one it
always was (:func:`shadow.analysis.verdict.decide_phase`).

**The size limit.** A wrong call is seen one by one only where its difference goes beyond the threshold: ``FACTOR``
times the ``QUANTILE`` quantile of ``BURN_IN`` A/A errors. A smaller real difference is seen only where it is on
enough calls to put them above legacy's typical A/A error measurably more often than legacy's own runs
(:func:`shift_lower`: a shift inside the thresholds, rolled back at half the level); the verdict says so beside every
decision it makes under noise.

A simulation checks the whole (``benchmarks/bench_noise.py``: lognormal jitter of sigma 0.5 to 1.5 on both sides,
real differences of 2, 20 and 1,000 times the jitter on 0.1% to 5% of calls, looks every 500 calls to 20,000).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from shadow.analysis import bounds
from shadow.analysis.bounds import Prior, Stratum
from shadow.core.judging.noise import BELOW, BEYOND, BURN_IN, FACTOR, QUANTILE, WITHIN

#: What a wrong call must exceed to be seen, in words (every decision made under noise says it).
SIZE_LIMIT = (
    f"a wrong call is seen only where its difference goes beyond its signature's noise threshold ({FACTOR:g} x the "
    f"{QUANTILE:g} quantile of its first {BURN_IN} A/A errors); a smaller real difference only where it puts the "
    "calls above legacy's typical A/A error measurably more often than legacy's own runs (a shift)"
)
#: The least factor of more A/A runs offered, and the greatest looked for.
_FACTORS = tuple(2.0**i for i in range(1, 31))


@dataclasses.dataclass(frozen=True)
class NoiseEvidence:
    """A phase's runs judged against their noise thresholds: A/B calls (``ab``) and A/A runs (``aa``), how many were
    judged and how many landed beyond."""

    ab_judged: float
    ab_beyond: float
    aa_judged: float
    aa_beyond: float
    #: How many landed above the typical A/A error (within the thresholds or beyond); None where the source does not
    #: count the level below it (evidence from before it was counted).
    ab_above: float | None = None
    aa_above: float | None = None

    @classmethod
    def of(cls, noise: Mapping[tuple[str, str, str], float], evidence: str) -> NoiseEvidence | None:
        """``evidence``'s (forward, gradients) runs judged, from a phase's counts by (evidence, pair, check); None
        where none was (a target that repeats itself bitwise, or no A/A runs)."""

        def count(pair: str, check: str) -> float:
            return max(0.0, noise.get((evidence, pair, check), 0.0))

        levels = count("ab", BELOW) + count("aa", BELOW) > 0
        found = cls(
            count("ab", BELOW) + count("ab", WITHIN) + count("ab", BEYOND), count("ab", BEYOND),
            count("aa", BELOW) + count("aa", WITHIN) + count("aa", BEYOND), count("aa", BEYOND),
            count("ab", WITHIN) + count("ab", BEYOND) if levels else None,
            count("aa", WITHIN) + count("aa", BEYOND) if levels else None,
        )  # fmt: skip
        return found if found.ab_judged > 0 or found.aa_judged > 0 else None

    @property
    def aa_rate(self) -> float:
        """Legacy's own exceedance rate, as seen (0 where no A/A run was judged)."""
        return self.aa_beyond / self.aa_judged if self.aa_judged else 0.0


@dataclasses.dataclass(frozen=True)
class NoiseBounds:
    """The excess's bounds and the detection limit (module docstring)."""

    lower: float
    upper: float
    #: The share of compared calls noise could have put beyond (``w``), and the A/A rate's bounds.
    share: float
    aa_lower: float
    aa_upper: float
    #: The detection limit: the excess rate this evidence cannot tell from the noise.
    width: float
    #: The excess as seen (the point estimate).
    rate: float


def excess_bounds(
    lower_strata: Sequence[Stratum],
    upper_strata: Sequence[Stratum],
    prior: Prior,
    evidence: NoiseEvidence,
    compared: float,
    scale: float,
    rate: float,
    alpha: float = bounds.ALPHA,
) -> NoiseBounds:
    """The bounds of the divergence rate beyond the noise (module docstring) from the phase's strata (as the verdict
    made them: weighted, clustered), its noise ``evidence``, its ``compared`` calls, the clusters' ``scale``
    (effective comparisons per comparison: the A/A runs are counted in the same units) and its divergence ``rate``
    as seen. Each side at ``alpha / 2``."""
    half = alpha / 2
    share = min(1.0, evidence.ab_judged / compared) if compared > 0 else 0.0
    aa_k, aa_n = evidence.aa_beyond * scale, evidence.aa_judged * scale
    aa_lower = bounds.lower_bound(aa_k, aa_n, half) if aa_n > 0 else 0.0
    aa_upper = bounds.upper_bound(aa_k, aa_n, prior, half) if aa_n > 0 else 1.0
    upper = max(0.0, bounds.upper(upper_strata, prior, half) - share * aa_lower)
    lower = max(0.0, bounds.lower(lower_strata, half) - share * aa_upper)
    width = share * (aa_upper - aa_lower)
    return NoiseBounds(lower, upper, share, aa_lower, aa_upper, width, max(0.0, rate - share * evidence.aa_rate))


def shift_lower(evidence: NoiseEvidence, scale: float, alpha: float = bounds.ALPHA) -> float:
    """A lower bound, valid at every look, on the share of calls upstream moves beyond legacy's own variation inside
    the thresholds: the rate A/B calls land above the typical A/A error less legacy's own A/A rate there, each side's
    anytime-valid sequence at ``alpha / 2`` (in the clusters' units, ``scale``; the A/A side's mixture uniform, as
    its rate is about 1/2). Where upstream differs as legacy differs from itself both rates are about 1/2 and the
    bound is 0; a shift inside the threshold on every call raises the A/B rate. 0 where the levels are not
    counted."""
    if evidence.ab_above is None or evidence.aa_above is None or not evidence.ab_judged or not evidence.aa_judged:
        return 0.0
    half = alpha / 2
    ab_low = bounds.lower_bound(evidence.ab_above * scale, evidence.ab_judged * scale, half)
    aa_high = bounds.upper_bound(evidence.aa_above * scale, evidence.aa_judged * scale, Prior(1.0, 1.0), half)
    return max(0.0, ab_low - aa_high)


def shifted(evidence: NoiseEvidence, lower: float) -> str:
    """Why a phase rolls back on a shift inside its thresholds (:func:`shift_lower`)."""
    return (
        f"upstream differs more than legacy differs from itself, inside the noise thresholds: its calls land above "
        f"legacy's typical A/A error in {evidence.ab_above:.0f} of {evidence.ab_judged:.0f}, legacy's own runs in "
        f"{evidence.aa_above:.0f} of {evidence.aa_judged:.0f}: at least {lower:.3g} of the calls are moved (95% lower "
        "bound)"
    )


def aa_factor(evidence: NoiseEvidence, share: float, scale: float, prior: Prior, max_rate: float) -> float:
    """The least factor of A/A runs (at the rate legacy lands beyond its thresholds now) that brings the detection
    limit below ``max_rate``; inf where none does."""
    rate = evidence.aa_rate
    for factor in _FACTORS:
        n = evidence.aa_judged * scale * factor
        if n <= 0:
            break
        width = share * (bounds.upper_bound(rate * n, n, prior, bounds.ALPHA / 2) - bounds.lower_bound(
            rate * n, n, bounds.ALPHA / 2))  # fmt: skip
        if width < max_rate:
            return factor
    return math.inf


def hidden(bounded_noise: NoiseBounds, evidence: NoiseEvidence, max_rate: float, factor: float) -> str:
    """Why a phase cannot promote under noise: the noise's own uncertainty (the detection limit) is not below the max
    rate, and what more A/A runs would do."""
    more = (
        f"about {factor:g} times as many A/A runs (--aa-rate x{factor:g}, up to 1: an A/A run on every sampled call; "
        "or the same A/A rate over that much more running)"
        if math.isfinite(factor)
        else "more A/A runs than any job makes"
    )
    return (
        f"the noise hides what the max rate needs: legacy's own A/A runs land beyond their thresholds in "
        f"{evidence.aa_beyond:.0f} of {evidence.aa_judged:.0f} (its rate within [{bounded_noise.aa_lower:.3g}, "
        f"{bounded_noise.aa_upper:.3g}]), so an excess below {bounded_noise.width:.3g} (the detection limit) cannot be "
        f"told from it, and a promote needs it below max rate {max_rate:g}: {more} would bring it there"
    )


def describe(bounded_noise: NoiseBounds, evidence: NoiseEvidence) -> str:
    """The evidence behind a decision made under noise, in one clause."""
    return (
        f"divergence beyond the noise in [{bounded_noise.lower:.3g}, {bounded_noise.upper:.3g}] (A/B exceedances "
        f"{evidence.ab_beyond:.0f} of {evidence.ab_judged:.0f} judged, A/A {evidence.aa_beyond:.0f} of "
        f"{evidence.aa_judged:.0f}; detection limit {bounded_noise.width:.3g})"
    )
