"""``npu-shadow run``: a job's command with the monitor in every Python process it starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from shadow.core.safe_paths import make_private_directory
from shadow.launcher import config as cfg
from shadow.launcher.bootstrap import npu_shadow_boot as boot
from shadow.launcher.launch import wants_prometheus

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(boot.__file__))


def _serve_node(directory: str, port: int, addr: str):
    """Serve the aggregate of every process's metric files in ``directory`` (one endpoint per node)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from exporters.prometheus import serve_registry

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return serve_registry(registry, port, addr)


def _run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run the command; SIGTERM and SIGINT sent to the launcher go on to it (schedulers stop jobs so). A command
    killed by signal N exits 128 + N, as a shell reports it."""
    child = subprocess.Popen(command, env=env)
    forwarded = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda number, frame: child.send_signal(number)) for sig in forwarded}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _directories(config: cfg.Config, options: Mapping[str, str | None]) -> str | None:
    """Create the capture directory and a fresh metrics folder inside ``--multiproc-dir`` (mode 0700): a folder
    of an earlier job (its counts), planted symlinks or foreign files there never reach this one. Returns that
    folder. Raises ValueError naming the setting."""

    def name(setting: str) -> str:
        return cfg.SETTINGS[setting].option if options.get(setting) is not None else cfg.SETTINGS[setting].variable

    if config.capture_dir:
        make_private_directory(config.capture_dir, name("capture_dir"))
    if not config.multiproc_dir:
        return None
    make_private_directory(config.multiproc_dir, name("multiproc_dir"))
    try:
        return tempfile.mkdtemp(prefix="job-", dir=config.multiproc_dir)
    except OSError as exc:
        raise ValueError(f"{name('multiproc_dir')}={config.multiproc_dir!r}: {exc.strerror or exc}") from None


def run(command: Sequence[str], options: Mapping[str, str | None], environ: Mapping[str, str] = os.environ) -> int:
    """Run ``command`` shadowed. Returns its exit code; 2 on a bad setting (before it starts)."""
    try:
        config = cfg.from_sources(environ, options)
    except cfg.ConfigError as exc:
        print(f"npu-shadow run: {exc}", file=sys.stderr)
        return 2
    if not command:
        print("npu-shadow run: no command given (npu-shadow run [options] -- COMMAND ...)", file=sys.stderr)
        return 2
    if config.emulate_npu:
        from shadow.npu import emulated

        try:
            emulated.build()  # once here, so the job's processes only load it
        except emulated.EmulatorUnavailable as exc:
            print(f"npu-shadow run: --emulate-npu: {exc}", file=sys.stderr)
            return 2
    if config.legacy_from:
        from shadow.npu import torch_npu_source

        try:
            torch_npu_source.check(config.legacy_from)
        except (torch_npu_source.LegacySourceError, OSError) as exc:
            print(f"npu-shadow run: --legacy-from: {exc}", file=sys.stderr)
            return 2
    try:
        job_metrics_dir = _directories(config, options)
    except ValueError as exc:
        print(f"npu-shadow run: {exc}", file=sys.stderr)
        return 2
    env = dict(environ)
    env.update(cfg.to_environ(options))
    env[boot.ENABLED] = "1"
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    temporary = server = None
    if wants_prometheus(config):
        base = job_metrics_dir or tempfile.mkdtemp(prefix="npu-shadow-metrics-")
        temporary = None if job_metrics_dir else base
        env[boot.METRICS_DIR] = base
        env[boot.METRICS_LAYOUT] = "node" if config.multiproc_dir else "rank"
        if config.multiproc_dir and config.port is not None:
            server = _serve_node(base, config.port, config.addr)
    try:
        return _run_forwarding_signals(list(command), env)
    except OSError as exc:
        print(f"npu-shadow run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
