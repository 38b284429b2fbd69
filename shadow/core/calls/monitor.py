"""``shadow.install()`` and the :class:`Monitor` it returns.

Every argument is checked before anything is patched, so a wrong configuration fails at start-up with
a message that names the setting and what it accepts, and never leaves half a monitor installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import multiprocessing.util
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from shadow.core.calls.canary.arms import IteratorArms
from shadow.core.calls.engine import Experiment, experiment_of
from shadow.core.calls.patch_calls import PatchCalls
from shadow.core.calls.record import exporting
from shadow.core.calls.record.record import Publisher
from shadow.core.calls.record.reporter import REPORTER
from shadow.core.calls.settings import Settings
from shadow.core.model import contract, live_targets
from shadow.core.model import targets as builtin
from shadow.core.model import tolerance as tol
from shadow.core.model.observation import ARM_TARGETS, UPSTREAM, TargetStats
from shadow.core.model.target import place_name
from shadow.core.model.targets import Target
from shadow.core.runs import hook_watch, sides
from shadow.core.support.rates import check_rate

log = logging.getLogger("shadow")


class _Notices:
    """Log messages said once per process (a job that installs many monitors says each once)."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def once(self, message: str, warn: bool = False) -> None:
        """Log ``message`` once per process; ``warn``: warn too (what a user would otherwise not notice)."""
        if message not in self._said:
            self._said.add(message)
            log.info(message)
            if warn:
                warnings.warn(message, RuntimeWarning, stacklevel=4)


_NOTICES = _Notices()


