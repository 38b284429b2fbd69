"""The noise floor: how much legacy differs from itself, as a distribution, and whether upstream differs more.

Diffy's idea for tensors: legacy run twice on the same call (an A/A run) shows the target's own nondeterminism. A
legacy-vs-upstream (A/B) value difference is ``noise`` only while two things hold for every output leaf that
differs, per call signature:

- the call's error is within ``MARGIN`` times a robust floor of the A/A errors (their ``FLOOR_QUANTILE`` quantile,
  a high order statistic one outlier cannot move; absolute errors only, so an element near zero cannot make a
  relative floor infinite), after at least ``MIN_AA_RUNS`` A/A runs, or beyond it no more often than legacy's own.
  A floor from a dozen A/A runs is itself noisy (at a process's start, at ``--aa-rate 0.05``), and errors are
  heavy-tailed where kernels are nondeterministic (reductions whose spread varies from call to call; noise that
  moves an activation across a ReLU's zero gates a whole gradient element, 10-20% of it: on a device under
  cudnn.benchmark about one backward comparison in twenty of an honest job went beyond twice the floor), so an
  error beyond the floor is judged by how often such errors happen, never one by one. Where
  upstream differs from legacy as legacy differs from itself, A/B and A/A errors are exchangeable and exceed the
  floor equally often, so a gradient beyond it is a mismatch once the A/B errors exceed it more often than each
  A/A error exceeds the floor of the others (a one-sided Fisher exact test at ``TEST_LEVEL`` over the window),
  within the noise where the counts show no sign of that (p at least ``AS_OFTEN_LEVEL``, with
  ``MIN_TEST_SAMPLES`` A/B errors and legacy seen beyond its own floor at least once) and the rank test below
  agrees, and held otherwise (neither noise nor a mismatch: a skip if never judged). A real difference beyond
  the floor is one on every call, and is found within about six. Where legacy repeated itself bitwise in every
  A/A run, any difference is a mismatch at once (for a gradient, where no gradient of the call varied);
- the A/B errors of the recent calls are not stochastically larger than the A/A errors (a one-sided Mann-Whitney
  U test over the last ``WINDOW`` of each, as Kayenta judges a canary's metrics): a systematic shift hidden inside
  the floor call by call shows up there, and from then on such calls are mismatches. Until each side holds
  ``MIN_TEST_SAMPLES`` errors the test cannot run, and a difference within the floor waits to be judged.

A backward comparison with A/A runs on keeps its gradients' floor here too: each product is a leaf named
``grad:<tensor>`` of the call's signature (:mod:`shadow.core.calls.sampled.extra_runs`).

Each judgement says its test (runs on each side, p-value) so that a reviewer can redo it from the journal, whose
lines keep both error samples (``max_abs_error``, ``aa_abs_error``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

import numpy as np

#: A value difference within this many times the robust floor can be noise.
MARGIN = 2.0
#: How a gradient's leaf is named (:mod:`shadow.core.calls.sampled.extra_runs`): judged beyond the floor by how
#: often.
GRADIENT = "grad:"
#: A/A runs of a signature and leaf before any difference there is called noise.
MIN_AA_RUNS = 10
#: The robust floor: this quantile of the A/A errors, taken at or below it (with 10 runs, the second largest).
FLOOR_QUANTILE = 0.9
#: Errors kept per signature and leaf, on each side, for the rank test.
WINDOW = 200
#: The rank test's level: below it, upstream differs more than legacy differs from itself (small: the test is
#: taken again at every value difference, over windows that overlap).
TEST_LEVEL = 0.001
#: A difference beyond the floor is noise where the exceedance test's p-value is at least this (and the A/B window
#: holds ``MIN_TEST_SAMPLES``): no sign that upstream exceeds the floor more often than legacy does; between it and
#: ``TEST_LEVEL`` the difference is held until the counts tell.
AS_OFTEN_LEVEL = 0.05
#: Errors each side's window holds before the rank test may reject.
MIN_TEST_SAMPLES = 10


class NoiseFloor:
    """A/A and A/B absolute errors per (signature, output leaf), bounded; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aa: dict[tuple[str, str], collections.deque[float]] = {}
        self._ab: dict[tuple[str, str], collections.deque[float]] = {}
        #: signature -> [greatest A/A abs error, greatest rel error, A/A runs, runs that differed]
        self.summary: dict[str, list[float]] = {}

    def add_aa(
        self,
        signature: str,
        leaves: Iterable[tuple[str, float]],
        rel_error: float,
        differs: bool,
        summarize: bool = True,
    ) -> None:
        """One A/A run's errors by leaf (all 0.0 when legacy repeated itself bitwise); ``summarize``: counted in
        :attr:`summary` (the forward's A/A runs; a backward's A/A products, leaves named ``grad:...``, are not)."""
        leaves = list(leaves)
        with self._lock:
            for leaf, error in leaves:
                self._window(self._aa, signature, leaf).append(error if differs else 0.0)
            if not summarize:
                return
            summary = self.summary.setdefault(signature, [0.0, 0.0, 0, 0])
            if differs:
                summary[0] = max(summary[0], max((e for _, e in leaves), default=0.0))
                summary[1] = max(summary[1], rel_error)
            summary[2] += 1
            summary[3] += differs

    def add_ab(self, signature: str, leaves: Iterable[tuple[str, float]]) -> None:
        """One compared call's legacy-vs-upstream errors by leaf."""
        with self._lock:
            for leaf, error in leaves:
                self._window(self._ab, signature, leaf).append(error)

    def judge(self, signature: str, leaves: Iterable[tuple[str, float]]) -> tuple[bool | None, str]:
        """(whether a value-only difference with these leaf errors is noise, the test behind it as text): None
        where it cannot be judged yet (a differing leaf with fewer than ``MIN_AA_RUNS`` A/A runs, or within the
        floor while the rank test has fewer than ``MIN_TEST_SAMPLES`` errors a side: a shift inside the floor is
        invisible call by call): the difference is then neither noise nor a mismatch until it can be."""
        notes = []
        with self._lock:
            windows = [
                (leaf, error, list(self._aa.get((signature, leaf), ())), list(self._ab.get((signature, leaf), ())))
                for leaf, error in leaves
                if error > 0
            ]
            # (a backward that varies anywhere varies everywhere: one leaf repeated bitwise so far proves nothing)
            varies = any(
                k[0] == signature and k[1].startswith(GRADIENT) and max(w, default=0) for k, w in self._aa.items()
            )
        if not windows:
            return False, ""
        for leaf, error, aa, ab in windows:
            name = leaf or "output"
            if len(aa) < MIN_AA_RUNS:
                return None, f"{name}: {len(aa)} A/A runs, {MIN_AA_RUNS} needed before a difference can be judged"
            gradient = leaf.startswith(GRADIENT)
            if max(aa) == 0 and not (gradient and varies):  # (legacy never differed from itself: nor can upstream)
                return False, f"{name}: abs error {error:.3g}; legacy repeated itself bitwise in {len(aa)} A/A runs"
            floor = float(np.quantile(aa, FLOOR_QUANTILE, method="lower"))
            where = f"abs error {error:.3g} within {MARGIN:g} x A/A floor {floor:.3g}"
            if error > MARGIN * floor:  # (beyond it: as often as legacy's own are beyond theirs?)
                beyond_aa, p_value, beyond = _exceedances(ab, aa, floor)
                where = f"abs error {error:.3g} > {MARGIN:g} x A/A floor {floor:.3g}; {beyond}"
                if p_value < TEST_LEVEL:
                    return False, f"{name}: {where} < {TEST_LEVEL:g}"
                # (held: legacy has not been seen beyond its own floor yet, or the counts cannot tell yet)
                if not beyond_aa or len(ab) < MIN_TEST_SAMPLES or p_value < AS_OFTEN_LEVEL:
                    return None, f"{name}: {where}: held until the counts tell"
                where += f" >= {AS_OFTEN_LEVEL:g}: as often as legacy's own"
            if len(ab) < MIN_TEST_SAMPLES or len(aa) < MIN_TEST_SAMPLES:  # (a shift inside the floor: unseen yet)
                return None, (
                    f"{name}: within {MARGIN:g} x A/A floor {floor:.3g}; the rank test needs {MIN_TEST_SAMPLES} "
                    f"errors a side (A/B {len(ab)}, A/A {len(aa)})"
                )
            p_value = _greater(ab, aa)
            test = f"{name}: Mann-Whitney A/B {len(ab)} vs A/A {len(aa)}, p={p_value:.3g}"
            if p_value < TEST_LEVEL:
                return False, f"{test} < {TEST_LEVEL:g}: upstream differs more than legacy differs from itself"
            notes.append(f"{test}; {where}")
        return True, "; ".join(notes)

    @staticmethod
    def _window(
        table: dict[tuple[str, str], collections.deque[float]], signature: str, leaf: str
    ) -> collections.deque[float]:
        window = table.get((signature, leaf))
        if window is None:
            window = table[(signature, leaf)] = collections.deque(maxlen=WINDOW)
        return window


