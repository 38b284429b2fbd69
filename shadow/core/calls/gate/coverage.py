"""A guided target's signatures: its :class:`Classifier` (what its signature function says of a call, within
classifying's budget, checked for side effects, the labels admitted up to a cap), and coverage guidance's bookkeeping
(:class:`Coverage`): its calls by signature, and which calls are among the first of their signature (those are
compared whatever the sample rate).

While some signature seen is still short of its first calls, every call is classified (the target's signature
function runs on it) and counted one by one. Once every signature seen has had its first calls, calls are
classified one in :data:`CLASSIFY_ONE_IN` on average: at the end of a gate drawn as sampled calls are drawn
(geometric gaps, :mod:`shadow.core.calls.gate.sampling`), so the unsampled path is the plain wrapper's ``next(gate,
False)``.
The call that ends a gate stands for the gate: the calls that passed it are counted under its signature. This is
systematic sampling with random gaps (Cochran, *Sampling Techniques*, 3rd ed., ch. 8; the gaps are geometric, so
where a gate ends is independent of the signatures): a signature's count is an unbiased estimate, its variance
about ``calls x p (1 - p) x E[gap^2] / E[gap]`` for a signature of share ``p``, and the total stays exact. The
calls of the gate still open are counted under the signature classified last when the counts are flushed. A
signature first seen on a classified call has its first calls compared from then on, every call classified again
meanwhile: a signature that is a share ``p`` of the calls is found after about ``CLASSIFY_ONE_IN / p`` calls
instead of ``1 / p``.

A target with a signature key (``Target.signature_key``: ``Tensor.type`` has one) is found at once instead: every
call's key is looked at, and a call whose key is not known yet (its signature has not had its first calls, or it
has no cheap key: a cast by name, where the risky paths are) comes beside the gates, classified and counted alone;
it never stands for the gate's calls (those are of known keys).

Not thread-safe by itself: the engine calls it under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.calls.gate.budget import Budgets, Clock
from shadow.core.model.observation import MAX_SIGNATURES, OTHER_SIGNATURE, UNCLASSIFIED_SIGNATURE, label_text
from shadow.core.model.targets import Target
from shadow.core.runs.isolation import SideEffects, call_without_side_effects


class _NotClassified(Exception):
    """The budget is too deep in debt for a call to be classified, or its signature function is not run any more."""


class Classifier:
    """The signatures of one target's calls.

    Args:
        target: whose signature function it runs.
        budgets: the monitor's allowances (None: no limit): classifying has its own, and is charged to both (every
            call what the last timed one took).
        clock: what the classifying is timed on (the budget's).
        log: the experiment's rate-limited log (``kind, message, *args``).
        over_cap: called (with no argument) for each call whose signature counts as "other".
    """

    def __init__(
        self,
        target: Target,
        budgets: Budgets | None,
        clock: Clock,
        log: Callable[..., None],
        over_cap: Callable[[], None],
    ) -> None:
        self.target, self.budgets, self._clock, self._log, self._over_cap = target, budgets, clock, log, over_cap
        #: The signature function changed a generator or the grad mode (put back): it is not run any more.
        self.has_side_effects = False
        self._lock = threading.Lock()
        self._signatures: set[str] = set()
        self._labels: dict[Any, str] = {}  # what the signature function returned -> the admitted label
        self._classified = 0
        self.seconds = 0.0  # (what the last timed call of the signature function took)

    def classify(self, args: tuple, kwargs: dict) -> str:
        """A guided target's call: its signature. A signature function that fails, or that the budget has no worker
        for, classifies as "unclassified"."""
        budgets = self.budgets
        try:
            if budgets is not None and not budgets.classifying.allows():
                raise _NotClassified  # (classifying alone has used the budget)
            if self.has_side_effects:
                raise _NotClassified
            # (one call in 16 is timed, the first among them: every call is charged what the last timed one took;
            # the first 64 calls and one in 256 after are checked: a function that changed a generator or the grad
            # mode is put back and never run again; not while dynamo traces this, where the check's own reads of
            # the generators would be traced too)
            self._classified += 1
            checked = (
                not self.target.signature_pure
                and (self._classified <= 64 or self._classified & 255 == 1)
                and not torch.compiler.is_compiling()
            )
            timed = budgets is not None and self._classified & 15 == 1
            start = self._clock() if timed else 0.0
            with torch._C.DisableTorchFunction():  # (a user's mode or tensor subclass never sees the classifying)
                raw = self.signature_of(args, kwargs) if checked else self.target.signature(args, kwargs)
            label = self._labels.get(raw)
            if label is None:
                label = self.admit(label_text(str(raw), 64))
                if len(self._labels) < 4 * MAX_SIGNATURES:
                    self._labels[raw] = label
            if timed:
                self.seconds = self._clock() - start
            if budgets is not None:
                budgets.classifying.charge(self.seconds)
                budgets.shadow.charge(self.seconds)
        except KeyboardInterrupt:
            raise
        except BaseException:  # the user's signature function: its failure is counted, never the job's
            return UNCLASSIFIED_SIGNATURE
        return label

    def signature_of(self, args: tuple, kwargs: dict) -> Any:
        """The target's signature function on a call, checked: one that changes a generator or the grad mode
        (:func:`shadow.core.runs.isolation.call_without_side_effects`) has it put back, is said once and never runs
        again (its calls classify as "unclassified"); raises what it raised. A pure one
        (:attr:`Target.signature_pure`) is called as it is."""
        if self.target.signature_pure:
            return self.target.signature(args, kwargs)
        try:
            return call_without_side_effects(self.target.signature, args, kwargs)
        except SideEffects as exc:
            self.has_side_effects = True
            self._log("signature", "its signature function is not run any more: %s (put back)", exc)
            raise

    def admit(self, signature: str) -> str:
        """The signature itself while the target has fewer than MAX_SIGNATURES, else "other" (counted, logged)."""
        if signature in self._signatures:
            return signature
        with self._lock:
            if len(self._signatures) < MAX_SIGNATURES:
                self._signatures.add(signature)
                return signature
        self._over_cap()
        self._log("signatures", "more than %d signatures; the rest count as %r", MAX_SIGNATURES, OTHER_SIGNATURE)
        return OTHER_SIGNATURE


#: Once every signature seen has had its first calls, one call in this many (on average) is classified.
CLASSIFY_ONE_IN = 64


class Coverage:
    """Calls by signature of one guided target, and its first calls of each signature still to compare."""

    def __init__(self, first_per_signature: int) -> None:
        if first_per_signature < 1:
            raise ValueError(f"first_per_signature: expected >= 1 for coverage guidance, got {first_per_signature}")
        self.first_per_signature = first_per_signature
        #: signature -> calls (estimated once calls are classified one in CLASSIFY_ONE_IN; the total is exact)
        self.calls: dict[str, int] = {}
        #: Every call is classified (until every signature seen has had its first calls).
        self.classify_all = True
        #: Calls counted as they were classified one by one (the rest are counted by the sampler's gates).
        self.counted_alone = 0
        self._left: dict[str, int] = {}  # signature -> first calls still to compare
        self._unfinished = 0  # signatures with first calls still to compare
        self._last: str | None = None  # the signature classified last: the calls passing after it are its
        self._credited = 0  # the calls the gates counted that are credited to a signature

    def finished(self, signature: str) -> bool:
        """Whether ``signature`` has had its first calls."""
        return self._left.get(signature) == 0

    @property
    def done(self) -> bool:
        """Every signature seen has had its first calls (and at least one was seen)."""
        return not self._unfinished and bool(self._left)

    def count(self, signature: str, gated_calls: int | None = None, beside: bool = False) -> bool:
        """One classified call of ``signature``, counted; whether it is among the first of its signature. Updates
        :attr:`classify_all`. ``gated_calls``: where the call ended a gate, every call the gates' sampler has
        counted so far (this one included): those not counted yet are its gate's, counted under its signature.
        ``beside``: the call came beside the gates (a target's signature key not known yet): counted alone, and
        the calls passing the open gate are not its."""
        if gated_calls is None:
            self.counted_alone += 1
            credit = 1
        else:
            credit, self._credited = max(gated_calls - self._credited, 0), gated_calls
        self.calls[signature] = self.calls.get(signature, 0) + credit
        if not beside or self._last is None:
            self._last = signature
        left = self._left.get(signature)
        if left is None:
            left = self.first_per_signature
            self._unfinished += 1
        first = left > 0
        if first:
            left -= 1
            self._unfinished -= not left
        self._left[signature] = left
        self.classify_all = not self.done
        return first

    def counts(self, gated_calls: int, flush: bool = False) -> dict[str, int]:
        """The calls by signature, the open gate's calls (``gated_calls``: every call the gates' sampler has counted
        so far) under the signature classified last; ``flush``: counted so from now on (else a view)."""
        pending = gated_calls - self._credited
        if pending <= 0 or self._last is None:
            return dict(self.calls)
        if flush:
            self.calls[self._last] += pending
            self._credited = gated_calls
            return dict(self.calls)
        return {**self.calls, self._last: self.calls[self._last] + pending}