class Monitor:
    """The installed experiments (one per target). A context manager: leaving it uninstalls."""

    def __init__(
        self, experiments: Sequence[Experiment], yields: bool = False, publisher: Publisher | None = None
    ) -> None:
        self._experiments = list(experiments)
        #: The exporters, called through one publisher (the experiments').
        self.publisher = publisher if publisher is not None else Publisher()
        self._restore: list[tuple[Any, str, bool, Any]] = []
        #: The canary A/B of the DataLoader's iterator (:mod:`shadow.core.calls.canary.arms`), where one runs.
        self.arms: IteratorArms | None = None
        #: The canary A/B targets whose legacy is active here but that do not run (only a canary runs them).
        self.idle_canaries: tuple[str, ...] = ()
        #: Call counters at the places of a release's function patches (:mod:`shadow.core.calls.patch_calls`).
        self.patch_calls: PatchCalls | None = None
        #: A yielding monitor steps aside for a monitor installed later on the same target, and comes back
        #: when that one is uninstalled (the pytest plugin's session monitor yields to a test's own).
        self.yields = yields
        self._suspended: list[tuple[Monitor, Experiment]] = []  # yielding monitors' experiments this one displaced
        self._timed_at = time.monotonic()  # (the process time under this monitor, reported to the exporters)
        for s in self._experiments:
            s.monitor = self
        #: Whether this monitor watches hook registrations (a backward comparison is drawn for some target), and
        #: whether it has threads inherit the upstream run of the thread that starts them.
        self._watches_hooks = self._inherits = False
        # A forked multiprocessing child (a DataLoader worker) ends in os._exit: atexit never runs there, but
        # multiprocessing's finalizers do. Its calls since the last sampled one reach the exporters that way.
        multiprocessing.util.register_after_fork(self, Monitor._flush_at_child_exit)

    def _flush_at_child_exit(self) -> None:
        multiprocessing.util.Finalize(None, self.flush, exitpriority=100)

    @property
    def targets(self) -> tuple[str, ...]:
        """Names of the installed targets."""
        return tuple(s.target.name for s in self._experiments)

    def stats(self) -> dict[str, TargetStats]:
        """{target name: counts so far}."""
        return {s.target.name: s.stats() for s in self._experiments}

    def patch_counts(self) -> dict[str, int]:
        """{patch: the job's calls so far} of every counted function patch (``count_patches``)."""
        return self.patch_calls.counts() if self.patch_calls is not None else {}

    def patches_uncounted(self) -> dict[str, str]:
        """{patch: why its calls cannot be counted here} of the function patches reachable in this process whose
        calls are not counted (:mod:`shadow.core.calls.patch_calls`: a C function, a Python without
        sys.monitoring)."""
        return dict(self.patch_calls.uncounted) if self.patch_calls is not None else {}

    def roll_back(self, by: str) -> list[str]:
        """The rollback switch: every target whose primary is upstream (a canary) returns legacy's result from the
        next call on, upstream then compared as the shadow. ``by`` says who or what threw it (recorded by the
        exporters). Only toward legacy. Returns the targets that changed."""
        changed = [s.target.name for s in self._experiments if s.roll_back(by)]
        if changed:  # (one line for the process, not one per target: a canary of 5 processes printed 24)
            log.warning("npu-shadow: rolled back to legacy by %s: %s", by, ", ".join(changed))
        return changed

    def reset_primary(self, by: str) -> list[str]:
        """A person's reset of the rollback switch: each target's configured primary again. Returns those that
        changed."""
        return [s.target.name for s in self._experiments if s.reset_primary(by)]

    def legacy_origins(self) -> dict[str, str]:
        """{target name: where its legacy comes from} for the built-in legacies (see targets.patch_origin)."""
        origins = {s.target.name: builtin.patch_origin(s.legacy) for s in self._experiments}
        return {name: origin for name, origin in origins.items() if origin is not None}

    def experiment(self, name: str) -> Experiment:
        """The engine of one installed target."""
        for s in self._experiments:
            if s.target.name == name:
                return s
        raise KeyError(f"{name!r} is not installed; installed: {list(self.targets)}")

    def _patch(self) -> None:
        sides.install_inheritance()  # (threads an upstream run starts are part of it; put back at uninstall)
        sides.install_quiet_warnings()  # (the shadow side's warnings never reach the job)
        self._inherits = True
        if any(s.coins.backward is not None for s in self._experiments):
            hook_watch.install()
            self._watches_hooks = True
        for s in self._experiments:
            owner, attribute = s.target.owner, s.target.attribute
            had_own = attribute in vars(owner)
            raw = vars(owner)[attribute] if had_own else None
            self._restore.append((s, had_own, raw))
            setattr(owner, attribute, staticmethod(s.wrapper) if isinstance(raw, staticmethod) else s.wrapper)

    def _entry(self, experiment: Experiment) -> tuple[bool, Any]:
        for s, had_own, raw in self._restore:
            if s is experiment:
                return had_own, raw
        raise KeyError(experiment.target.name)

    def suspend(self, experiment: Experiment) -> None:
        """Put back what ``experiment``'s wrapper replaced, for another monitor to wrap (yielding monitors)."""
        had_own, raw = self._entry(experiment)
        owner, attribute = experiment.target.owner, experiment.target.attribute
        if had_own:
            setattr(owner, attribute, raw)
        else:
            delattr(owner, attribute)

    def resume(self, experiment: Experiment) -> None:
        """Install ``experiment``'s wrapper again after :meth:`suspend`, if nothing else took its place since."""
        had_own, raw = self._entry(experiment)
        owner, attribute = experiment.target.owner, experiment.target.attribute
        if vars(owner).get(attribute) is (raw if had_own else None):
            setattr(
                owner,
                attribute,
                staticmethod(experiment.wrapper) if isinstance(raw, staticmethod) else experiment.wrapper,
            )

    def replaced(self) -> list[str]:
        """Targets whose wrapper something else replaced since install (torch_npu imported late, say)."""
        return [
            s.target.name
            for s, _, _ in self._restore
            if experiment_of(vars(s.target.owner).get(s.target.attribute)) is not s
        ]

    def flush(self) -> None:
        """Report calls not yet reported to the exporters (done at every sampled call, and here), and the value
        differences the noise floor never could judge (as skips), then let each exporter write out what it buffers
        (the journal's count records)."""
        for s in self._experiments:
            s.release_pending()  # (value differences the noise floor never could judge: skips now)
            s.report_calls(flush=True)
        self._report_time()
        self._report_patch_calls()
        self.publisher.deliver()
        self.publisher.each("flush")

    def report(self) -> None:
        """Report the calls counted since the last report, and the time passed, to the exporters
        (:mod:`shadow.core.calls.record.reporter` does, each second)."""
        if self._restore or self.patch_calls is not None:
            for s in self._experiments:
                s.record.finish_deferred()  # (the comparisons the device finished since: published now)
                s.report_calls(flush=True)  # (a guided target's open gate too: the total is the job's calls)
            self._report_time()
            self._report_patch_calls()
        self.publisher.deliver()

    def deliver(self) -> None:
        """Hand what waits for the exporters to them now (each second, the reporter does): the pytest plugin does
        at the end of each test's phase, so that its exporters see the phase's records before the next one."""
        self.publisher.deliver()

    def _report_patch_calls(self) -> None:
        for patch, calls in (self.patch_calls.since_reported() if self.patch_calls is not None else {}).items():
            self.publisher.record(contract.patch_call_samples(patch, calls))

    def _report_time(self) -> None:
        now = time.monotonic()
        seconds, self._timed_at = now - self._timed_at, now
        self.publisher.record(contract.time_samples(seconds))

    def uninstall(self) -> None:
        """Flush, then put back exactly the objects that were there before install (safe to call twice)."""
        REPORTER.discard(self)
        if self.arms is not None:
            self.arms.uninstall()
            self.arms = None
        if self._restore or self.patch_calls is not None:
            self.flush()
        if self.patch_calls is not None:  # (outside the targets' wrappers: taken off first)
            self.patch_calls.uninstall()
            self.patch_calls = None
        while self._restore:
            s, had_own, raw = self._restore.pop()
            s.sampling.detach()
            owner, attribute = s.target.owner, s.target.attribute
            if experiment_of(vars(owner).get(attribute)) is not s:
                # Something patched over the wrapper after install: putting the old object back would
                # undo that patch too, so leave it.
                log.warning("npu-shadow: %s was replaced while shadowed; leaving the new object", s.target.where)
            elif had_own:
                setattr(owner, attribute, raw)
            else:
                delattr(owner, attribute)
        while self._suspended:
            monitor, experiment = self._suspended.pop()
            monitor.resume(experiment)
        if self._watches_hooks:
            self._watches_hooks = False
            hook_watch.uninstall()
        if self._inherits:
            self._inherits = False
            sides.uninstall_inheritance()
            sides.uninstall_quiet_warnings()

    @property
    def installed(self) -> bool:
        return bool(self._restore)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"<shadow.Monitor targets={list(self.targets)} installed={self.installed}>"


