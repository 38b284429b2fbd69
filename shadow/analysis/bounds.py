"""Anytime-valid bounds of a divergence rate, over strata and with calls never compared.

One statistic serves the verdict, the report and the needed-comparisons estimate:

- **One stratum.** The beta-binomial mixture martingale of Howard, Ramdas, McAuliffe and Sekhon (2021,
  "Time-uniform, nonparametric, nonasymptotic confidence sequences", section on conjugate mixtures): with a
  ``Beta(a, b)`` mixing distribution, k divergences in n comparisons and a true rate p,
  ``M(p) = B(a + k, b + n - k) / B(a, b) / (p**k (1 - p)**(n - k))`` is a nonnegative martingale with mean 1, so
  by Ville's inequality ``{p : M(p) < 1 / alpha}`` holds the true rate at every n at once with probability at
  least 1 - alpha. A verdict re-read as evidence grows (every run of ``npu-shadow verdict``, the promotion alert
  looking all the time) stays valid; a fixed-n Clopper-Pearson bound re-read every 1,000 comparisons does not.
- **Strata.** Coverage-guided sampling compares signatures at different rates. The rate of the calls is
  ``sum_s W_s p_s`` (W_s: the signature's share of calls). Strata are independent, so for any mixing distribution
  over the vector of rates, ``M(p) = C / prod_s L_s(p_s)`` is a nonnegative martingale (C: the data's marginal
  likelihood under the mixture, L_s: stratum s's likelihood), and ``{p : M(p) < 1 / alpha}`` is a joint confidence
  region. The mixture here puts 3/4 on "every stratum has the same rate" (one beta prior for all: the price of
  stratifying a sample taken in proportion to calls is then a few percent) and 1/4 on independent rates (one
  beta prior each: the price of a divergence that sits in one stratum). The bounds are the least and greatest
  ``sum_s W_s p_s`` over the region (a convex program, solved exactly below). A stratum with zero divergences and
  few comparisons is as wide as its own likelihood allows: the bound is never the anti-conservative Kish one
  where one signature is under-sampled.
- **Non-response.** Calls of a kind never compared (a signature with calls but no comparison, sampled calls
  skipped for a reason tied to the call: out of memory, hooks, modes, compiled code, a fault of ours) are strata
  with no comparisons: nothing constrains their rate, so they add their whole share to the upper bound and none to
  the lower (Manski's worst-case bounds).

Counts may be real numbers (effective counts after a design effect for clusters); the formulas are the same.
The mixing distribution is ``Beta(1, 1 / max_rate - 1)``, fixed before any data by the rate the decision is
about; with zero divergences a bound below max_rate then needs about 4.5 / max_rate comparisons (a fixed-n bound
needs 3 / max_rate, and is not valid when looked at more than once).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy.special import betaln

ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class Stratum:
    """One stratum: its share of calls, and divergences in comparisons (real counts allowed; n == 0 means never
    compared: non-response)."""

    weight: float
    k: float
    n: float


@dataclasses.dataclass(frozen=True)
class Prior:
    """The mixing distribution Beta(a, b) of the confidence sequence."""

    a: float
    b: float

    @classmethod
    def for_max_rate(cls, max_rate: float) -> Prior:
        """Beta(1, 1/max_rate - 1): mean max_rate, the rate the decision is about (for the tiniest rates, mean
        1e-15: beyond any job's evidence either way)."""
        return cls(1.0, min(max(1.0 / max_rate - 1.0, 1.0), 1e15))


#: The mixture's weight on "every stratum has the same rate" (the rest: independent rates).
SHARED_RATE_WEIGHT = 0.75


def _nll(p: float, k: float, n: float) -> float:
    """-log of one stratum's likelihood p^k (1-p)^(n-k); +inf where p cannot have made the data."""
    if n <= 0:
        return 0.0
    value = 0.0
    if k > 0:
        if p <= 0:
            return math.inf
        value -= k * math.log(p)
    if n - k > 0:
        if p >= 1:
            return math.inf
        value -= (n - k) * math.log1p(-p)
    return value


def _log_marginal(k: float, n: float, prior: Prior) -> float:
    """log of the beta-binomial marginal likelihood B(a + k, b + n - k) / B(a, b)."""
    return float(betaln(prior.a + k, prior.b + n - k) - betaln(prior.a, prior.b))


def log_evidence(strata: Sequence[Stratum], prior: Prior) -> float:
    """log C: the compared strata's marginal likelihood under the mixture (module docstring)."""
    compared = [s for s in strata if s.n > 0]
    if not compared:
        return 0.0
    shared = _log_marginal(sum(s.k for s in compared), sum(s.n for s in compared), prior)
    if len(compared) == 1:
        return shared
    apart = sum(_log_marginal(s.k, s.n, prior) for s in compared)
    return float(np.logaddexp(math.log(SHARED_RATE_WEIGHT) + shared, math.log1p(-SHARED_RATE_WEIGHT) + apart))


def _regret(k: float, n: float, prior: Prior) -> float:
    """log L(k/n) - log C of one stratum: what the mixture loses to the best rate in hindsight."""
    return -_nll(k / n, k, n) - _log_marginal(k, n, prior)


def _regret_envelope(k: float, n: float, prior: Prior) -> float:
    """The greatest regret over divergence counts from 0 to k (n fixed): a budget that never shrinks as a divergence
    is added (the regret dips after k = 0 and grows again; its greatest value is at an end or near the dip)."""
    points = [0.0, k] + [k * i / 16 for i in range(1, 16)]
    return max(_regret(j, n, prior) for j in points)


def upper_budget(strata: Sequence[Stratum], prior: Prior, alpha: float = ALPHA) -> float:
    """The right side of the upper bound's constraint ``sum_s nll_s(p_s) <= budget``: at least the exact one
    (``log(1/alpha) - log C``: the region only grows, the bound stays valid), and never smaller after a divergence
    is added, so that the upper bound grows with every divergence. With no divergence anywhere it is the exact one
    (the mixture's shared-rate part dominates); with divergences, each stratum's own part, its regret taken at its
    greatest over the divergence counts up to its own (C >= (1 - w) C_apart)."""
    compared = [s for s in strata if s.n > 0]
    if not compared:
        return math.log(1 / alpha)
    if all(s.k == 0 for s in compared):
        return math.log(1 / alpha) - log_evidence(strata, prior)
    apart = sum(_regret_envelope(s.k, s.n, prior) + _nll(s.k / s.n, s.k, s.n) for s in compared)
    if len(compared) == 1:
        return math.log(1 / alpha) + apart
    return math.log(1 / alpha) + apart - math.log1p(-SHARED_RATE_WEIGHT)


def log_martingale(p: float, k: float, n: float, prior: Prior) -> float:
    """log M(p) of the one-stratum beta-binomial mixture (see the module docstring)."""
    if n <= 0:
        return 0.0
    return _log_marginal(k, n, prior) + _nll(p, k, n)


def _slope_root(t: float, k: float, n: float) -> float:
    """The p in [0, 1] where d/dp log M(p) = -k/p + (n-k)/(1-p) equals t: the root of t p^2 + (n - t) p - k = 0
    in [0, 1], in the form that does not cancel."""
    if t == 0:
        return k / n
    root_d = math.sqrt(max((n - t) ** 2 + 4 * t * k, 0.0))
    root = 2 * k / (n - t + root_d) if n - t > 0 else (-(n - t) + root_d) / (2 * t)
    return min(max(root, 0.0), 1.0)


def _one_greatest(k: float, n: float, budget: float) -> float:
    """The greatest p with nll(p) <= ``budget`` for one stratum (k divergences in n > 0 comparisons, the budget
    above its least nll): Newton's method on q = -log(1 - p), where nll is increasing and convex beyond the
    maximum likelihood, started at budget / (n - k), which is beyond the root; its steps come down to the root
    without crossing it (the p returned is the exact one, or above it by what a float cannot hold)."""
    failures = n - k
    if failures <= 0:
        return 1.0  # (every comparison diverged: nll falls as p grows)
    if k <= 0:
        return -math.expm1(-budget / failures)  # (nll = (n - k) q: the root itself)
    q = budget / failures
    for _ in range(100):
        p = -math.expm1(-q)
        if p >= 1.0:
            return 1.0
        step = (failures * q - k * math.log(p) - budget) / (failures - k * (1.0 - p) / p)
        if not step > 1e-15 * q:  # (at the root, to the precision a float holds)
            break
        q -= step
    return -math.expm1(-q)


def _greatest(strata: Sequence[Stratum], budget: float) -> float:
    """The greatest sum_s W_s p_s over {p : sum_s nll_s(p_s) <= budget} (module docstring), strata never compared
    at 1.

    Lagrange: at the optimum each compared stratum sits where the slope of its negative log-likelihood equals
    W_s / lam; the constraint fixes lam, found by bisection on log(lam) (the left side is monotone in lam)."""
    free = sum(s.weight for s in strata if s.n <= 0)  # never compared: anywhere in [0, 1]
    compared = [s for s in strata if s.n > 0 and s.weight > 0]
    if not compared:
        return min(1.0, free)
    at_mle = sum(_nll(s.k / s.n, s.k, s.n) for s in compared)
    if at_mle >= budget:  # (cannot happen: the budget is at least the mixture's, never below the maximum likelihood)
        return min(1.0, free + sum(s.weight * s.k / s.n for s in compared))
    if len(compared) == 1:
        (only,) = compared
        return min(max(free + only.weight * _one_greatest(only.k, only.n, budget), 0.0), 1.0)

    def point(lam_log: float) -> list[float]:
        return [_slope_root(s.weight / math.exp(lam_log), s.k, s.n) for s in compared]

    def excess(lam_log: float) -> float:
        return sum(_nll(p, s.k, s.n) for p, s in zip(point(lam_log), compared)) - budget

    low, high = -60.0, 60.0  # lam from e^-60 (p at 1) to e^60 (p at the MLE)
    if excess(low) <= 0:  # the whole box is in the region
        ps = point(low)
    else:
        for _ in range(200):
            middle = (low + high) / 2
            if excess(middle) > 0:
                low = middle
            else:
                high = middle
            if high - low < 1e-12:
                break
        ps = point(high)
    return min(max(free + sum(s.weight * p for s, p in zip(compared, ps)), 0.0), 1.0)


#: The mixing distribution of the lower bound's sequences: Jeffreys' Beta(1/2, 1/2), whose regret hardly moves
#: with the divergence count (the prior about max_rate would shrink a small, badly diverging stratum hard).
JEFFREYS = Prior(0.5, 0.5)


def _one_lower(k: float, n: float, alpha: float) -> float:
    """One stratum's anytime-valid lower bound at level ``alpha`` (Jeffreys mixture): the least p below k/n with
    log M(p) < log(1/alpha)."""
    if n <= 0 or k <= 0 or alpha <= 0:
        return 0.0
    budget = math.log(1 / alpha)
    mle = min(k / n, 1.0)

    def excess(p: float) -> float:
        return log_martingale(p, k, n, JEFFREYS) - budget

    if excess(mle) >= 0:
        return mle
    low, high = 0.0, mle  # excess(low) > 0 (inf at 0), excess(high) < 0
    for _ in range(200):
        middle = (low + high) / 2
        if middle <= 0 or excess(middle) > 0:
            low = middle
        else:
            high = middle
        if high - low <= 1e-15 * max(high, 1e-300):
            break
    return high


def bounds(strata: Sequence[Stratum], prior: Prior, alpha: float = ALPHA) -> tuple[float, float]:
    """(lower, upper) bounds of sum_s W_s p_s, each valid at every look with probability >= 1 - alpha. Weights
    should add up to 1 (the shares of all calls, non-response included).

    The upper bound is the greatest rate over the joint region (module docstring). The lower bound is the sum of
    each stratum's own lower bound at level ``alpha * W_s`` (a union bound over strata): each stratum's depends on
    its own evidence alone, so that removing a divergence anywhere never raises it, and a stratum with a small
    share of calls cannot roll a target back alone."""
    return lower(strata, alpha), upper(strata, prior, alpha)


def lower(strata: Sequence[Stratum], alpha: float = ALPHA) -> float:
    """The lower bound of :func:`bounds`."""
    return min(sum(s.weight * _one_lower(s.k, s.n, alpha * s.weight) for s in strata if s.weight > 0), 1.0)


def upper(strata: Sequence[Stratum], prior: Prior, alpha: float = ALPHA) -> float:
    """The upper bound of :func:`bounds`."""
    return _greatest(strata, upper_budget(strata, prior, alpha))


def upper_bound(k: float, n: float, prior: Prior, alpha: float = ALPHA) -> float:
    """The one-stratum upper bound (1.0 when n == 0)."""
    return upper([Stratum(1.0, k, n)], prior, alpha)


def lower_bound(k: float, n: float, alpha: float = ALPHA) -> float:
    """The one-stratum lower bound (Jeffreys mixture; 0.0 when k == 0)."""
    return _one_lower(k, n, alpha)


def effective_needed(max_rate: float, k: float, prior: Prior, alpha: float = ALPHA) -> float:
    """The least whole n (in the same effective units as k) whose one-stratum upper bound with k divergences is
    below max_rate; inf where none is (more than any job makes)."""
    if not max_rate > 1 / 2**62:
        return math.inf
    low = math.floor(k)  # (never enough: n >= k, and the bound at n = k is 1)
    high = max(2 * (low + 1), math.ceil(1.0 / max_rate))
    while upper_bound(k, high, prior, alpha) >= max_rate:
        low, high = high, high * 2
        if high > 2**62:
            return math.inf
    while high - low > 1:
        middle = (low + high) // 2
        if upper_bound(k, middle, prior, alpha) < max_rate:
            high = middle
        else:
            low = middle
    return high


def needed_at_rate(max_rate: float, rate: float, prior: Prior, alpha: float = ALPHA) -> float:
    """The least whole n whose one-stratum upper bound is below ``max_rate`` where the divergences grow with the
    comparisons at ``rate`` (k = rate x n): what running on at the rate seen takes, the divergences it brings
    included. inf where the rate is not below ``max_rate`` (the bound tends to the rate, never below it) or no job
    makes that many."""
    if not (0 <= rate < max_rate) or not max_rate > 1 / 2**62:
        return math.inf
    if rate == 0:
        return effective_needed(max_rate, 0, prior, alpha)
    low, high = 0, max(2, math.ceil(1.0 / max_rate))
    while upper_bound(rate * high, high, prior, alpha) >= max_rate:
        low, high = high, high * 2
        if high > 2**62:
            return math.inf
    while high - low > 1:
        middle = (low + high) // 2
        if upper_bound(rate * middle, middle, prior, alpha) < max_rate:
            high = middle
        else:
            low = middle
    return high
