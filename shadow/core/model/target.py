"""The ``Target`` description: what a patch pair is, and how its calls are run twice and compared."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from shadow.core.model.observation import label_text
from shadow.core.model.oracle import SingleDeviceCall
from shadow.core.model.tolerance import ToleranceSpec

Signature = Callable[[tuple, dict], str]


class CannotReplay(Exception):
    """A target's ``replay`` cannot give the shadow run the call's input again: the call is skipped (reason
    ``ineligible``, this text its detail)."""


class CannotCompare(Exception):
    """A target's ``compare`` cannot tell how two results relate (two checkpoints that cannot be loaded back): the call
    is skipped (reason ``ineligible``, this text its detail), neither agreement nor a divergence."""


@dataclasses.dataclass(frozen=True)
class Alike:
    """What a target's ``compare`` returns for two results that hold the same content but differ in form (two
    checkpoints that load back to the same tensors, written in a different byte layout): a ``close``, ``note`` its
    detail."""

    note: str


def place_name(owner: Any, attribute: str) -> str:
    """``module.Class.attribute`` (or ``module.attribute``) of an attribute of a class or module, for messages."""
    name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
    module = getattr(owner, "__module__", None)
    prefix = f"{module}.{name}" if module and module != name else name
    return f"{prefix}.{attribute}"


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A patch pair: ``owner.attribute`` (legacy) shadowed by ``upstream``.

    ``upstream`` takes the same arguments as the wrapped attribute. ``legacy=None`` means whatever is
    installed on ``owner.attribute`` at install time. ``exact`` demands bitwise equal results.
    ``isolate``: give the upstream run its own RNG state, module buffers and input clones (needed
    whenever a module or RNG is involved; only pure functions should turn it off).
    ``signature`` classifies a call into a small fixed set of code paths; ``risky_signatures`` are
    ``fnmatch`` patterns of the paths where legacy and upstream differ, which a verdict should see.
    ``oracle`` describes a call's single-device equivalent (:mod:`shadow.core.model.oracle`), to find what legacy and
    upstream share but a single device would not do. ``never_blocks`` tells the calls whose upstream run cannot
    block or wait (no device work, no lock, no Python code: a query of a tensor's metadata in torch's C code): their
    upstream runs on the caller's thread, without the deadline's thread (:mod:`shadow.core.runs.deadline`), whose
    hand-off costs more than such a call's whole shadow side. ``signature_key`` (with ``signature``) is a cheap
    key of a call, hashable, read without running user code (no tensor attribute a mode would see), that stands for
    its signature or for several that are never risky, or None where it cannot be had cheaply: once a key's
    signature has had its first comparisons, calls with that key take the unguided wrapper's unsampled path (their
    signatures counted by systematic sampling), and every other call is classified, so a signature whose key is new
    is compared on its first calls whenever it first appears, however rare (:mod:`shadow.core.calls.gate.coverage`).
    Without
    one, calls are classified one in ``CLASSIFY_ONE_IN`` once every signature seen has had its first comparisons.
    A signature function is checked on its first 64 calls and one in 256 after to leave the random generators and
    the grad mode as it found them; ``signature_pure=True`` declares one that cannot (the built-ins'): it is never
    checked, since in a job whose other threads draw random numbers meanwhile (DataParallel's replicas) the check
    could take their draws for the function's and put the generators back.

    What calls that are not plain functions of tensors need (each makes the target's calls skip the extra runs:
    the A/A run, the oracle, the backward comparison and the float64 truth):

    ``run_if(args, kwargs)``: None when the call can be run twice, else why not (the call is then skipped, reason
    ``ineligible``, the text in its detail); it may raise ``shadow.core.support.memory.InsufficientMemory`` (reason
    ``oom``).
    Example: ``run_if=lambda a, k: None if a[0].seekable() else "a stream that cannot seek back"``.

    ``rewind(args, kwargs)``: for arguments a call consumes (a file read to its end), a function that puts them
    back where they are now. Taken before the primary runs; the shadow run starts from there, and the arguments are left
    where legacy left them. Example: ``rewind=lambda a, k: functools.partial(a[0].seek, a[0].tell())``.

    ``replay(args, kwargs)``: for a call whose input must be read only once (a checkpoint: the file at a path may be
    replaced between two reads, and unpickling it twice would run its code twice), taken before the primary runs: a
    function that, once the primary ran, returns the shadow run's arguments (the bytes the primary read, in a
    buffer of the shadow run's own), or raises :class:`CannotReplay` (reason ``ineligible``) or ``InsufficientMemory``
    (reason ``oom``); None where the call's own arguments serve. The caller's arguments are left as the primary left
    them. Example: :func:`shadow.core.model.checkpoint.replay`.

    ``snapshot(result, args, kwargs)``: for methods that change their receiver in place, what is compared of a run,
    taken right after it: legacy runs on the caller's object as always, the shadow run on the isolation's stand-ins
    for its tensors (its state before the call), and the two states are compared. Example, ``Module.to``:
    ``snapshot=lambda result, a, k: dict(a[0].state_dict(keep_vars=True))``.

    ``compare(legacy, upstream)``: a custom equality for results the comparator cannot read (storages, modules):
    None when they agree, else a short text saying how they differ (a ``mismatch``, reason ``custom``), or an
    :class:`Alike` where they agree in content but not in form (a ``close``); it raises :class:`CannotCompare` where it
    cannot tell (the call is skipped).
    Example: ``compare=lambda a, b: None if a.nbytes() == b.nbytes() else "sizes differ"``.

    ``clean(result)``: what of a result the evidence (journal, capture) keeps, e.g. the tensors of a loaded
    checkpoint without the rest of it.

    ``environmental(error)``: for a call whose shadow run does not meet the caller's environment (a save into a buffer
    of its own), why an exception the primary raised is the environment's (a full disk), not the implementation's:
    the call is then skipped (reason ``ineligible``, this text its detail), never compared. None: the implementation's.

    ``reads_only``: the call only reads its arguments (builds no autograd graph, writes nothing): the shadow run
    gets the caller's tensors as they are, where it would get new leaves over them (a repr prints ``grad_fn``; a
    new leaf has none).

    ``reaches(args, kwargs)``: the arguments a second run could reach the job's code through (modules with hooks,
    tensor subclasses), where that is fewer than all of them: ``copy.deepcopy``'s memo holds every object copied so
    far, half-built ones among them, and a storage's copy reads it by key only, so ``storage_deepcopy`` gives
    ``args[:1]``.
    """

    name: str
    owner: Any
    attribute: str
    upstream: Callable
    legacy: Callable | None = None
    tolerance: ToleranceSpec = None
    exact: bool = False
    isolate: bool = True
    signature: Signature | None = None
    risky_signatures: tuple[str, ...] = ()
    oracle: Callable[[tuple, dict], SingleDeviceCall | None] | None = None
    never_blocks: Callable[[tuple, dict], bool] | None = None
    signature_key: Callable[[tuple, dict], Any] | None = None
    signature_pure: bool = False
    run_if: Callable[[tuple, dict], str | None] | None = None
    rewind: Callable[[tuple, dict], Callable[[], Any] | None] | None = None
    replay: Callable[[tuple, dict], Callable[[], tuple[tuple, dict]] | None] | None = None
    snapshot: Callable[[Any, tuple, dict], Any] | None = None
    compare: Callable[[Any, Any], str | Alike | None] | None = None
    clean: Callable[[Any], Any] | None = None
    reaches: Callable[[tuple, dict], tuple] | None = None
    environmental: Callable[[BaseException], str | None] | None = None
    reads_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or label_text(self.name, 200) != self.name:
            raise ValueError(f"Target.name must be a non-empty string without control characters, got {self.name!r}")
        if not callable(self.upstream):
            raise ValueError(f"Target {self.name!r}: upstream must be callable, got {self.upstream!r}")
        if not isinstance(self.signature_pure, bool):
            raise ValueError(f"Target {self.name!r}: signature_pure must be True or False, got {self.signature_pure!r}")
        for field in (
            "legacy",
            "never_blocks",
            "run_if",
            "rewind",
            "replay",
            "snapshot",
            "compare",
            "clean",
            "reaches",
            "environmental",
        ):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise ValueError(f"Target {self.name!r}: {field} must be callable or None, got {value!r}")
        if self.signature_key is not None and (not callable(self.signature_key) or self.signature is None):
            raise ValueError(
                f"Target {self.name!r}: signature_key must be callable and come with a signature function, got "
                f"{self.signature_key!r}"
            )
        if not hasattr(self.owner, self.attribute) and self.legacy is None:
            raise ValueError(f"Target {self.name!r}: {self.owner!r} has no attribute {self.attribute!r}")

    @property
    def plain(self) -> bool:
        """Whether the calls are plain functions of their tensors (no run_if, rewind, replay, snapshot or compare):
        the extra runs (A/A, oracle, backward, truth) are made for such targets only."""
        hooks = (self.run_if, self.rewind, self.replay, self.snapshot, self.compare)
        return all(hook is None for hook in hooks)

    @property
    def where(self) -> str:
        """``module.Class.attribute`` for messages."""
        return place_name(self.owner, self.attribute)

    def resolve_legacy(self) -> Callable:
        """The legacy callable: the one given, or what is installed on owner.attribute now."""
        return self.legacy if self.legacy is not None else getattr(self.owner, self.attribute)
