"""What one sampled call reads of its target's experiment: a frozen :class:`CallContext`, made again whenever the
primary switches (a rollback, a reset) or a forked child starts, and its :class:`Coins`. A sampled call never sees
the experiment itself; what it reports goes back through the context's record and two callbacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shadow.core.calls.gate.budget import ShadowCost
from shadow.core.calls.gate.classifier import Classifier
from shadow.core.calls.gate.coin import Coin
from shadow.core.calls.record.record import Record
from shadow.core.calls.sampled.drill import Drill
from shadow.core.judging.noise import NoiseFloor
from shadow.core.model.observation import Observation
from shadow.core.model.targets import Target
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs.deadline import Finished, leave_worker, run_within, worker
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.sides import current_run, marks


@dataclasses.dataclass(frozen=True)
class Coins:
    """A target's random draws, each from a stream of its own: the single-device oracle (None: off; every sampled
    call under autocast and this fraction of the others, for targets that describe a single-device call), the A/A
    run (the noise floor), the backward comparison (its cotangents' seeds drawn from it), the truth run (among value
    differences)."""

    oracle: Coin | None
    aa: Coin
    backward: Coin
    truth: Coin

    @classmethod
    def of(cls, target: Target, seed: int | None, oracle: float | None, aa: float, backward: float, truth: float):
        """The coins of ``target`` at these rates (``oracle`` None: no oracle), seeded by the monitor's ``seed``."""
        oracle = oracle if target.oracle is not None and target.isolate else None
        return cls(
            Coin(oracle, seed, f"{target.name}/oracle") if oracle is not None else None,
            Coin(aa, seed, f"{target.name}/aa"),
            Coin(backward, seed, f"{target.name}/backward"),
            Coin(truth, seed, f"{target.name}/truth"),
        )


@dataclasses.dataclass(frozen=True)
class CallContext:
    """What a sampled call of one target works from, frozen when the call is admitted.

    Args:
        target: what is shadowed.
        primary: the side whose result the caller gets (``legacy``, or ``upstream`` in a canary).
        primary_fn: its function.
        shadow_fn: the other side's, run again isolated as the same call.
        legacy: legacy's function, whatever the primary (the A/A run's, the backward comparison's).
        legacy_origin: where legacy comes from (a torch_npu release's patch), for the observation.
        tolerance: the target's tolerance.
        pure_hooks: the job's module hooks are declared free of side effects.
        deadline: the most seconds the caller waits for a run of the shadow side (None: no limit).
        drill: the fire drill, where one runs.
        coins: the target's draws.
        noise: the noise floor of the current phase.
        classifier: the target's signatures.
        record: what the target counted (and its log).
        cost: what the shadow side cost, charged to the budget.
        side: who the call's shadow side runs as (the experiment: a nested call of the target there runs the
            shadow); an identity, never read.
        deadline_missed: called when a run passed its deadline (the target stops shadowing).
        publish: counts and exports an observation.
    """

    target: Target
    primary: str
    primary_fn: Callable
    shadow_fn: Callable
    legacy: Callable
    legacy_origin: str
    tolerance: ToleranceSpec
    pure_hooks: bool
    deadline: float | None
    drill: Drill | None
    coins: Coins
    noise: NoiseFloor
    classifier: Classifier
    record: Record
    cost: ShadowCost
    side: object
    deadline_missed: Callable[[], None]
    publish: Callable[[Observation], None]

    def within_deadline(
        self, side: object, before: TorchGlobals, body: Callable[[], Any], checks_its_settings: bool = False
    ) -> Finished:
        """``body()`` (a run of the shadow side, as ``side``'s, from the settings ``before``, which this thread has
        written already): on a daemon thread of the shadow side's, waited for at most the deadline
        (:mod:`shadow.core.runs.deadline`; without one, until it ends). Past the deadline the run is abandoned and
        the target stops shadowing (``deadline_missed``). An interrupt the body raised is raised here, as it would
        be on the caller's thread. A run that leaves a setting of its thread changed ends its worker (the body says
        so itself where ``checks_its_settings``)."""
        run, record = current_run(), self.record

        def start() -> None:
            marks.shadow_side, marks.run = side, run
            # (a worker whose run changed a setting ends with it: a worker kept holds what its last run started from)
            known = getattr(worker, "settings", None)
            if known is not None and known.same_as(before):
                return
            if record.put_back(before):  # (on the worker: its thread-local settings the caller's)
                worker.settings = before
            else:
                leave_worker()

        def checked() -> Any:
            try:
                return body()
            finally:
                if not TorchGlobals().same_as(before):
                    leave_worker()

        found = run_within(self.deadline, body if checks_its_settings else checked, start=start)
        if isinstance(found.error, KeyboardInterrupt):
            raise found.error
        if not found.finished:
            self.deadline_missed()
        return found