def _greater(ab: list[float], aa: list[float]) -> float:
    """One-sided Mann-Whitney U p-value that A/B errors are stochastically greater than A/A errors (1.0 where
    either side has too few to say)."""
    if len(ab) < MIN_TEST_SAMPLES or len(aa) < MIN_TEST_SAMPLES:
        return 1.0
    if max(ab) == min(ab) == max(aa) == min(aa):
        return 1.0
    from scipy.stats import mannwhitneyu  # (here: scipy.stats takes seconds to import, and few jobs run A/A)

    return float(mannwhitneyu(ab, aa, alternative="greater").pvalue)


def _exceedances(ab: list[float], aa: list[float], floor: float) -> tuple[int, float, str]:
    """(the A/A errors beyond the floor of the others, the one-sided Fisher exact p-value that A/B errors exceed
    ``MARGIN`` x ``floor`` (the A/A errors' floor) more often than each A/A error exceeds ``MARGIN`` times the
    floor of the other A/A errors, the counts as text)."""
    from scipy.stats import fisher_exact

    ordered = np.sort(np.asarray(aa, dtype=np.float64))
    n = len(ordered)
    k = int(np.floor(FLOOR_QUANTILE * (n - 2)))  # (the floor's index among the n - 1 others, "lower")
    others = np.where(np.arange(n) <= k, ordered[min(k + 1, n - 1)], ordered[k])  # (each one's floor without it)
    beyond_aa = int(np.count_nonzero(ordered > MARGIN * others))
    beyond_ab = sum(error > MARGIN * floor for error in ab)
    table = [[beyond_ab, len(ab) - beyond_ab], [beyond_aa, n - beyond_aa]]
    p_value = float(fisher_exact(table, "greater")[1])
    return beyond_aa, p_value, f"beyond it A/B {beyond_ab}/{len(ab)} vs A/A {beyond_aa}/{n}, Fisher p={p_value:.3g}"
