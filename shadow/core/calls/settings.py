"""How a monitor shadows its targets: one frozen record, checked whole when it is made."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shadow.core.calls.gate.budget import DEFAULT_DEADLINE, Budgets
from shadow.core.calls.sampled.drill import Drill
from shadow.core.model.observation import DEFAULT_FIRST_PER_SIGNATURE, LEGACY, PRIMARY_SIDES
from shadow.core.support.rates import check_rate


@dataclasses.dataclass(frozen=True)
class Settings:
    """A monitor's settings (every target's alike; sample rates and tolerances are per target, given beside them).
    Made by ``shadow.install`` from its keyword arguments and by the launcher from its variables.

    Attributes:
        seed: makes every random draw reproducible (None: the operating system's randomness).
        drill: a fire drill injecting synthetic divergence into the shadow run (never into what the caller gets).
        oracle: for the DataParallel targets, the fraction of sampled calls without autocast that also run replica
            0 alone on its device, to find divergences legacy and upstream share (under autocast always); None: off.
        budget: the fraction of wall time the shadow side of all the targets together may use, over every 10 s
            window (None: no limit); a :class:`~shadow.core.calls.gate.budget.Budgets` is taken as it is (an injected
            clock).
        deadline: the seconds the shadow side of one sampled call may take (None: waited for until it ends).
        pure_hooks: the user's module hooks are free of side effects, so calls that reach them are compared.
        first_per_signature: the first this many calls of every signature are compared whatever the rate (0:
            uniform sampling, calls not classified).
        aa_rate: the fraction of sampled calls on which the primary runs again, isolated (the noise floor).
        primary: the side whose result the caller gets: ``"legacy"`` (shadowing) or ``"upstream"`` (a canary).
        backward_rate: the fraction of sampled calls of an isolated target whose gradients are compared too.
        backward_memory: the most device memory a backward comparison's two graphs may take, as a share of the job's
            own (:mod:`shadow.core.calls.gate.graph_memory`); one that would take more is not made (backward skip
            ``memory``). None: no limit.
        truth_rate: the fraction of calls with a value difference that run again in float64 (which side is nearer).
        count_patches: the dotted names of a release's function patches (its census) whose places get a call
            counter (:mod:`shadow.core.calls.patch_calls`): which of them the job calls.
        trusted_checkpoints: the job's checkpoints are safe to unpickle twice: ``torch_load`` compares loads whose
            pickle names the job's own classes or functions, or with a callable ``map_location`` (else skipped).

    Raises:
        ValueError: naming the setting and what it accepts, for any bad value.
    """

    seed: int | None = None
    drill: Drill | None = None
    oracle: float | None = 0.1
    budget: float | Budgets | None = None
    deadline: float | None = DEFAULT_DEADLINE
    pure_hooks: bool = False
    first_per_signature: int = DEFAULT_FIRST_PER_SIGNATURE
    aa_rate: float = 0.0
    primary: str = LEGACY
    backward_rate: float = 0.0
    backward_memory: float | None = None
    truth_rate: float = 0.0
    trusted_checkpoints: bool = False
    count_patches: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def fix(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: expected an int or None, got {self.seed!r}")
        if self.drill is not None and not isinstance(self.drill, Drill):
            raise ValueError(f"drill: expected a shadow.core.calls.sampled.drill.Drill or None, got {self.drill!r}")
        if self.oracle is not None:
            fix("oracle", check_rate(self.oracle, "oracle"))
        if self.budget is not None and not isinstance(self.budget, Budgets):
            fix("budget", check_rate(self.budget, "budget", low="(0"))
        deadline = self.deadline
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 < deadline < math.inf
        ):
            raise ValueError(f"deadline: expected seconds > 0 or None, got {deadline!r}")
        if isinstance(self.count_patches, str) or not all(isinstance(n, str) for n in self.count_patches):
            raise ValueError(f"count_patches: expected dotted names, got {self.count_patches!r}")
        fix("count_patches", tuple(self.count_patches))
        for flag in ("pure_hooks", "trusted_checkpoints"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: expected True or False, got {getattr(self, flag)!r}")
        first = self.first_per_signature
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"first_per_signature: expected an int >= 0, got {first!r}")
        for name in ("aa_rate", "backward_rate", "truth_rate"):
            fix(name, check_rate(getattr(self, name), name))
        if self.backward_memory is not None:
            fix("backward_memory", check_rate(self.backward_memory, "backward_memory"))
        if self.primary not in PRIMARY_SIDES:
            raise ValueError(f"primary: expected one of {PRIMARY_SIDES}, got {self.primary!r}")

    def budgets(self) -> Budgets | None:
        """The allowances of one install (shared by its targets), or None without a budget."""
        if isinstance(self.budget, Budgets) or self.budget is None:
            return self.budget
        return Budgets.of(self.budget)