def _builtin(name: str, settings: Settings) -> Target:
    """A built-in target, made with the settings it reads (``torch_load``, ``torch_save``: whether checkpoints are
    trusted)."""
    if name in ("torch_load", "torch_save"):
        return getattr(live_targets, name)(trusted=settings.trusted_checkpoints)
    return builtin.BUILTINS[name]()


def _resolve_targets(targets: Iterable[str | Target] | None, settings: Settings) -> list[Target]:
    if targets is None:
        active = builtin.active_builtins()
        if not active:
            looked_for = ", ".join(place_name(owner(), attribute) for owner, attribute in builtin.PLACES.values())
            _NOTICES.once(
                "npu-shadow: no torch_npu patch is active in this process, so nothing is shadowed and "
                f"stats() stays empty (looked for torch_npu's patch on {looked_for}; import torch_npu first, or "
                "rehearse with shadow.npu.torch_npu_source.load(WHEEL).patch_torch())",
                warn=True,
            )
        for name, origin in active.items():
            if origin == "reference":
                log.info("npu-shadow: %s shadows shadow.npu.reference's legacy (a rehearsal, not torch_npu)", name)
        return [_builtin(name, settings) for name in active]
    if isinstance(targets, (str, Target)):
        targets = [targets]
    resolved = []
    for item in targets:
        if isinstance(item, Target):
            resolved.append(item)
        elif item in ARM_TARGETS:
            continue  # (a canary A/B of its own: see _arms)
        elif isinstance(item, str) and item in builtin.BUILTINS:
            resolved.append(_builtin(item, settings))
        else:
            raise ValueError(
                f"targets: unknown target {item!r}; allowed: built-in names {sorted(builtin.BUILTINS)} "
                "or shadow.Target objects"
            )
    return resolved


def _per_target(setting: str, value: Any, names: list[str], is_table: bool) -> dict[str, Any]:
    """Spread a value or a {target name: value} table over the targets, rejecting unknown names."""
    if not is_table:
        return dict.fromkeys(names, value)
    # A table may name built-in targets that are not installed: their legacy patch may arrive later.
    unknown = sorted(str(name) for name in set(value) - set(names) - set(builtin.BUILTINS) - set(ARM_TARGETS))
    if unknown:
        raise ValueError(f"{setting}: unknown target(s) {unknown}; installed targets are {names}")
    return {name: value.get(name) for name in names}


