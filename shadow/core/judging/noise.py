"""The noise floor: how much legacy differs from itself, and which differences are beyond it.

A real device's reductions are nondeterministic: two runs of legacy on one call differ (its A/A runs), and legacy
and upstream (A/B) differ at least as much, with a heavy tail (a reduction's spread varies from call to call; noise
that moves an activation across a ReLU's zero gates a whole gradient element). Diffy's idea for tensors, made
something a verdict can certify, per call signature and output leaf:

- **Two levels, fixed once.** A leaf's first ``BURN_IN`` A/A errors fix its threshold, ``FACTOR`` times their
  ``QUANTILE`` quantile (a high order statistic: one extraordinary input early, a huge one, does not raise it for
  the rest of the run), and its typical error, their median (absolute errors: an element near zero cannot make a
  relative one infinite). A leaf that never varied in its burn-in gets 0: any difference there is real, at once
  (and from its first ``BITWISE_RUNS`` A/A runs on, while every one of them repeated legacy bitwise: a deterministic
  target's differences are never held). The burn-in's runs are never counted after, so the levels are independent
  of everything they judge.
- **Every call judged against them, as often for legacy as for upstream.** After the burn-in, every A/B comparison
  of the signature (``ab``) and every A/A run (``aa``) is *below* (every leaf at or below its typical error),
  *within* (some leaf above it, none beyond its threshold) or *beyond* (an exceedance). An A/B difference below or
  within is outcome ``noise``; beyond is a value ``mismatch``, counted in every source and never called noise. Where
  upstream differs as legacy differs from itself, half of both sides' runs land above the typical error; a shift
  inside the threshold (upstream off by a fraction of the jitter on every call, invisible call by call) puts more
  of the A/B calls there, and the verdict rolls it back from those counts. Legacy's own A/A runs land beyond now
  and then under a heavy tail: their exceedances are counted as well, so that the verdict bounds the rate of A/B
  exceedances *beyond* the A/A rate at the same threshold (:mod:`shadow.analysis.noise_verdict`). Where legacy
  repeats itself bitwise, nothing is judged against a threshold and the verdict is the one it always was.
- **Held before.** A difference on a leaf whose burn-in is not complete is held (neither noise nor a mismatch) until
  it is, and a skip (``noise_pending``) if it never is.

The size a real difference must have to be seen follows: a wrong call stands out where its difference exceeds the
threshold, ``FACTOR`` times the ``QUANTILE`` quantile of ``BURN_IN`` A/A errors; a smaller one only where it is on so
many calls that they land above the typical error measurably more often than legacy's own. The verdict says so
(:mod:`shadow.analysis.noise_verdict`).

A backward comparison with A/A runs on keeps its gradients' thresholds here too: each product is a leaf named
``grad:<tensor>`` (:mod:`shadow.core.calls.sampled.extra_runs`); a backward that varies anywhere varies everywhere,
so a gradient leaf whose burn-in never varied takes the greatest threshold of its signature's gradients.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

from shadow.core.model.observation import CHECK_RESULTS, CHECKED_EVIDENCE, CHECKED_PAIRS

#: A/A runs of a signature's leaf that fix its threshold (never counted after). A signature has an A/A run on every
#: sampled call until they are made (:meth:`NoiseFloor.burning`), whatever the A/A rate.
BURN_IN = 200
#: A/A runs of a leaf, all bitwise equal, after which a difference there is real at once (legacy repeats itself:
#: a deterministic target's differences are never held for the whole burn-in).
BITWISE_RUNS = 10
#: The threshold: this many times the burn-in's A/A errors' ``QUANTILE`` quantile.
FACTOR = 6.0
#: The quantile of the burn-in's A/A errors the threshold multiplies (of 200, the second greatest: one extraordinary
#: error, a huge input's, does not set it).
QUANTILE = 0.995
#: How a gradient's leaf is named (:mod:`shadow.core.calls.sampled.extra_runs`).
GRADIENT = "grad:"

#: What a judgement against the levels found: a difference held until the burn-in ends, one below the typical
#: error, within the thresholds or beyond them (counted: the verdict's noise evidence), one where legacy never varied
#: (real at once), or nothing judged (no difference, no threshold).
PENDING, REAL = "pending", "real"
#: The checks the sources count: where a call stood against its levels.
CHECKS = CHECK_RESULTS
BELOW, WITHIN, BEYOND = CHECKS
#: The checks of a call judged noise where its outcome is a value mismatch.
NOISE_CHECKS = (BELOW, WITHIN)
#: Which evidence a check is of, and which pair of runs it compares (legacy against upstream, legacy against itself).
EVIDENCE, PAIRS = CHECKED_EVIDENCE, CHECKED_PAIRS


def evidence_of(leaves: Iterable[tuple[str, float]]) -> str:
    """``gradients`` for a backward comparison's leaves, else ``forward``."""
    return "gradients" if any(leaf.startswith(GRADIENT) for leaf, _ in leaves) else "forward"


