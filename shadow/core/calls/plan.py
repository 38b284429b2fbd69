"""What a sampled call's shadow side works from: its :class:`Plan` (taken before legacy runs), the :class:`Run` of
each side, the named isolation slots of its runs, what each kind of failure becomes (:data:`GUARDS`), what it reads
of its experiment, and the one way a run is made within the deadline."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from shadow.core.calls.classifier import Classifier
from shadow.core.calls.coin import Coin
from shadow.core.calls.record import Record
from shadow.core.judging.noise import NoiseFloor
from shadow.core.model.targets import Target
from shadow.core.model.tolerance import ToleranceSpec
from shadow.core.runs import hook_watch
from shadow.core.runs.deadline import Finished, leave_worker, run_within, worker
from shadow.core.runs.global_state import TorchGlobals
from shadow.core.runs.isolation import Isolation
from shadow.core.runs.sides import current_run, marks

_PLAIN_TORCH_FUNCTION = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def is_hooked_subclass(leaf: Any) -> bool:
    """A tensor subclass with its own __torch_function__ or __torch_dispatch__ (nn.Parameter has neither)."""
    cls = type(leaf)
    if cls is torch.Tensor or not isinstance(leaf, torch.Tensor):
        return False
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    return function not in _PLAIN_TORCH_FUNCTION or cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


class IsolationFailed(RuntimeError):
    """Setting up or undoing the shadow run's isolation, or taking its snapshot, failed: this tool's (or the
    target's) fault, the call skipped as "comparator" (never compared as the shadow side's exception)."""


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
    """What the upstream side of one sampled call needs, taken before legacy runs: the isolation (None for
    targets that are not isolated; it copies the arguments after legacy), the arguments of a target that is not
    isolated (the caller's own, with new leaves for those that require grad), the call's signature, the autocast
    state and torch settings legacy starts from, and whether the single-device oracle runs too."""

    isolation: Isolation | None
    args: tuple | None
    kwargs: dict | None
    signature: str
    autocast: str
    before: TorchGlobals
    #: The runs that join the shadow run, each in an isolated slot of its own (where the target is isolated), by
    #: name: the single-device oracle's, the backward comparison's legacy run (for a graph of its own), the A/A run
    #: (legacy a second time: the noise floor).
    extra: tuple[str, ...] = ()
    here: bool = False  # upstream cannot block (Target.never_blocks): it runs on the caller's thread
    backward_skip: str = ""  # a backward comparison drawn for a call that can have none (grad mode off)
    rewind: Callable[[], Any] | None = None  # puts the call's consumed arguments back where legacy found them
    replay: Callable[[], tuple[tuple, dict]] | None = None  # the shadow run's arguments, once the primary ran
    #: The shadow side's hook registrations before this call's runs (:mod:`shadow.core.runs.hook_watch`).
    hooks_seen: int = dataclasses.field(default_factory=hook_watch.registered)
    modules_loaded: int = dataclasses.field(default_factory=lambda: len(sys.modules))

    @property
    def slots(self) -> tuple[str, ...]:
        """The isolated runs after legacy, in the isolation's order: the shadow run's, then the extra ones."""
        return (SHADOW, *self.extra)

    oracle = property(lambda self: ORACLE in self.extra, doc="Whether the single-device oracle runs.")
    backward = property(lambda self: BACKWARD in self.extra, doc="Whether the backward comparison runs.")
    aa = property(lambda self: AA in self.extra, doc="Whether the A/A run runs.")

    def upstream_arguments(self) -> tuple[tuple, dict]:
        """What upstream receives: the isolation's copies (once taken), or the arguments above."""
        return self.isolation.arguments(0) if self.isolation is not None else (self.args, self.kwargs)

    def stand_ins(self, slot: str) -> dict[int, torch.Tensor]:
        """The isolation's stand-ins of the tensors that require grad, in the run of ``slot``."""
        assert self.isolation is not None
        return self.isolation.stand_ins(self.slots.index(slot))

    @contextlib.contextmanager
    def in_slot(self, slot: str) -> Iterator[tuple[tuple, dict]]:
        """While the body runs, the isolation's world of the run of ``slot`` (its copies swapped in); it gets that
        run's arguments (the arguments as they are where the target is not isolated)."""
        if self.isolation is None:
            yield self.upstream_arguments()
            return
        index = self.slots.index(slot)
        with self.isolation.shadow_run(index):
            yield self.isolation.arguments(index)


#: The isolated runs of a sampled call, by name (:attr:`Plan.slots`).
SHADOW, ORACLE, BACKWARD, AA = "shadow", "oracle", "backward", "aa"

#: What a failure in each part of a sampled call's shadow side becomes: the monitor's failures are never a side's
#: outcome. The plan, the isolation and a target's snapshot: the call is skipped as "comparator" (counted; see
#: :class:`IsolationFailed`). An extra run's (the A/A run, the oracle, the backward comparison, the truth run):
#: its finding alone is lost, said in the log (at most once a minute) with the message below.
GUARDS: dict[str, str] = {
    "plan": "skip: comparator",
    "isolation": "skip: comparator",
    AA: "A/A run failed: %r",
    ORACLE: "single-device oracle failed: %r",
    BACKWARD: "backward comparison failed: %r",
    "truth": "float64 truth run failed: %r",
}


class Experiment(Protocol):
    """What the worker reads of the experiment that made it (:class:`shadow.core.calls.engine.Experiment`)."""

    target: Target
    tolerance: ToleranceSpec
    legacy: Callable
    legacy_origin: str
    shadow_fn: Callable
    primary: str
    drill: Any
    deadline: float | None
    oracle_coin: Coin | None
    aa_coin: Coin
    backward_coin: Coin
    truth_coin: Coin
    noise: NoiseFloor
    classifier: Classifier
    record: Record

    def deadline_missed(self) -> None: ...


def within_deadline(
    experiment: Experiment,
    side: object,
    before: TorchGlobals,
    body: Callable[[], Any],
    checks_its_settings: bool = False,
) -> Finished:
    """``body()`` (a run of the shadow side, as ``side``'s upstream side, from the settings ``before``, which
    this thread has written already): on a daemon thread of the shadow side's, waited for at most the deadline
    (:mod:`shadow.core.runs.deadline`; without one, until it ends). Past the deadline the run is abandoned and the
    target stops shadowing (:meth:`Experiment.deadline_missed`). An interrupt the body raised is raised here, as
    it would be on the caller's thread. A run that leaves a setting of its thread changed ends its worker (the
    body says so itself where ``checks_its_settings``)."""
    run = current_run()

    def start() -> None:
        marks.shadow_side, marks.run = side, run
        # (a worker whose run changed a setting ends with it: a worker kept holds what its last run started from)
        known = getattr(worker, "settings", None)
        if known is not None and known.same_as(before):
            return
        if experiment.record.put_back(before):  # (on the worker: its thread-local settings the caller's)
            worker.settings = before
        else:
            leave_worker()

    def checked() -> Any:
        try:
            return body()
        finally:
            if not TorchGlobals().same_as(before):
                leave_worker()

    found = run_within(experiment.deadline, body if checks_its_settings else checked, start=start)
    if isinstance(found.error, KeyboardInterrupt):
        raise found.error
    if not found.finished:
        experiment.deadline_missed()
    return found