def install(
    targets: Iterable[str | Target] | None = None,
    sample_rate: float | Mapping[str, float] = 0.01,
    tolerance: tol.ToleranceSpec | Mapping[str, tol.ToleranceSpec] = None,
    exporters: Sequence[Any] = (),
    *,
    yields: bool = False,
    settings: Settings | None = None,
    **options: Any,
) -> Monitor:
    """Shadow the given targets (by default every built-in whose legacy patch is active).

    Args:
        targets: names of built-in targets and :class:`Target` s.
        sample_rate: the fraction of calls shadowed, one float or {target name: float} (absent names: 0.01).
        tolerance: one Tolerance, a {torch.dtype: Tolerance} table, or {target name: either}.
        exporters: objects with ``export`` or ``record`` (:class:`shadow.core.calls.record.exporting.Exporter`).
        yields: this monitor steps aside while a later monitor shadows the same target (instead of that one
            raising "already shadowed").
        settings: the monitor's :class:`~shadow.core.calls.settings.Settings`, whole (the launcher's).
        **options: else, any of its fields by name (``seed``, ``budget``, ``deadline``, ``aa_rate``, ...).

    Returns:
        The installed :class:`Monitor` (a context manager: leaving it uninstalls).

    Raises:
        ValueError: on any bad argument, naming it, before anything is patched.
    """
    _warn_if_torch_npu_comes_later()
    settings = _settings(settings, options)
    resolved = _resolve_targets(targets, settings)
    _check_places(resolved)
    # Every value is checked whichever targets resolve (none may be active yet).
    names = [t.name for t in resolved]
    rates = _sample_rates(sample_rate, names)
    tolerances = _tolerances(tolerance, names)
    exporters = tuple(exporters)
    for exporter in exporters:
        exporting.check(exporter, "exporters")

    suspended = _step_aside(resolved)  # before the experiments read what is installed as their legacy
    publisher, budgets = Publisher(exporters), settings.budgets()  # (one of each for every target)
    experiments = [Experiment(t, rates[t.name], tolerances[t.name], publisher, settings, budgets) for t in resolved]
    monitor = Monitor(experiments, yields=yields, publisher=publisher)
    monitor._suspended = suspended
    try:
        monitor._patch()
        monitor.arms = _arms(targets, settings.primary, publisher, settings.seed)
        monitor.idle_canaries = _idle_canaries(targets, settings.primary)
        monitor.patch_calls = _patch_counters(settings.count_patches)
    except Exception:
        monitor.uninstall()
        raise
    if settings.drill is not None:
        publisher.record(contract.drill_samples(True))
    publisher.deliver()  # (the targets on the exporters, at zero, from the start)
    if exporters:
        REPORTER.add(monitor)  # (the calls between sampled ones reach the exporters within a second)
    log.debug("npu-shadow installed %s with torch %s", monitor.targets, torch.__version__)
    return monitor


def _patch_counters(names: tuple[str, ...]) -> PatchCalls | None:
    """Call counters at the places of ``names``, installed (after the targets' wrappers: a shadowed place's call
    counts once), or None where none is asked for."""
    if not names:
        return None
    counters = PatchCalls(names)
    counters.install()
    return counters


def _settings(settings: Settings | None, options: dict[str, Any]) -> Settings:
    """``settings``, or those made of ``options`` (by field name), checked."""
    if settings is None:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Settings)})
        if unknown:
            raise TypeError(f"install() got unexpected keyword argument(s) {unknown}")
        return Settings(**options)
    if options:
        raise TypeError(f"install(): give settings= or {sorted(options)}, not both")
    return settings


