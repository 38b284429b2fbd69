"""Installing the monitor in processes we did not write: from environment variables, when torch arrives.

``npu-shadow run`` puts ``shadow/launcher/bootstrap`` (a ``sitecustomize``) on PYTHONPATH, so every Python process
the job starts (torchrun ranks, spawned DataLoader workers) arms the monitor at interpreter start. That
costs nothing in processes that never import torch: it installs :func:`install_from_env` to run
right after ``import torch`` has finished (torch_npu, when autoloaded by ``import torch``, has patched by
then), and again after a later ``import torch_npu`` (or ``shadow.npu.reference.patch_torch()``), which patch
over the wrappers: the monitor is then installed anew over the new legacy, never twice, never lost.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from shadow.core.calls.record.exporting import call_hook
from shadow.core.model.observation import DIFFERS_IN_FLOAT64, SKIP_REASON_MEANING
from shadow.core.model.run_ids import run_id
from shadow.core.support import forks
from shadow.npu.patching import LEGACY_PATCHED

log = logging.getLogger("shadow")

#: A push at exit waits at most this long for the Pushgateway: a slow or silent one never holds the job up longer.
PUSH_TIMEOUT_SECONDS = 3.0


def _is_job_process() -> bool:
    """False in multiprocessing children (DataLoader workers): they neither serve nor print summaries.

    A spawned child imports torch while it prepares (re-importing the main module), before
    ``parent_process()`` is set, but after it has taken its process name.
    """
    return multiprocessing.parent_process() is None and multiprocessing.current_process().name == "MainProcess"


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "0")
    return int(value) if value.isdigit() else 0


def wants_prometheus(config: Any) -> bool:
    return bool(config.port is not None or config.multiproc_dir or config.pushgateway or config.textfile)


#: What each exporter needs beyond the standard library, by the setting that asks for it.
EXPORTER_PACKAGES = {"otel": "opentelemetry", "prometheus": "prometheus_client"}


def missing_packages(config: Any) -> dict[str, str]:
    """{setting: package} for every configured exporter whose package cannot be imported here (found without
    importing it: the launcher refuses the job before it runs)."""
    wanted = {"otel": bool(config.otel), "prometheus": wants_prometheus(config)}
    missing = {}
    for setting, package in EXPORTER_PACKAGES.items():
        if wanted[setting]:
            try:
                found = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                missing[setting] = package
    return missing


def _exporters(config: Any) -> list[Any]:
    """The exporters ``config`` asks for, each imported only when asked for (an optional package that is not
    installed costs nothing to a job that does not use it)."""
    made: list[Any] = []
    if wants_prometheus(config):
        from exporters.prometheus import PrometheusExporter

        port = None
        if config.port is not None and not config.multiproc_dir and _is_job_process():
            port = config.port + _local_rank() if config.port else 0
        made.append(PrometheusExporter(port=port, addr=config.addr))
    if config.otel:
        from exporters.otel import OTelExporter

        made.append(OTelExporter())
    if config.journal:
        from exporters.journal import JsonlExporter

        made.append(JsonlExporter(config.journal, all_outcomes=config.journal_all, capture_dir=config.capture_dir))
    return made


class Launcher:
    """The monitor this process runs under ``npu-shadow run`` (or :func:`install_from_env`), with its settings and
    exporters: installed from the environment, moved over new legacy patches, flushed at exit."""

    def __init__(self) -> None:
        self.monitor: Any = None
        self.exporters: list[Any] = []
        self.config: Any = None
        self.legacy: Any = _NOT_LOADED
        self._emulation_refused = False
        self._refused_patches: set[str] = set()
        self._exited = False
        self._at_exit_registered = False
        self._lock = threading.RLock()
        #: Outputs at exit (a push, a textfile) that failed, by what they were: each said once on stderr.
        self.output_failures: dict[str, int] = {}
        #: The rollback switch (a file, a loopback endpoint) of a canary job, and who threw it; the page that
        #: carries a rollback to the processes forked before it (shadow.launcher.switch.SharedRollback).
        self.switch: Any = None
        self.shared_rollback: Any = None
        self.rolled_back_by: str | None = None
        #: The counts of the monitors installed before this one (each time new legacy patches came), by target.
        self._earlier: dict[str, Any] = {}
        #: The calls of the release's function patches those monitors counted; the release and its patch count.
        self._earlier_patches: dict[str, int] = {}
        self.release, self.release_patches = "", 0

    def install(self, environ: Mapping[str, str] | None = None) -> Any:
        """Install (or re-install) the monitor described by the NPU_SHADOW_* variables of ``environ`` (when given)
        or of the settings read before (else ``os.environ``). Returns the Monitor.

        Raises :class:`shadow.launcher.config.ConfigError` on a bad variable.
        """
        from shadow.core.calls.monitor import install
        from shadow.core.model.tolerance import Tolerance
        from shadow.launcher import config as config_module

        with self._lock:
            config = self.config
            if environ is not None or config is None:
                config = config_module.from_sources(os.environ if environ is None else environ)
            if self.monitor is not None:
                for patch, calls in self.monitor.patch_counts().items():  # (read while its counters are on)
                    self._earlier_patches[patch] = self._earlier_patches.get(patch, 0) + calls
                self.monitor.uninstall()  # its last counts go to the exporters it had
                self._earlier = _then(self._earlier, self.monitor.stats())  # (the summary counts every install)
            if self.config is not None and config != self.config:
                self._close_exporters()
            self.config = config
            if config.emulate_npu:
                self._emulate_npu(config.emulate_npu, config.emulated_device)
            if config.legacy_from:
                self._legacy_from(config.legacy_from)
            if not self.exporters:
                self.exporters = _exporters(config)
            self._find_rollback(config)
            tolerance = Tolerance(config.rtol, config.atol) if config.rtol is not None else None
            settings = config.monitor_settings(rolled_back=bool(self.rolled_back_by))
            patches, self.release, self.release_patches = _patch_list(os.environ)
            settings = dataclasses.replace(settings, count_patches=patches)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "npu-shadow: torch_npu is installed but not imported")  # (bootstrap)
                # (the exit summary says it: "no target installed")
                warnings.filterwarnings("ignore", "npu-shadow: no torch_npu patch is active")
                targets = _targets(config, self._refused_patches)
                self.monitor = install(targets, config.sample_rate, tolerance, self.exporters, settings=settings)
            self._start_switch(config)
            LEGACY_PATCHED.subscribe(refresh)
            if not self._at_exit_registered:
                self._at_exit_registered = True
                atexit.register(self.at_exit)
                _flush_on_sigterm(self.at_exit)
            return self.monitor

    def _find_rollback(self, config: Any) -> None:
        """A process started after the switch was thrown (a DataLoader worker, say) starts rolled back: told by its
        environment whatever its start method, or by the rollback file."""
        if not self.rolled_back_by:
            self.rolled_back_by = os.environ.get(ROLLED_BACK_BY) or None
        if config.rollback_file and not self.rolled_back_by:
            from shadow.launcher.switch import own_first_line

            who = own_first_line(config.rollback_file)
            if who is not None:
                self.rolled_back_by = f"file:{who or config.rollback_file}"

    def _start_switch(self, config: Any) -> None:
        if self.switch is not None or not (config.rollback_file or config.rollback_port is not None):
            return
        from shadow.launcher.switch import RollbackSwitch, SharedRollback

        if self.shared_rollback is None:
            self.shared_rollback = SharedRollback()
            if self.rolled_back_by is not None:
                self.shared_rollback.set(self.rolled_back_by)
            forks.register(self)
        port = None
        if config.rollback_port is not None and _is_job_process():  # (DataLoader workers only watch the file)
            port = config.rollback_port + _local_rank() if config.rollback_port else 0
        self.switch = RollbackSwitch(
            self.roll_back, self.reset_primary, config.rollback_file, port, config.rollback_addr, config.rollback_token
        )
        if port is not None and self.switch.port is None:
            if config.primary == "upstream" and not config.rollback_optional:
                # (the port was free when the launcher checked: taken since. Never a canary without its switch.)
                print("npu-shadow: the rollback endpoint could not start: legacy's result returned", file=sys.stderr)
                self.roll_back("no-switch: the rollback endpoint could not start")
            else:
                fallback = "the file switch still works" if config.rollback_file else "no switch in this process"
                print(f"npu-shadow: the rollback endpoint could not start; {fallback}", file=sys.stderr)

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) has none of the parent's switch threads: it polls the shared page."""
        self._lock = threading.RLock()
        self.switch = None
        if self.shared_rollback is not None:
            self.shared_rollback.watch_in_child(self.roll_back, lambda: self.rolled_back_by is not None)

    def roll_back(self, by: str) -> list[str]:
        """Make legacy the primary of every target, now and in any monitor installed later; returns those that
        changed. What the rollback switch calls."""
        with self._lock:
            self.rolled_back_by = by
            os.environ[ROLLED_BACK_BY] = by  # (every process the job starts from now on, spawned too)
            if self.shared_rollback is not None:  # (and every process forked before it: they poll the page)
                self.shared_rollback.set(by)
            return self.monitor.roll_back(by) if self.monitor is not None else []

    def reset_primary(self, by: str) -> list[str]:
        """A person's reset of the switch: the configured primary again."""
        with self._lock:
            self.rolled_back_by = None
            os.environ.pop(ROLLED_BACK_BY, None)
            if self.shared_rollback is not None:
                self.shared_rollback.clear()
            return self.monitor.reset_primary(by) if self.monitor is not None else []

    def refresh(self) -> None:
        """Re-install when something patched over the wrappers, or new legacy patches appeared. Called from the
        job's own code (its patch_torch()): whatever goes wrong here is said, never raised into it."""
        try:
            self._refresh()
        except Exception as exc:
            log.warning("npu-shadow: re-installing over new legacy patches failed (%r); shadowing as before", exc)

    def _refresh(self) -> None:
        from shadow.core.model import targets

        with self._lock:
            if self.monitor is None:
                return
            wanted = set(self.config.targets) if self.config.targets else set(targets.active_builtins())
            if self.monitor.replaced() or wanted - set(self.monitor.targets):
                log.info("npu-shadow: legacy patches changed; installing the monitor over them")
                self.install()

    def at_exit(self) -> None:
        """Flush, write the textfile, push, and print the summary: once, at exit or on SIGTERM."""
        if self.monitor is None or self._exited:
            return
        self._exited = True
        self.monitor.flush()
        config = self.config
        if _is_job_process():
            for exporter in self.exporters:
                # each output on its own: a failed push never costs the textfile, nor the textfile the push
                if config.pushgateway and hasattr(exporter, "push_to_gateway"):
                    # grouped by job and instance (host and rank): the ranks of a job never overwrite each other
                    self._at_exit_output(
                        f"push to {config.pushgateway}",
                        exporter.push_to_gateway,
                        config.pushgateway,
                        job=os.environ.get("NPU_SHADOW_JOB", "npu-shadow"),
                        grouping_key={"instance": f"{socket.gethostname()}:rank{_local_rank()}"},
                        timeout=PUSH_TIMEOUT_SECONDS,
                        deadline=PUSH_TIMEOUT_SECONDS,
                    )
                if config.textfile and hasattr(exporter, "write_textfile"):
                    path = config.textfile.format(rank=_local_rank(), pid=os.getpid())
                    self._at_exit_output(f"textfile {path}", exporter.write_textfile, path)
            job, processes = _job_totals(self.exporters)
            text = summary(
                _then(self._earlier, self.monitor.stats()), self.monitor.legacy_origins(), job=job, processes=processes,
                forked=forks.forked_children(), idle_canaries=self.monitor.idle_canaries,
            )  # fmt: skip
            if self.release_patches:
                counts = dict(self._earlier_patches)
                for patch, calls in self.monitor.patch_counts().items():
                    counts[patch] = counts.get(patch, 0) + calls
                text += "\n" + patch_summary(
                    counts, self.release, self.release_patches, self.monitor.patches_uncounted()
                )
            print(text, file=sys.stderr)

    def _at_exit_output(
        self, what: str, write: Callable[..., None], *args: Any, deadline: float | None = None, **kwargs: Any
    ) -> None:
        """One output at exit; a failure is counted (``output_failures``) and said once, with how long it took,
        never raised. With a ``deadline`` (seconds), the output runs in a thread of its own and is given up on
        when the deadline passes, however slowly the other end answers (a socket timeout bounds each read, not a
        server that drips its answer): the thread is left behind, the job goes on to exit."""
        started = time.monotonic()
        failure: list[BaseException] = []

        def attempt() -> None:
            try:
                write(*args, **kwargs)
            except Exception as exc:
                failure.append(exc)

        if deadline is None:
            attempt()
        else:
            thread = threading.Thread(target=attempt, name=f"npu-shadow {what}", daemon=True)
            thread.start()
            thread.join(deadline)
            if thread.is_alive():
                failure.append(TimeoutError(f"not finished within its {deadline:g} s deadline; given up"))
        if failure:
            self.output_failures[what] = self.output_failures.get(what, 0) + 1
            print(f"npu-shadow: {what} failed after {time.monotonic() - started:.1f} s: {failure[0]}", file=sys.stderr)

    def _close_exporters(self) -> None:
        for exporter in self.exporters:
            call_hook(exporter, "close")
        self.exporters = []

    def _emulate_npu(self, devices: int, properties: str | None) -> None:
        """Install the emulated npu, with a real device's ``properties`` where given; where it cannot be (torch_npu
        imported with torch, say), say so once and shadow what the host has: a rehearsal option must never leave a
        real job unshadowed."""
        from shadow.npu import emulated
        from shadow.npu.device_properties import DeviceProperties

        try:
            emulated.install(devices)
            if properties:
                emulated.set_properties(DeviceProperties.parse(properties))
        except emulated.EmulatorUnavailable as exc:
            if not self._emulation_refused:
                self._emulation_refused = True
                print(f"npu-shadow: --emulate-npu ignored: {exc}", file=sys.stderr)

    def _legacy_from(self, path: str) -> None:
        """Install torch_npu's own legacy from its source at ``path`` (:func:`_load_legacy`), once per process."""
        if self.legacy is _NOT_LOADED:
            self.legacy = _load_legacy(path)


