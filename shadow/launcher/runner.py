"""``npu-shadow run``: a job's command with the monitor in every Python process it starts."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence

from shadow.core.model.run_ids import COMMAND_ID_VARIABLE, MADE_RUN_ID_VARIABLE, command_id, new_run_id, started
from shadow.core.support.safe_paths import make_private_directory
from shadow.launcher import config as cfg
from shadow.launcher import linger
from shadow.launcher.bootstrap import npu_shadow_boot as boot
from shadow.launcher.launch import ROLLED_BACK_BY, wants_prometheus
from shadow.launcher.setting_values import REFERENCE

BOOTSTRAP_DIR = os.path.dirname(os.path.abspath(boot.__file__))


def _refused_patches(config: cfg.Config) -> str:
    """Why the first of ``--shadow-patch``'s patches cannot be shadowed (the census's word), or ""."""
    from shadow.launcher import patch_targets

    for name in config.shadow_patches:
        why = patch_targets.refusal(config.legacy_from, name)
        if why:
            return why
    return ""


def _count_patches(legacy_from: str, env: dict[str, str]) -> None:
    """Every process of the job counts its calls of the release's function patches: their names, from the release's
    census (kept in the cache after the first), named in ``env`` (:data:`~shadow.launcher.launch.PATCH_LIST`). A
    release that cannot be read counts none, said (``--legacy-from`` says why when the job loads it); a census
    cache others can write is refused (UnsafeCache)."""
    from shadow.analysis import census_cache
    from shadow.launcher.launch import PATCH_LIST
    from shadow.npu.torch_npu_source import LegacySourceError

    try:
        env[PATCH_LIST] = str(census_cache.patch_list(legacy_from))
    except census_cache.UnsafeCache:
        raise
    except (LegacySourceError, OSError) as exc:
        print(f"npu-shadow: no patch calls counted: {exc}", file=sys.stderr)


def _is_torchrun(command: Sequence[str]) -> bool:
    return any(os.path.basename(word) == "torchrun" or word == "torch.distributed.run" for word in command[:4])


def _serve_node(directory: str, port: int, addr: str):
    """Serve the aggregate of every process's metric files in ``directory`` (one endpoint per node): the server
    (None where the port is taken) and its registry."""
    from prometheus_client import CollectorRegistry

    from exporters.prometheus import SignatureCappedCollector, serve_registry

    registry = CollectorRegistry()
    SignatureCappedCollector(registry, path=directory)
    return serve_registry(registry, port, addr, mark_dir=directory), registry


#: Signals that ask the job to stop: once one was passed on, the launcher does not keep the endpoint after the job
#: (whoever stopped it waits for the launcher, and a scheduler kills what outlives its grace period).
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _scraped_during_job(base: str, node: tuple | None) -> bool:
    """Whether something scraped the job's endpoint while it ran (:class:`exporters.prometheus.ScrapeMarking`)."""
    from exporters.prometheus import scraped

    if node is not None:
        return scraped(base)
    try:
        return any(scraped(directory) for directory in linger.rank_directories(base).values())
    except OSError:
        return False


def _serve_final_counts(config: cfg.Config, base: str, node: tuple | None, stopped: bool = False) -> None:
    """After the job: keep its endpoints up until a scrape has read the final counts (``--linger``), and say
    where the final counts went."""
    seconds = cfg.linger_seconds(config)
    if config.port is None:
        return
    if not seconds and config.linger is None and _scraped_during_job(base, node):
        # (a textfile or a Pushgateway carries the final counts elsewhere; the Prometheus that scraped the
        # endpoint has only what it read, so the endpoint stays for it too)
        seconds = cfg.DEFAULT_LINGER_SECONDS
    if stopped and seconds:
        print("npu-shadow: the job was stopped by a signal: its endpoint is not kept after it", file=sys.stderr)
        return
    if seconds == 0:
        kept = [what for what, given in (("Pushgateway", config.pushgateway), ("textfile", config.textfile)) if given]
        if kept:
            print(f"npu-shadow: the job's final counts are in its {' and '.join(kept)}", file=sys.stderr)
        return
    servers, registries, where = [], [], []
    if node is not None:
        if node[0] is not None:
            registries.append(node[1])
            where.append(f"{config.addr}:{node[0].server_port}")
    elif config.port == 0:
        print(
            "npu-shadow: the job's final counts are not served after it: each process chose its own port (--port 0)",
            file=sys.stderr,
        )
        return
    else:
        for rank, directory in linger.rank_directories(base).items():
            server, registry = linger.serve_rank(directory, config.port + rank, config.addr)
            if server is not None:
                servers.append(server)
                registries.append(registry)
                where.append(f"{config.addr}:{config.port + rank}")
    if not registries:
        return
    try:
        print(
            f"npu-shadow: the job's final counts stay on {', '.join(where)} until a scrape reads them "
            f"(at most {seconds:g} s, --linger)",
            file=sys.stderr,
        )
        ended = linger.wait_for_scrapes(registries, seconds, linger.signalled(_listened()))
        if ended.how == "scraped":
            print(
                f"npu-shadow: the final counts were scraped {ended.seconds:.1f} s after the job ended", file=sys.stderr
            )
        else:
            why = "a signal stopped the wait" if ended.how == "signal" else f"no scrape came in {seconds:g} s"
            print(
                f"npu-shadow: the final counts were not scraped ({why}): Prometheus lacks the job's last counts "
                "(its journal and textfile have them)",
                file=sys.stderr,
            )
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


