"""Installing the monitor in processes we did not write: from environment variables, when torch arrives.

``npu-shadow run`` puts ``shadow/_bootstrap`` (a ``sitecustomize``) on PYTHONPATH, so every Python process
the job starts (torchrun ranks, spawned DataLoader workers) arms the monitor at interpreter start. That
costs nothing in processes that never import torch: it installs :func:`install_from_env` to run
right after ``import torch`` has finished (torch_npu, when autoloaded by ``import torch``, has patched by
then), and again after a later ``import torch_npu`` (or ``shadow.reference.patch_torch()``), which patch
over the wrappers: the monitor is then installed anew over the new legacy, never twice, never lost.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import warnings
from typing import Any

log = logging.getLogger("shadow")

_state: dict[str, Any] = {"monitor": None, "exporters": [], "config": None}
_lock = threading.RLock()


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


def _exporters(config: Any) -> list[Any]:
    from exporters import JsonlExporter, OTelExporter, PrometheusExporter

    made: list[Any] = []
    if wants_prometheus(config):
        port = None
        if config.port is not None and not config.multiproc_dir and _is_job_process():
            port = config.port + _local_rank() if config.port else 0
        made.append(PrometheusExporter(port=port, addr=config.addr))
    if config.otel:
        made.append(OTelExporter())
    if config.journal:
        made.append(JsonlExporter(config.journal, capture_dir=config.capture_dir))
    return made


def install_from_env(environ: dict[str, str] | None = None) -> Any:
    """Install (or re-install) the monitor described by the NPU_SHADOW_* variables. Returns the Monitor.

    Raises :class:`shadow.config.ConfigError` on a bad variable.
    """
    import shadow
    from shadow import config as config_module
    from shadow.drill import Drill
    from shadow.tolerance import Tolerance

    with _lock:
        config = _state["config"] or config_module.from_sources(os.environ if environ is None else environ)
        _state["config"] = config
        if config.emulate_npu:
            _emulate_npu(config.emulate_npu)
        if config.legacy_from:
            _legacy_from(config.legacy_from)
        if not _state["exporters"]:
            _state["exporters"] = _exporters(config)
        previous = _state["monitor"]
        if previous is not None:
            previous.uninstall()
        tolerance = Tolerance(config.rtol, config.atol) if config.rtol is not None else None
        drill = Drill(*config.drill, seed=config.seed) if config.drill else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "npu-shadow: torch_npu is installed but not imported")  # see after_torch
            monitor = shadow.install(
                targets=config.targets,
                sample_rate=config.sample_rate,
                tolerance=tolerance,
                exporters=_state["exporters"],
                seed=config.seed,
                drill=drill,
                oracle=config.oracle,
                budget=config.budget,
            )
        _state["monitor"] = monitor
        if previous is None:
            atexit.register(_at_exit)
            _flush_on_sigterm()
        return monitor


def _emulate_npu(devices: int) -> None:
    """Install the emulated npu; where it cannot be (torch_npu imported with torch, say), say so once and
    shadow what the host has: a rehearsal option must never leave a real job unshadowed."""
    from shadow import emulated_npu

    try:
        emulated_npu.install(devices)
    except emulated_npu.EmulatorUnavailable as exc:
        if not _state.get("emulation_refused"):
            _state["emulation_refused"] = True
            print(f"npu-shadow: --emulate-npu ignored: {exc}", file=sys.stderr)


def _legacy_from(path: str) -> None:
    """Install torch_npu's own legacy from its source at ``path`` (once per process). Where torch_npu itself is
    imported its patches are the legacy; where the source cannot be loaded, say so once and shadow what the
    process has."""
    from shadow import torch_npu_source

    if "legacy" in _state:
        return
    if "torch_npu" in sys.modules:
        _state["legacy"] = None
        print(
            "npu-shadow: --legacy-from ignored: torch_npu is imported, its own patches are the legacy", file=sys.stderr
        )
        return
    try:
        legacy = torch_npu_source.load(path)
    except (torch_npu_source.LegacySourceError, OSError) as exc:
        _state["legacy"] = None
        print(f"npu-shadow: --legacy-from {path}: {exc}; shadowing the legacy this process has", file=sys.stderr)
        return
    _state["legacy"] = legacy
    legacy.patch_torch()


def refresh() -> None:
    """Re-install when something patched over the wrappers, or new legacy patches appeared."""
    from shadow import targets

    with _lock:
        monitor = _state["monitor"]
        if monitor is None:
            return
        config = _state["config"]
        wanted = set(config.targets) if config.targets else set(targets.active_builtins())
        if monitor.replaced() or wanted - set(monitor.targets):
            log.info("npu-shadow: legacy patches changed; installing the monitor over them")
            install_from_env()


def summary(stats: dict, legacy: dict[str, str] | None = None) -> str:
    """One screen: where the legacy comes from, then a line per target."""
    origins = sorted(set((legacy or {}).values()))
    lines = [f"npu-shadow legacy: {', '.join(origins)}"] if origins else []
    lines += [
        f"{'npu-shadow':<16}{'calls':>10}{'sampled':>9}{'match':>8}{'close':>7}{'mismatch':>10}{'error':>7}"
        f"{'skipped':>9}"
    ]
    for name, s in stats.items():
        if s.calls == 0:
            lines.append(f"{name:<16}not exercised: never called in this process")
            continue
        lines.append(
            f"{name:<16}{s.calls:>10}{s.sampled:>9}{s.match:>8}{s.close:>7}{s.mismatch:>10}{s.error:>7}{s.skipped:>9}"
        )
        if s.shared_divergences:
            found = ", ".join(f"{reason} {count}" for reason, count in sorted(s.shared_divergences.items()))
            lines.append(
                f"{'':<16}shared divergence: {found} of {s.oracle_runs} single-device checks "
                "(legacy = upstream, both unlike replica 0 alone)"
            )
    if not stats:
        lines.append("(no target installed: no active legacy patch in this process)")
    return "\n".join(lines)


def _flush_on_sigterm() -> None:
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
            _at_exit()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _at_exit() -> None:
    monitor = _state["monitor"]
    if monitor is None or _state.get("exited"):
        return
    _state["exited"] = True
    monitor.flush()
    config = _state["config"]
    for exporter in _state["exporters"]:
        with contextlib.suppress(Exception):
            if config.pushgateway and hasattr(exporter, "push_to_gateway") and _is_job_process():
                exporter.push_to_gateway(config.pushgateway, job=os.environ.get("NPU_SHADOW_JOB", "npu-shadow"))
            if config.textfile and hasattr(exporter, "write_textfile") and _is_job_process():
                exporter.write_textfile(config.textfile.format(rank=_local_rank(), pid=os.getpid()))
    if _is_job_process():
        print(summary(monitor.stats(), monitor.legacy_origins()), file=sys.stderr)


def after_torch() -> None:
    """Called right after ``import torch``: install, and watch for a later ``import torch_npu``."""
    try:
        install_from_env()
    except Exception as exc:  # never break the job's `import torch`
        print(f"npu-shadow: not installed: {exc}", file=sys.stderr)
        return
    if "torch_npu" not in sys.modules:
        from shadow._bootstrap.npu_shadow_boot import AfterImport

        sys.meta_path.insert(0, AfterImport("torch_npu", refresh))