def _targets(config: Any, refused: set[str]) -> Any:
    """What the monitor shadows: ``--targets`` (else every built-in whose legacy is active), and a generic target for
    each ``--shadow-patch`` (one that cannot be made here is said once, added to ``refused``, and left out)."""
    if not config.shadow_patches:
        return config.targets
    from shadow.core.model import targets as builtin
    from shadow.launcher.patch_targets import PatchRefused, patch_target

    chosen: list[Any] = list(config.targets or builtin.active_builtins())
    for name in config.shadow_patches:
        try:
            chosen.append(patch_target(config.legacy_from, name))
        except (PatchRefused, ImportError) as exc:
            if name not in refused:
                refused.add(name)
                print(f"npu-shadow: --shadow-patch {name} not shadowed: {exc}", file=sys.stderr)
    return chosen


_NOT_LOADED = object()

#: Set in the job's environment when its switch is thrown: processes it starts later begin rolled back.
ROLLED_BACK_BY = "NPU_SHADOW_ROLLED_BACK_BY"
#: Set by ``npu-shadow run --legacy-from RELEASE``: a file naming the release's function patches, whose calls every
#: process counts (:func:`shadow.analysis.census_cache.patch_list`).
PATCH_LIST = "NPU_SHADOW_PATCH_LIST"