#: Signals the launcher passes on to the job: schedulers stop jobs with SIGTERM, people with SIGINT or SIGHUP,
#: and jobs use SIGUSR1/SIGUSR2 for checkpoints.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: si_code of a signal the kernel sent: the terminal's Ctrl-C, Ctrl-\\ and hang-up go to its whole foreground
#: process group, the job included, which then has its own (Linux's SI_KERNEL).
_SI_KERNEL = 0x80


class CannotStart(OSError):
    """The command could not be started; ``exit_code`` is what a shell gives (126: found but not runnable,
    127: not found)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _resolve(command: str, env: Mapping[str, str]) -> str:
    """The file ``command`` runs, searched on the job's PATH as a shell does; CannotStart as a shell would."""
    path = command if os.sep in command else shutil.which(command, mode=os.F_OK, path=env.get("PATH", os.defpath))
    if path is None or not os.path.exists(path):
        raise CannotStart(f"{command}: command not found", 127)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise CannotStart(f"{command}: {'is a directory' if os.path.isdir(path) else 'permission denied'}", 126)
    return path


def _listened() -> tuple[signal.Signals, ...]:
    """The FORWARDED signals this launcher was not started ignoring. A job started with ``&`` in a script ignores
    SIGINT and SIGQUIT, and so does the launcher, as any child of that shell would: a SIGINT then neither reaches
    the job through it nor counts as having stopped it (it said "stopped by a signal" and dropped the linger while
    the job, ignoring it too, went on and exited 0)."""
    return tuple(s for s in FORWARDED if signal.getsignal(s) != signal.SIG_IGN)


def _waited() -> set[signal.Signals]:
    return {*_listened(), signal.SIGCHLD}


#: Signals Python ignores in itself at start-up: a job gets them back at their defaults, as a shell starts it
#: (a job killed by SIGPIPE exits 141 under the launcher too), as subprocess's ``restore_signals`` does.
_PYTHON_IGNORES = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name))


def _run_forwarding_signals(
    command: list[str], env: dict[str, str], mask: set[signal.Signals], forwarded: list[int] | None = None
) -> int:
    """Run the command as a transparent wrapper would: signals sent to the launcher (FORWARDED) go on to the job
    once, a signal the terminal already sent to the job's process group is not sent again, and the exit code is
    the job's (a job killed by signal N exits 128 + N, as a shell reports it). The caller has blocked _waited() in
    every thread of the launcher (they are taken here, with their sender); ``mask`` is its mask before, which
    the job starts with; ``forwarded`` collects the signals the job got. Raises CannotStart."""
    executable = _resolve(command[0], env)
    early = signal.sigtimedwait(_listened(), 0)  # stopped while the launcher was getting ready: the job never starts
    if early is not None:
        return 128 + early.si_signo
    try:
        pid = os.posix_spawn(executable, command, env, setsigmask=mask, setsigdef=_PYTHON_IGNORES)
    except OSError as exc:
        raise CannotStart(f"{command[0]}: {exc.strerror or exc}", 126) from None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        info = signal.sigtimedwait(_waited(), 1.0)  # (the timeout: SIGCHLDs can merge)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        if forwarded is not None:
            forwarded.append(info.si_signo)
        if info.si_code == _SI_KERNEL and os.getpgid(pid) == os.getpgrp():
            continue  # from the terminal, to the whole group: the job has it already
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, info.si_signo)


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
    # Blocked before anything else (threads started later inherit the mask): no thread of the launcher takes
    # them but the loop that forwards them, which learns who sent each.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _waited())
    try:
        return _run(command, options, environ, mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _canary_switch_problem(config: cfg.Config, environ: Mapping[str, str]) -> str | None:
    """Why a canary asked for an HTTP switch would run without one (its port past 65535 with LOCAL_RANK added,
    or not free), or None; None also where --rollback-optional says to run it anyway."""
    if config.primary != "upstream" or config.rollback_port is None or config.rollback_optional:
        return None
    rank = environ.get("LOCAL_RANK", "0")
    port = config.rollback_port + (int(rank) if rank.isascii() and rank.isdigit() else 0)
    option, optional = cfg.SETTINGS["rollback_port"].option, cfg.SETTINGS["rollback_optional"].option
    advice = f"a canary does not run without its rollback switch ({optional} runs it anyway)"
    if port > 65535:
        return f"{option}={config.rollback_port} plus LOCAL_RANK={rank} is past port 65535: {advice}"
    if port == 0:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in config.rollback_addr else socket.AF_INET) as probe:
            probe.bind((config.rollback_addr.strip("[]"), port))
    except OSError as exc:
        return f"the rollback endpoint cannot listen on {config.rollback_addr}:{port} ({exc.strerror or exc}): {advice}"
    return None


