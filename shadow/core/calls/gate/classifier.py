"""A target's signatures: what its signature function says of a call, within classifying's budget, checked for
side effects, the labels admitted up to a cap."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.calls.gate.budget import Budgets, Clock
from shadow.core.model.observation import UNCLASSIFIED_SIGNATURE, label_text
from shadow.core.model.targets import Target
from shadow.core.runs.isolation import SideEffects, call_without_side_effects

#: Distinct signatures a target may have (each is a metric series); later ones count as "other".
MAX_SIGNATURES = 100
OTHER_SIGNATURE = "other"


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