def _patch_list(environ: Mapping[str, str]) -> tuple[tuple[str, ...], str, int]:
    """(the function patches to count, the release, how many patches it applies) from :data:`PATCH_LIST`'s file;
    none where it is not set or cannot be read (said once)."""
    path = environ.get(PATCH_LIST)
    if not path:
        return (), "", 0
    from shadow.core.support.safe_paths import open_own_file

    try:
        # (data from the launcher's census cache: a regular file of this user's, never a FIFO waited on)
        with os.fdopen(open_own_file(path, os.O_RDONLY), "rb") as handle:
            content = json.loads(handle.read(64 << 20))
        names = tuple(name for name in content["patches"] if isinstance(name, str))
        return names, str(content.get("version", "")), int(content.get("total", len(names)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"npu-shadow: no patch calls counted: {PATCH_LIST}={path}: {exc}", file=sys.stderr)
        return (), "", 0


#: The process's launcher: what ``npu-shadow run`` and :func:`install_from_env` install.
LAUNCHER = Launcher()


def _load_legacy(path: str) -> Any:
    """Install torch_npu's own legacy from its source at ``path``, or :mod:`shadow.npu.reference`'s where ``path``
    is "reference"; what is installed is returned (None where nothing is). Where torch_npu itself is imported its
    patches are the legacy; where the source cannot be loaded, say so and shadow what the process has."""
    from shadow.launcher.setting_values import REFERENCE
    from shadow.npu import torch_npu_source

    if "torch_npu" in sys.modules:
        print(
            "npu-shadow: --legacy-from ignored: torch_npu is imported, its own patches are the legacy", file=sys.stderr
        )
        return None
    if path == REFERENCE:
        from shadow.npu import reference

        return reference.patch_torch()
    try:
        legacy = torch_npu_source.load(path)
    except (torch_npu_source.LegacySourceError, OSError) as exc:
        print(f"npu-shadow: --legacy-from {path}: {exc}; shadowing the legacy this process has", file=sys.stderr)
        return None
    legacy.patch_torch()
    if legacy.missing and _is_job_process():  # (said once, by the job's process)
        which = "that target is" if len(legacy.missing) == 1 else "those targets are"
        print(
            f"npu-shadow: torch_npu {legacy.version} has no {', '.join(legacy.missing)} patch: {which} not installed",
            file=sys.stderr,
        )
    return legacy


def install_from_env(environ: Mapping[str, str] | None = None) -> Any:
    """Install (or re-install) the monitor described by the NPU_SHADOW_* variables. Returns the Monitor.

    Raises :class:`shadow.launcher.config.ConfigError` on a bad variable.
    """
    return LAUNCHER.install(environ)


def refresh() -> None:
    """Move the process's monitor over new legacy patches (subscribed to ``LEGACY_PATCHED``)."""
    LAUNCHER.refresh()


def _then(earlier: Mapping[str, Any], later: Mapping[str, Any]) -> dict[str, Any]:
    """Counts by target of one monitor followed by another's (TargetStats.then), in the later's order."""
    merged = {name: earlier[name].then(stats) if name in earlier else stats for name, stats in later.items()}
    return merged | {name: stats for name, stats in earlier.items() if name not in later}


@dataclasses.dataclass
class JobTotals:
    """One target's counts over every process that shares this process's metrics (its DataLoader workers)."""

    calls: int = 0
    compared: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)