def _arms(targets: Any, primary: str, publisher: Publisher, seed: int | None) -> IteratorArms | None:
    """The DataLoader iterator's canary A/B, installed where the job is a canary (upstream is the primary), legacy's
    patch of the iterator's ``__init__`` is active, its upstream is known, and the targets (if named) include it."""
    name = ARM_TARGETS[0]
    if primary != UPSTREAM or (targets is not None and name not in _names(targets)):
        return None
    from torch.utils.data import dataloader

    legacy = vars(dataloader._MultiProcessingDataLoaderIter).get("__init__")
    upstream = live_targets.upstream(name)
    if builtin.patch_origin(legacy) is None or upstream is None or upstream is legacy:
        return None
    try:
        arms = IteratorArms(legacy, upstream, publisher, seed)
        arms.install()
    except Exception as exc:  # (a host without CPU affinity calls, say: the A/B is ours to give up, never the job's)
        log.warning("npu-shadow: the DataLoader iterator's A/B could not start (%r); iterators stay legacy's", exc)
        return None
    return arms


def _idle_canaries(targets: Any, primary: str) -> tuple[str, ...]:
    """The canary A/B targets whose legacy patch is active in this process but that do not run, since they run
    only where upstream is the primary (``--primary upstream``): what the exit summary says of them."""
    name = ARM_TARGETS[0]
    if primary == UPSTREAM or (targets is not None and name not in _names(targets)):
        return ()
    from torch.utils.data import dataloader

    legacy = vars(dataloader._MultiProcessingDataLoaderIter).get("__init__")
    return (name,) if builtin.patch_origin(legacy) is not None else ()


def _names(targets: Any) -> set[str]:
    items = [targets] if isinstance(targets, (str, Target)) else list(targets)
    return {item if isinstance(item, str) else item.name for item in items}


def _warn_if_torch_npu_comes_later() -> None:
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
        warnings.warn(
            "npu-shadow: torch_npu is installed but not imported yet; import it before shadow.install(), "
            "or its patches will replace the wrappers (npu-shadow run handles this by itself)",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_places(resolved: list[Target]) -> None:
    """Each target once, each attribute wrapped by one target, none already shadowed by a monitor that does not
    yield, no classmethod."""
    names = [t.name for t in resolved]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"targets: {duplicates} given more than once")
    places = [(id(t.owner), t.attribute) for t in resolved]
    for target in resolved:
        if places.count((id(target.owner), target.attribute)) > 1:
            raise ValueError(f"targets: more than one target wraps {target.where}")
        existing = experiment_of(getattr(target.owner, target.attribute, None))
        if existing is not None and not getattr(getattr(existing, "monitor", None), "yields", False):
            raise ValueError(
                f"{target.where} is already shadowed (target {existing.target.name!r}); uninstall that monitor first"
            )
        if target.legacy is None and isinstance(vars(target.owner).get(target.attribute), classmethod):
            raise ValueError(f"{target.where}: classmethods cannot be shadowed")


def _sample_rates(sample_rate: float | Mapping[str, float], names: list[str]) -> dict[str, float]:
    """The sample rate of each target, from one rate or a {target name: rate} table (absent names: 0.01)."""
    rate_table = isinstance(sample_rate, Mapping)
    if rate_table:
        for name, rate in sample_rate.items():
            check_rate(rate, f"sample_rate[{name!r}]")
    else:
        check_rate(sample_rate, "sample_rate")
    rates = _per_target("sample_rate", sample_rate, names, rate_table)
    return {name: 0.01 if rate is None else float(rate) for name, rate in rates.items()}


def _tolerances(tolerance: Any, names: list[str]) -> dict[str, tol.ToleranceSpec]:
    """The tolerance of each target, from one spec or a {target name: spec} table."""
    tolerance_table = isinstance(tolerance, Mapping) and bool(tolerance) and all(isinstance(k, str) for k in tolerance)
    if isinstance(tolerance, Mapping) and not tolerance_table and any(isinstance(k, str) for k in tolerance):
        raise ValueError("tolerance: a table is keyed either by target names or by torch.dtype, not both")
    if tolerance_table:
        for name, spec in tolerance.items():
            tol.validate(spec, f"tolerance[{name!r}]")
    else:
        tol.validate(tolerance, "tolerance")
    return _per_target("tolerance", tolerance, names, tolerance_table)


def _step_aside(resolved: list[Target]) -> list[tuple[Monitor, Experiment]]:
    """Suspend the yielding monitors' experiments on these targets (checked before); returns them, to resume."""
    suspended = []
    for target in resolved:
        existing = experiment_of(getattr(target.owner, target.attribute, None))
        if existing is not None:
            existing.monitor.suspend(existing)
            suspended.append((existing.monitor, existing))
    return suspended
