"""How much more evidence a promote takes, and how sure that is: a predictive simulation of the evidence so far.

An inconclusive phase is promoted once its anytime-valid upper bound falls below the max rate
(:mod:`shadow.analysis.bounds`). How much more running that takes depends on the rate the job really has, which the
evidence only bounds, and on the divergences running on happens to bring. "At the rate seen" is one future of
many: at half the max rate it is kept in about three runs of four, and one divergence in 960 clusters says
"cannot promote" of jobs whose rate is below the max. So the verdict simulates the futures the evidence allows
(a posterior predictive simulation: Gelman et al., *Bayesian Data Analysis*, 3rd ed., 2013, 6.3):

1. the rate is drawn from its posterior for ``k`` divergences in ``n`` effective comparisons (clusters), under the
   bound's own mixing prior Beta(1, 1 / max rate - 1) (:class:`shadow.analysis.bounds.Prior`: mean the max rate,
   neutral between promote and rollback): Beta(1 + k, 1 / max rate - 1 + n - k);
2. running on, the divergences come at that rate (binomial increments over a geometric grid of future evidence,
   steps of :data:`GRID_STEP`);
3. a future promotes at the first point where its divergences are few enough for the bound (``n`` at least
   :func:`shadow.analysis.bounds.effective_needed` of them), and never where that takes more than
   :data:`HORIZON` times the evidence so far, or than what a promote without divergence needs, whichever is more.

The median and the 5th and 95th percentiles of the more evidence each future takes are the ETA and its 90% range;
the share of futures that never promote is said too. The simulation has a fixed seed: every source of one run gives
one answer. "Cannot promote" is said only where the rate's lower bound reaches the max rate
(:func:`shadow.analysis.verdict.decide_phase`), never of a rate seen above it by chance.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from shadow.analysis import bounds

#: Futures simulated.
DRAWS = 1_000
#: The grid of future evidence: each point this much more than the last.
GRID_STEP = 1.02
#: A future that needs more than this many times the evidence so far (or than a promote without divergence needs,
#: where that is more) never promotes: no job runs that long.
HORIZON = 10_000.0
#: The seed of the simulation (one answer for one evidence).
SEED = 20_261_207
#: The range said: this share of the futures between its ends.
COVERAGE = 0.90


@dataclasses.dataclass(frozen=True)
class Eta:
    """The more evidence a promote takes in the simulated futures: median and 90% range (inf: never, in at least
    that share of them), and the share that never promote."""

    median: float
    low: float
    high: float
    never: float


def predict(
    k: float,
    n: float,
    max_rate: float,
    prior: bounds.Prior,
    alpha: float = bounds.ALPHA,
    draws: int = DRAWS,
    seed: int = SEED,
) -> Eta:
    """The ETA of a phase with ``k`` divergences in ``n`` effective comparisons (:mod:`this module's <shadow.analysis
    .eta>` method): how many more effective comparisons its promote takes, median and 90% range."""
    if n <= 0 or not max_rate > 0:
        return Eta(math.inf, math.inf, math.inf, 1.0)
    rng = np.random.default_rng(seed)
    rates = rng.beta(prior.a + k, prior.b + max(n - k, 0.0), draws)
    clean = float(_table(max_rate, prior.a, prior.b, alpha, 16)[1][0])  # (what a promote without divergence needs)
    if not math.isfinite(clean):
        return Eta(math.inf, math.inf, math.inf, 1.0)
    reach = HORIZON * max(n, clean)
    steps = math.ceil(math.log(reach / n) / math.log(GRID_STEP))
    grid = n * GRID_STEP ** np.arange(1, steps + 1)
    added = np.diff(np.concatenate(([n], grid)))
    divergences = k + np.cumsum(rng.binomial(np.floor(added).astype(np.int64)[None, :], rates[:, None]), axis=1)
    promotes = grid[None, :] >= _needed(divergences, max_rate, prior, alpha)
    first = np.where(promotes.any(axis=1), grid[np.argmax(promotes, axis=1)] - n, np.inf)
    low, median, high = np.quantile(first, [(1 - COVERAGE) / 2, 0.5, (1 + COVERAGE) / 2], method="inverted_cdf")
    return Eta(float(median), float(low), float(high), float(np.mean(np.isinf(first))))


def _needed(divergences: np.ndarray, max_rate: float, prior: bounds.Prior, alpha: float) -> np.ndarray:
    """The least effective comparisons whose bound is below ``max_rate`` with each count of ``divergences``:
    exact at the whole counts of :func:`_table`, linear between them (the need grows smoothly with the count)."""
    most = float(divergences.max(initial=0.0))
    counts, needs = _table(max_rate, prior.a, prior.b, alpha, _reach(most))
    return np.interp(divergences, counts, needs)


def _reach(most: float) -> int:
    """The table's last count: a power of two at least ``most`` (so that tables are shared between calls)."""
    return 1 << max(4, math.ceil(math.log2(most + 1)))


@functools.lru_cache(maxsize=32)
def _table(max_rate: float, a: float, b: float, alpha: float, reach: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts, the effective comparisons each needs): every count to 16, then every 1/8 of an octave to
    ``reach``."""
    counts = sorted({*range(17), *(round(2 ** (e / 8)) for e in range(32, 8 * int(math.log2(reach)) + 1))})
    prior = bounds.Prior(a, b)
    needs = [bounds.effective_needed(max_rate, c, prior, alpha) for c in counts]
    return np.array(counts, dtype=float), np.array(needs, dtype=float)