def _job_totals(exporters: list[Any]) -> tuple[dict[str, JobTotals] | None, int]:
    """Totals by target from the job's shared metrics (the Prometheus multiprocess files every process of the job
    writes), and how many processes wrote them; (None, 0) where this process's metrics are its own.

    Read from the registry's own samples, importing nothing: this runs at exit, where an import could run code
    that clears the interpreter's note of a Ctrl-C (and the job would exit 1, not as SIGINT)."""
    from shadow.core.model import contract

    shared = next((e for e in exporters if getattr(e, "multiprocess", False)), None)
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if shared is None or not directory:
        return None, 0
    try:
        names = os.listdir(directory)
        processes = {name.rsplit("_", 1)[-1].removesuffix(".db") for name in names if name.endswith(".db")}
        if len(processes) <= 1:
            return None, len(processes)
        totals: dict[str, JobTotals] = {}
        for family in shared.registry.collect():
            for sample in family.samples:
                target = sample.labels.get("target")
                if target is None:
                    continue
                count = round(sample.value)
                total = totals.setdefault(target, JobTotals())
                if sample.name == contract.CALLS.series:
                    total.calls += count
                elif sample.name == contract.COMPARISONS.series:
                    total.compared += count
                elif sample.name == contract.SKIPPED.series and count:
                    reason = sample.labels.get("reason", "")
                    total.skipped[reason] = total.skipped.get(reason, 0) + count
    except Exception:  # (the summary goes on with this process's own counts)
        return None, 0
    return totals, len(processes)


