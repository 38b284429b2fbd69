"""Coverage guidance's bookkeeping for one target: its calls by signature, and which calls are among the first of
their signature (those are compared whatever the sample rate).

While some signature seen is still short of its first calls, every call is classified (the target's signature
function runs on it) and counted one by one. Once every signature seen has had its first calls, calls are
classified one in :data:`CLASSIFY_ONE_IN` on average: at the end of a gate drawn as sampled calls are drawn
(geometric gaps, :mod:`shadow.core.calls.gate.sampler`), so the unsampled path is the plain wrapper's ``next(gate,
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