def _unshadowed(path: str, code: int) -> int:
    """The job's exit status, or 2 where a process of it ran without its monitor (its install failed: said then on
    stderr, and again here): a job that ran unshadowed never ends as if it had been shadowed."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            reasons = [line.strip() for line in file if line.strip()]
    except OSError:
        return code
    if not reasons:
        return code
    print(
        f"npu-shadow run: the monitor could not start in {len(reasons)} process(es) of the job, which ran "
        f"unshadowed: {reasons[0]}",
        file=sys.stderr,
    )
    return code or 2


def _run(
    command: Sequence[str], options: Mapping[str, str | None], environ: Mapping[str, str], mask: set[signal.Signals]
) -> int:
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
    if config.legacy_from and config.legacy_from != REFERENCE:
        from shadow.npu import torch_npu_source

        try:
            torch_npu_source.check(config.legacy_from)
        except (torch_npu_source.LegacySourceError, OSError) as exc:
            print(f"npu-shadow run: --legacy-from: {exc}", file=sys.stderr)
            return 2
        refused = _refused_patches(config)
        if refused:
            print(f"npu-shadow run: --shadow-patch: {refused}", file=sys.stderr)
            return 2
    from shadow.launcher import launch

    for setting, package in launch.missing_packages(config).items():
        flag = "--otel" if setting == "otel" else "--port/--textfile/--pushgateway/--multiproc-dir"
        print(
            f"npu-shadow run: {flag}: the {setting} exporter needs the Python package {package!r}, which is not "
            "installed here; install it, or leave that exporter out",
            file=sys.stderr,
        )
        return 2
    refusal = _canary_switch_problem(config, environ)
    if refusal:
        print(f"npu-shadow run: {refusal}", file=sys.stderr)
        return 2
    if config.rollback_port is not None and not _loopback(config.rollback_addr):
        print(
            f"npu-shadow run: the rollback endpoint will listen on {config.rollback_addr}: other hosts can reach it, "
            "its token is its only guard",
            file=sys.stderr,
        )
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
    env.pop(ROLLED_BACK_BY, None)  # (a new job starts with its configured primary)
    if config.legacy_from and config.legacy_from != REFERENCE:
        from shadow.analysis.census_cache import UnsafeCache

        try:
            _count_patches(config.legacy_from, env)
        except UnsafeCache as exc:
            print(f"npu-shadow run: --legacy-from: {exc}", file=sys.stderr)
            return 2
    if COMMAND_ID_VARIABLE not in env:  # (every process of the job reports the command it wraps)
        env[COMMAND_ID_VARIABLE] = command_id(list(command))
    started(env)  # (when this launch began: every process it starts says so in its metrics)
    if config.run_id is None:  # (a new launch is a new run, unless torchrun names it)
        env[MADE_RUN_ID_VARIABLE] = new_run_id()
        torchrun = " (torchrun's TORCHELASTIC_RUN_ID instead where it sets one)" if _is_torchrun(command) else ""
        print(f"npu-shadow: run {env[MADE_RUN_ID_VARIABLE]}{torchrun}", file=sys.stderr)
    else:
        print(f"npu-shadow: run {config.run_id}", file=sys.stderr)
    temporary = server = node = base = None
    if wants_prometheus(config):
        base = job_metrics_dir or tempfile.mkdtemp(prefix="npu-shadow-metrics-")
        temporary = None if job_metrics_dir else base
        env[boot.METRICS_DIR] = base
        env[boot.METRICS_LAYOUT] = "node" if config.multiproc_dir else "rank"
        if config.multiproc_dir and config.port is not None:
            node = _serve_node(base, config.port, config.addr)
            server = node[0]
    descriptor, failed = tempfile.mkstemp(prefix="npu-shadow-failed-")  # (0600, this user's)
    os.close(descriptor)
    env[boot.FAILED] = failed
    try:
        forwarded: list[int] = []
        code = _run_forwarding_signals(list(command), env, mask, forwarded)
        if base is not None:
            _serve_final_counts(config, base, node, stopped=any(s in _STOPPING for s in forwarded))
        return _unshadowed(failed, code)
    except CannotStart as exc:
        print(f"npu-shadow run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        with contextlib.suppress(OSError):
            os.remove(failed)
        if server is not None:
            server.shutdown()
            server.server_close()
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