def _skips(by_reason: Mapping[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(by_reason.items()) if count)


def _run_or_problem() -> str:
    try:
        return run_id()
    except ValueError as exc:
        return f"unnamed ({exc})"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _target_lines(s: Any) -> list[str]:
    """What the summary says under a target's line: its skips by reason, its phase, and its extra runs."""
    lines: list[str] = []
    skipped = {r: n for r, n in s.by_reason.items() if r in SKIP_REASON_MEANING and n}
    for reason, count in sorted(skipped.items()):
        lines.append(f"skipped {count} for {reason}: {SKIP_REASON_MEANING[reason]}")
    if s.rolled_back_by:
        lines.append(f"rolled back: legacy's result returned since the switch thrown by {s.rolled_back_by}")
    elif s.primary == "upstream":
        lines.append("canary: upstream's result returned, legacy compared")
    if s.shared_divergences:
        found = ", ".join(f"{reason} {count}" for reason, count in sorted(s.shared_divergences.items()))
        lines.append(
            f"shared divergence: {found} of {s.oracle_runs} single-device checks "
            "(legacy = upstream, both unlike replica 0 alone)"
        )
    if s.backward_runs:
        differ = s.by_reason.get("grad", 0)
        lines.append(
            f"backward compared on {s.backward_runs} calls (gradients through both graphs): "
            f"{differ} differ, rated over these calls alone"
        )
    if s.shadow_peak_bytes:
        lines.append(
            f"device memory: a shadow side raised the device's peak allocation by at most {_mib(s.shadow_peak_bytes)}"
        )
    if s.drilled:
        lines.append(
            f"fire drill: injected into {s.drilled} of {s.compared} comparisons (a call whose result is "
            "its own input is never drilled: that would write the caller's tensor)"
        )
    if s.truth_runs:
        found = ", ".join(f"{side} {s.truth_runs.get(side, 0)}" for side in ("upstream", "legacy", "tie"))
        differs = s.truth_runs.get(DIFFERS_IN_FLOAT64, 0)
        found += f"; the two code paths differ in float64 too: {differs}" if differs else ""
        lines.append(f"float64 truth runs, side nearer the truth: {found}")
    return lines


def summary(
    stats: dict,
    legacy: dict[str, str] | None = None,
    job: Mapping[str, JobTotals] | None = None,
    processes: int = 0,
    forked: int = 0,
    idle_canaries: tuple[str, ...] = (),
) -> str:
    """One screen: where the legacy comes from, then a line per target with every skip reason named, and one per
    canary A/B whose legacy is active but that runs only in a canary (``idle_canaries``); then the job's totals over
    every process sharing its metrics (``job``, written by ``processes`` processes), or, where this process
    ``forked`` children and there are no shared metrics, that their calls are not in it."""
    origins = sorted(set((legacy or {}).values()))
    lines = [f"npu-shadow run {_run_or_problem()}"]
    lines += [f"npu-shadow legacy: {', '.join(origins)}"] if origins else []
    lines += [
        f"{'npu-shadow':<17}{'calls':>10}{'sampled':>9}{'match':>8}{'close':>7}{'mismatch':>10}{'error':>7}"
        f"{'skipped':>9}"
    ]
    for name, s in stats.items():
        if s.calls == 0:
            lines.append(f"{name:<17}not exercised: never called in this process")
            continue
        lines.append(
            f"{name:<17}{s.calls:>10}{s.sampled:>9}{s.match:>8}{s.close:>7}{s.mismatch:>10}{s.error:>7}{s.skipped:>9}"
        )
        lines += [f"{'':<17}{line}" for line in _target_lines(s)]
    for name in idle_canaries:
        lines.append(f"{name:<17}not compared: a canary A/B (it cannot run twice), run only with --primary upstream")
    if not stats:
        lines.append("(no target installed: no active legacy patch in this process)")
    if job is not None and processes > 1:
        lines.append(f"npu-shadow job: {processes} processes shared these metrics (this one and those it started)")
        for name, total in job.items():
            if not (total.calls or total.compared or total.skipped):
                continue  # (never called: the table above says so)
            skipped = sum(total.skipped.values())
            reasons = f" ({_skips(total.skipped)})" if skipped else ""
            lines.append(f"{name:<17}{total.calls:>10} calls, {total.compared} compared, {skipped} skipped{reasons}")
    elif forked and job is None and stats:
        lines.append(
            f"(this process only: it forked {forked} processes, DataLoader workers say; any calls of theirs are "
            "counted in their own metrics and journals, not here: npu-shadow verdict reads them all)"
        )
    return "\n".join(lines)


def patch_summary(
    counts: Mapping[str, int], release: str, total: int, uncounted: Mapping[str, str] | None = None, most: int = 8
) -> str:
    """The exit summary's line on the release's patches: how many this process called, the most called first; and
    those reachable here whose calls could not be counted, by why (``uncounted``)."""
    called = sorted(((calls, name) for name, calls in counts.items() if calls), reverse=True)
    top = ", ".join(f"{name} {calls:,}" for calls, name in called[:most])
    more = f" and {len(called) - most} more" if len(called) > most else ""
    line = (
        f"npu-shadow patches: this process called {len(called)} of torch_npu {release}'s {total} patches "
        f"({len(counts)} function patches counted here){': ' + top + more if called else ''}"
    )
    by_why: dict[str, list[str]] = {}
    for name, why in (uncounted or {}).items():
        by_why.setdefault(why, []).append(name)
    for why, names in sorted(by_why.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        line += f"\nnpu-shadow patches: {len(names)} not counted ({shown}): {why}"
    return line


def _flush_on_sigterm(at_exit: Callable[[], None]) -> None:
    """A job stopped by SIGTERM (how schedulers and ``npu-shadow run`` stop it) dies without running atexit: where
    the job has no handler of its own, flush, write, push and print the summary first, then die of the signal
    as it would have. (SIGINT raises KeyboardInterrupt, which runs atexit by itself.)"""
    if threading.current_thread() is not threading.main_thread() or not _is_job_process():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(number: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            at_exit()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
