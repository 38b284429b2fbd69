"""What a sampled call works from: the :class:`CallContext` it reads of its target's experiment (frozen, made again
whenever the primary switches or a forked child starts; a sampled call never sees the experiment itself), its
:class:`Coins`, and, taken before the primary runs, its :class:`Plan` (the isolation, the signature, the settings the
primary starts from, which extra runs join in, their named slots) and the :class:`Run` of each side."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shadow.core.calls.gate.budget import ShadowCost
from shadow.core.calls.gate.coin import Coin
from shadow.core.calls.gate.coverage import Classifier
from shadow.core.calls.gate.graph_memory import GraphMemory
from shadow.core.calls.record.record import Record
from shadow.core.calls.sampled.drill import Drill
from shadow.core.judging.noise import NoiseFloor
from shadow.core.model.observation import UNCLASSIFIED_SIGNATURE, UPSTREAM, label_text
from shadow.core.model.targets import Target
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs import hook_watch
from shadow.core.runs.deadline import Finished, leave_worker, run_within, worker
from shadow.core.runs.global_state import TorchGlobals, Writes
from shadow.core.runs.isolation import Isolation, SideEffects, detach_tensors
from shadow.core.runs.sides import marks


@dataclasses.dataclass(frozen=True)
class Coins:
    """A target's random draws, each from a stream of its own, None where it never draws: the single-device oracle
    (every sampled call under autocast and this fraction of the others, for targets that describe a single-device
    call), the A/A run (the noise floor), the backward comparison (its cotangents' seeds drawn from it), the truth
    run (among value differences)."""

    oracle: Coin | None
    aa: Coin | None
    backward: Coin | None
    truth: Coin | None

    @classmethod
    def of(cls, target: Target, seed: int | None, oracle: float | None, aa: float, backward: float, truth: float):
        """The coins of ``target`` at these rates (``oracle`` None: no oracle; a rate of 0: no coin), seeded by the
        monitor's ``seed``."""
        oracle = oracle if target.oracle is not None and target.isolate else None

        def coin(rate: float | None, what: str) -> Coin | None:
            return (
                Coin(rate, seed, f"{target.name}/{what}")
                if rate is not None and (rate > 0 or what == "oracle")
                else None
            )

        return cls(coin(oracle, "oracle"), coin(aa, "aa"), coin(backward, "backward"), coin(truth, "truth"))


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
        plain: the target's calls are plain functions of tensors (:attr:`Target.plain`: the extra runs are made).
        experiment: the experiment the call is of, as its runs are marked (a nested call of the target on the
            shadow side runs the shadow, on the primary's the primary); an identity, never read.
        deadline_missed: called when a run passed its deadline (the target stops shadowing).
        graph_memory: what a backward comparison's graphs may take (None: no limit).
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
    plain: bool
    experiment: object
    deadline_missed: Callable[[], None]
    graph_memory: GraphMemory | None = None

    def within_deadline(
        self,
        run: object,
        runs_as: object,
        before: TorchGlobals,
        body: Callable[[], Any],
        written: set[str] | None = None,
        left: Callable[[TorchGlobals], None] | None = None,
    ) -> Finished:
        """``body()`` (a run of the shadow side, ``run``, marked as ``runs_as``'s: an experiment's shadow run, or a role
        such as the A/A run's; :func:`~shadow.core.runs.sides.shadow_run`),
        from the settings ``before``, which this thread has written already): on a daemon thread of the shadow
        side's, waited for at most the deadline (:mod:`shadow.core.runs.deadline`; without one, until it ends). Past the
        deadline the run is abandoned and the target stops shadowing (``deadline_missed``). An interrupt the body raised
        is raised here, as it would be on the caller's thread. The settings the body left are taken on its thread
        once it ended, and given to ``left`` where there is one; a run that left a setting of its thread changed ends
        its worker. The process-wide settings the body wrote are added to ``written``."""
        record, writes = self.record, Writes()

        def start() -> None:
            marks.shadow_side, marks.run = runs_as, run
            # (a worker whose run changed a setting ends with it: a worker kept holds what its last run started from)
            known = getattr(worker, "settings", None)
            if known is not None and known.same_as(before):
                return
            if record.put_back(before):  # (on the worker: its thread-local settings the caller's)
                worker.settings = before
            else:
                leave_worker()

        def watched() -> Any:
            try:
                with writes:
                    return body()
            finally:  # (outside the watch: reading the settings is no call of the body's)
                settings = TorchGlobals()
                if left is not None:
                    left(settings)
                if not settings.as_written_by(writes.names, before).same_as(before):
                    leave_worker()

        found = run_within(self.deadline, watched, start=start)
        if written is not None:
            written |= writes.names
        if isinstance(found.error, KeyboardInterrupt):
            raise found.error
        if not found.finished:
            self.deadline_missed()
        return found


#: The isolated runs of a sampled call, by name (:attr:`Plan.slots`): the shadow run's, the single-device oracle's,
#: the backward comparison's two runs of legacy (a graph of its own, and a second one: the gradients' own noise),
#: the A/A run's.
SHADOW, ORACLE, BACKWARD, BACKWARD_AA, AA = "shadow", "oracle", "backward", "backward_aa", "aa"


def autocast_state() -> str:
    """The autocast state of the CPU and the accelerator, as text (``cpu=off, npu=on/float16``)."""
    accelerator = torch.accelerator.current_accelerator()
    device_types = ["cpu"] + ([accelerator.type] if accelerator is not None else [])
    if "cuda" not in device_types and torch.is_autocast_enabled("cuda"):  # (the flag parallel_apply reads)
        device_types.append("cuda")

    def state(device_type: str) -> str:
        if not torch.is_autocast_enabled(device_type):
            return "off"
        return "on/" + str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")

    return ", ".join(f"{t}={state(t)}" for t in device_types)


@dataclasses.dataclass(frozen=True)
class Run:
    """One side's run of a call: what it returned or raised, how long it took, the autocast state it ran under."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    autocast: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the shadow side of one sampled call needs, taken before the primary runs: the isolation (None for
    targets that are not isolated; it copies the arguments after the primary), the arguments of a target that is
    not isolated (the caller's own, with new leaves for those that require grad), the call's signature, the autocast
    state and torch settings the primary starts from, and the extra runs that join in."""

    isolation: Isolation | None
    args: tuple | None
    kwargs: dict | None
    signature: str
    autocast: str
    before: TorchGlobals
    #: The isolated runs, in the isolation's order: the shadow run's, then the extra runs' that join it, each in a
    #: slot of its own (where the target is isolated): the single-device oracle's, the backward comparison's two
    #: legacy runs (a graph of its own, and another for the gradients' noise floor), the A/A run's (legacy a second
    #: time: the noise floor).
    slots: tuple[str, ...] = (SHADOW,)
    oracle: bool = False
    backward: bool = False
    aa: bool = False
    here: bool = False  # the shadow cannot block (Target.never_blocks): it runs on the caller's thread
    backward_skip: str = ""  # a backward comparison drawn but not planned: grad mode off, or no room (memory)
    rewind: Callable[[], Any] | None = None  # puts the call's consumed arguments back where the primary found them
    replay: Callable[[], tuple[tuple, dict]] | None = None  # the shadow run's arguments, once the primary ran
    #: The shadow side's hook registrations before this call's runs, where a backward comparison runs
    #: (:mod:`shadow.core.runs.hook_watch`).
    hooks_seen: int = 0
    modules_loaded: int = 0
    #: The process-wide settings this call's runs of the tool's wrote (:class:`~shadow.core.runs.global_state
    #: .Writes`): the only ones put back after them.
    written: set[str] = dataclasses.field(default_factory=set)

    def shadow_arguments(self) -> tuple[tuple, dict]:
        """What the shadow receives: the isolation's copies (once taken), or the arguments above."""
        return self.isolation.arguments(0) if self.isolation is not None else (self.args, self.kwargs)

    def stand_ins(self, slot: str) -> dict[int, torch.Tensor]:
        """The isolation's stand-ins of the call's tensors, in the run of ``slot``."""
        assert self.isolation is not None
        return self.isolation.stand_ins(self.slots.index(slot))

    @contextlib.contextmanager
    def in_slot(self, slot: str) -> Iterator[tuple[tuple, dict]]:
        """While the body runs, the isolation's world of the run of ``slot`` (its copies swapped in); it gets that
        run's arguments (the arguments as they are where the target is not isolated)."""
        if self.isolation is None:
            yield self.shadow_arguments()
            return
        index = self.slots.index(slot)
        with self.isolation.shadow_run(index):
            yield self.isolation.arguments(index)


def plan(context: CallContext, args: tuple, kwargs: dict, modules: list[torch.nn.Module], signature: str | None):
    """The plan of a sampled call of ``context``'s target, before the primary runs (``signature``: a guided
    target's call comes classified; None: classified here). Raises what taking it raised."""
    target, coins = context.target, context.coins
    autocast = autocast_state()
    before = TorchGlobals()
    plain = context.plain  # (the extra runs are for plain functions of tensors only)
    oracle = plain and coins.oracle is not None and ("=on/" in autocast or coins.oracle.flip())
    drawn = (
        plain
        and target.isolate
        and context.primary != UPSTREAM
        and coins.backward is not None
        and coins.backward.flip()
    )
    if signature is None:
        signature = context.classifier.admit(label_text(str(_raw_signature(context, args, kwargs)), 64))
    # (an A/A run on every sampled call of a signature until its burn-in fixed its noise thresholds: then at the rate)
    aa = plain and coins.aa is not None and (coins.aa.flip() or context.noise.burning(signature))
    backward_skip = ""
    if drawn and not torch.is_grad_enabled():
        backward_skip = "no_grad"
    elif drawn and context.graph_memory is not None and context.graph_memory.refuses(signature):
        backward_skip = "memory"  # (its two graphs would take more device memory than the shadow side may add)
    backward = drawn and not backward_skip
    # (with A/A runs on, the backward comparison runs legacy's backward twice: the gradients' own floor)
    backward_aa = backward and coins.aa is not None
    extra = (ORACLE,) * oracle + (BACKWARD,) * backward + (BACKWARD_AA,) * backward_aa + (AA,) * aa
    if target.isolate:
        isolation = Isolation(args, kwargs, modules, runs=1 + len(extra))
        shadow_args, shadow_kwargs = None, None
    elif target.reads_only:
        isolation, shadow_args, shadow_kwargs = None, args, kwargs
    else:
        isolation, (shadow_args, shadow_kwargs) = None, detach_tensors((args, kwargs))
    rewind = target.rewind(args, kwargs) if target.rewind is not None else None
    replay = target.replay(args, kwargs) if target.replay is not None else None
    # (a run that reads the caller's stream is never left running past a deadline: it would move the stream under
    # the job later; it runs on the caller's thread)
    here = rewind is not None or (target.never_blocks is not None and bool(target.never_blocks(args, kwargs)))
    return Plan(
        isolation, shadow_args, shadow_kwargs, signature, autocast, before, slots=(SHADOW, *extra),
        oracle=oracle, backward=backward, aa=aa, here=here, backward_skip=backward_skip,
        rewind=rewind, replay=replay, hooks_seen=hook_watch.registered() if backward else 0,
        modules_loaded=len(sys.modules),
    )  # fmt: skip


def _raw_signature(context: CallContext, args: tuple, kwargs: dict) -> Any:
    """A sampled call's signature by the target's function, checked (:meth:`Classifier.signature_of`): one that
    changed a generator or the grad mode, now or before, names the call "unclassified"."""
    if context.target.signature is None:
        return "call"
    if context.classifier.has_side_effects:
        return UNCLASSIFIED_SIGNATURE
    try:
        return context.classifier.signature_of(args, kwargs)
    except SideEffects:
        return UNCLASSIFIED_SIGNATURE