class NoiseFloor:
    """Each signature's leaves' burn-ins and thresholds; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (signature, leaf) -> the burn-in's A/A errors so far, until it ends
        self._burn_in: dict[tuple[str, str], list[float]] = {}
        #: (signature, leaf) -> the threshold, once the burn-in ended
        self._threshold: dict[tuple[str, str], float] = {}
        #: (signature, leaf) -> the typical A/A error (the burn-in's median), once it ended
        self._typical: dict[tuple[str, str], float] = {}
        #: signature -> [greatest A/A abs error, greatest rel error, A/A runs, runs that differed]
        self.summary: dict[str, list[float]] = {}

    def add_aa(
        self,
        signature: str,
        leaves: Iterable[tuple[str, float]],
        rel_error: float,
        differs: bool,
        summarize: bool = True,
    ) -> str:
        """One A/A run's errors by leaf (all 0.0 where legacy repeated itself bitwise); ``summarize``: counted in
        :attr:`summary` (the forward's A/A runs; a backward's A/A products, leaves named ``grad:...``, are not).
        Returns where the run stood against the levels (:data:`BELOW`, :data:`WITHIN`, :data:`BEYOND`), or "" where
        it went into a burn-in or its signature's leaves never varied."""
        leaves = [(leaf, error if differs else 0.0) for leaf, error in leaves]
        with self._lock:
            judged = self._judged(signature, leaves) if self._all_fixed(signature, leaves) else ""
            for leaf, error in leaves:
                burning = self._burn_in.get((signature, leaf))
                if (signature, leaf) in self._threshold:
                    continue
                if burning is None:
                    burning = self._burn_in[(signature, leaf)] = []
                burning.append(error)
                if len(burning) >= BURN_IN:
                    ordered = sorted(burning)
                    self._threshold[(signature, leaf)] = FACTOR * ordered[math.ceil(QUANTILE * len(ordered)) - 1]
                    self._typical[(signature, leaf)] = ordered[(len(ordered) - 1) // 2]
                    del self._burn_in[(signature, leaf)]
            if summarize:
                summary = self.summary.setdefault(signature, [0.0, 0.0, 0, 0])
                if differs:
                    summary[0] = max(summary[0], max((e for _, e in leaves), default=0.0))
                    summary[1] = max(summary[1], rel_error)
                summary[2] += 1
                summary[3] += differs
        return judged if judged in CHECKS else ""

    def judge(self, signature: str, leaves: Iterable[tuple[str, float]]) -> tuple[str, str]:
        """(where a compared call's leaf errors stand against its signature's levels, the judgement as text):
        :data:`PENDING` where a leaf that differs has no threshold yet, :data:`REAL` where one differs that legacy
        never varied, :data:`BEYOND` where one is beyond its threshold, :data:`WITHIN` where every one is within
        and one is above its typical error, :data:`BELOW` where none is (and some can vary), "" where nothing was
        judged (no difference, and no threshold that can vary)."""
        leaves = list(leaves)
        with self._lock:
            missing = next((leaf for leaf, e in leaves if e > 0 and self._known(signature, leaf) is None), None)
            if missing is not None:
                runs = len(self._burn_in.get((signature, missing), ()))
                return PENDING, f"{missing or 'output'}: {runs} A/A runs of the {BURN_IN} that fix its threshold"
            if not self._all_fixed(signature, leaves):
                if any(e > 0 for _, e in leaves):  # (a difference where legacy so far repeated itself bitwise)
                    return REAL, self._text(signature, leaves)
                return "", ""
            return self._judged(signature, leaves), self._text(signature, leaves)

    def burning(self, signature: str) -> bool:
        """Whether ``signature``'s burn-in is under way (or not begun): its sampled calls then all get an A/A run, so
        that its thresholds are fixed after ``BURN_IN`` sampled calls whatever the A/A rate, and the differences held
        meanwhile are few. Not where legacy repeated itself bitwise so far (``BITWISE_RUNS`` runs or more)."""
        with self._lock:
            burning = [runs for (s, _), runs in self._burn_in.items() if s == signature]
            if not burning:
                return not any(s == signature for s, _ in self._threshold)
            return not all(len(runs) >= BITWISE_RUNS and max(runs) == 0 for runs in burning)

    def thresholds(self, signature: str) -> dict[str, float]:
        """The fixed thresholds of ``signature``'s leaves."""
        with self._lock:
            return {leaf: t for (s, leaf), t in self._threshold.items() if s == signature}

    def _known(self, signature: str, leaf: str) -> float | None:
        """A leaf's threshold: fixed, or 0 while its burn-in has repeated legacy bitwise ``BITWISE_RUNS`` times or
        more; None while it cannot be said."""
        fixed = self._threshold.get((signature, leaf))
        if fixed is not None:
            return fixed
        burning = self._burn_in.get((signature, leaf), ())
        return 0.0 if len(burning) >= BITWISE_RUNS and max(burning) == 0 else None

    def _all_fixed(self, signature: str, leaves: list[tuple[str, float]]) -> bool:
        return bool(leaves) and all((signature, leaf) in self._threshold for leaf, _ in leaves)

    def _of(self, signature: str, leaf: str) -> float:
        """A known leaf's threshold; a gradient leaf that never varied takes its signature's greatest gradient one."""
        threshold = self._known(signature, leaf) or 0.0
        if threshold == 0 and leaf.startswith(GRADIENT):
            threshold = max(
                (t for (s, other), t in self._threshold.items() if s == signature and other.startswith(GRADIENT)),
                default=0.0,
            )
        return threshold

    def _judged(self, signature: str, leaves: list[tuple[str, float]]) -> str:
        thresholds = [(error, self._of(signature, leaf)) for leaf, error in leaves]
        if any(error > 0 and threshold == 0 for error, threshold in thresholds):
            return REAL
        if not any(threshold > 0 for _, threshold in thresholds):
            return ""  # (legacy never varied, and nothing differs: no noise to judge against)
        if any(error > threshold for error, threshold in thresholds):
            return BEYOND
        above = any(error > self._typical.get((signature, leaf), 0.0) for leaf, error in leaves)
        return WITHIN if above else BELOW

    def _text(self, signature: str, leaves: list[tuple[str, float]]) -> str:
        """The greatest leaf error against its threshold, as the judgement's text."""
        error, leaf = max((e, leaf) for leaf, e in leaves)
        threshold, name = self._of(signature, leaf), leaf or "output"
        if threshold == 0:
            runs = BURN_IN if (signature, leaf) in self._threshold else len(self._burn_in.get((signature, leaf), ()))
            return f"{name}: abs error {error:.3g}; legacy repeated itself bitwise in its {runs} A/A runs"
        where = "beyond" if error > threshold else "within"
        return (
            f"{name}: abs error {error:.3g} {where} its threshold {threshold:.3g} ({FACTOR:g} x the {QUANTILE:g} "
            f"quantile of {BURN_IN} A/A errors)"
        )
