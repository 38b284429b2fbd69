"""The noise floor: how much legacy differs from itself, as a distribution, and whether upstream differs more.

Diffy's idea for tensors: legacy run twice on the same call (an A/A run) shows the target's own nondeterminism. A
legacy-vs-upstream (A/B) value difference is ``noise`` only while two things hold for every output leaf that
differs, per call signature:

- the call's error is within ``MARGIN`` times the floor, the greatest of the A/A errors in the window (absolute
  errors only, so an element near zero cannot make a relative floor infinite), after at least ``MIN_AA_RUNS``
  A/A runs. Where upstream differs from legacy as legacy differs from itself, the A/B and A/A errors are
  exchangeable, and a call's error exceeds the greatest of n A/A errors with probability at most 1 / (n + 1),
  whatever the noise's distribution. A call beyond the floor is therefore judged by how often that happens: a
  mismatch once the A/B errors exceed the floor more often than legacy's own A/A errors exceeded theirs (the
  A/A errors each beyond ``MARGIN`` times the greatest before it; a one-sided Fisher exact test at
  ``TEST_LEVEL`` over the window), and held until then (neither noise nor a mismatch: a skip if never judged).
  A nondeterministic kernel's rare large difference (a ReLU whose input the noise moves across zero changes a
  gradient element by 10-20%) is as likely in legacy's second run as in upstream's, and is no divergence; a
  real difference beyond the floor is one on every call, and is found within about five;
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

#: A value difference within this many times the robust floor can be noise.
MARGIN = 2.0
#: A/A runs of a signature and leaf before any difference there is called noise.
MIN_AA_RUNS = 10
#: Errors kept per signature and leaf, on each side, for the rank test.
WINDOW = 200
#: The rank test's level: below it, upstream differs more than legacy differs from itself (small: the test is
#: taken again at every value difference, over windows that overlap).
TEST_LEVEL = 0.001
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
        if not windows:
            return False, ""
        for leaf, error, aa, ab in windows:
            name = leaf or "output"
            if len(aa) < MIN_AA_RUNS:
                return None, f"{name}: {len(aa)} A/A runs, {MIN_AA_RUNS} needed before a difference can be judged"
            floor = max(aa)
            if error > MARGIN * floor:
                beyond, p_value = _exceedances(ab, aa, floor)
                if p_value < TEST_LEVEL:
                    beyond_floor = f"abs error {error:.3g} > {MARGIN:g} x A/A floor {floor:.3g}"
                    return False, f"{name}: {beyond_floor}; {beyond} < {TEST_LEVEL:g}"
                return None, (
                    f"{name}: abs error {error:.3g} > {MARGIN:g} x A/A floor {floor:.3g}; {beyond}: no more often than "
                    "legacy's own yet"
                )
            if len(ab) < MIN_TEST_SAMPLES or len(aa) < MIN_TEST_SAMPLES:  # (a shift inside the floor: unseen yet)
                return None, (
                    f"{name}: within {MARGIN:g} x A/A floor {floor:.3g}; the rank test needs {MIN_TEST_SAMPLES} "
                    f"errors a side (A/B {len(ab)}, A/A {len(aa)})"
                )
            p_value = _greater(ab, aa)
            test = f"{name}: Mann-Whitney A/B {len(ab)} vs A/A {len(aa)}, p={p_value:.3g}"
            if p_value < TEST_LEVEL:
                return False, f"{test} < {TEST_LEVEL:g}: upstream differs more than legacy differs from itself"
            notes.append(f"{test}; abs error {error:.3g} within {MARGIN:g} x A/A floor {floor:.3g}")
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


def _exceedances(ab: list[float], aa: list[float], floor: float) -> tuple[str, float]:
    """(the counts as text, the one-sided Fisher exact p-value) that A/B errors exceed ``MARGIN`` x ``floor`` more
    often than A/A errors exceed ``MARGIN`` times the greatest A/A error before them."""
    from scipy.stats import fisher_exact

    beyond_ab = sum(error > MARGIN * floor for error in ab)
    beyond_aa, greatest = 0, aa[0]
    for error in aa[1:]:
        beyond_aa += error > MARGIN * greatest
        greatest = max(greatest, error)
    n_ab, n_aa = len(ab), len(aa) - 1
    p_value = float(fisher_exact([[beyond_ab, n_ab - beyond_ab], [beyond_aa, n_aa - beyond_aa]], "greater")[1])
    return f"beyond it A/B {beyond_ab}/{n_ab} vs A/A {beyond_aa}/{n_aa}, Fisher p={p_value:.3g}", p_value
