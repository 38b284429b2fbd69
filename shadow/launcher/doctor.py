"""``npu-shadow doctor``: can this host shadow, and what will it show? Works on a CPU-only host too."""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import os
import platform
import socket

import torch

from shadow.core.model import targets
from shadow.launcher.setting_values import REFERENCE
from shadow.npu import catalog, reference


def _cached_wheel_hint() -> str:
    """Where a torch_npu wheel is cached (scripts/fetch_torch_npu.sh puts them there), as a --legacy-from to try."""
    from shadow.npu import wheels

    for version in ("2.12.0", "2.11.0", "2.10.0", "2.9.0", "2.8.0"):
        wheel = wheels.cached_wheel(version)
        if wheel is not None:
            return f"; a torch_npu {version} wheel is cached: --legacy-from {wheel}"
    return "; scripts/fetch_torch_npu.sh 2.12.0 caches torch_npu 2.12.0's wheel for --legacy-from"


KNOWN_DEFECT_VERSIONS = ((2, 10), (2, 13))  # upstream parallel_apply reads CUDA's autocast state, at least


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cann() -> str | None:
    for root in filter(None, [os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH")]):
        for path in glob.glob(os.path.join(root, "*version*.cfg")) + glob.glob(
            os.path.join(root, "*", "*version*.cfg")
        ):
            with contextlib.suppress(OSError), open(path) as handle:
                for line in handle:
                    if "version" in line.lower() and "=" in line:
                        return line.split("=", 1)[1].strip()
        return f"found at {root}"
    return None


def _removed(version: str) -> bool:
    """Whether this torch_npu release no longer carries the patches (2.13 and later)."""
    parts = version.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (2, 13)
    except (ValueError, IndexError):
        return False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _port_free(addr: str, port: int) -> str | None:
    try:
        with socket.socket() as s:
            s.bind((addr, port))
    except OSError as exc:
        return str(exc)
    return None


def self_test() -> tuple[bool, str]:
    """Shadow a few ``.type()`` casts on this host's device at rate 1; all must be compared and agree."""
    from shadow.core.calls.monitor import install

    device = reference.current_device() or torch.device("cpu")
    patches = reference.patch_torch() if targets.patch_origin(torch.Tensor.type) is None else None
    try:
        with install(["tensor_type"], sample_rate=1.0, seed=0) as monitor:
            x = torch.arange(8.0, device=device)
            x.type(torch.float16)
            x.type(torch.float64)
            x.type()
        stats = monitor.stats()["tensor_type"]
    finally:
        if patches is not None:
            patches.undo()
    ok = stats.sampled == stats.match == 3
    return ok, f"{stats.match}/{stats.sampled} casts matched on {device}"


def _device_line() -> str:
    from shadow.npu import emulated

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return "device: cpu only (no accelerator)"
    count = torch.accelerator.device_count()
    if emulated.installed_devices():
        return f"device: emulated npu ({count} devices, host memory: a rehearsal of the real upstream code)"
    return f"device: {accelerator.type} ({count} devices)"


def diagnose(
    port: int, addr: str = "127.0.0.1", emulate_npu: int = 0, legacy_from: str | None = None
) -> tuple[int, list[str]]:
    """(exit code, report lines). ``emulate_npu``: install that many emulated npu devices first;
    ``legacy_from``: use torch_npu's own legacy from that source (:mod:`shadow.npu.torch_npu_source`), or
    "reference". The last line says whether ``npu-shadow run`` with these options would have a legacy to shadow."""
    lines = [
        f"python {platform.python_version()}, torch {torch.__version__}",
    ]
    if emulate_npu:
        from shadow.npu import emulated

        try:
            emulated.install(emulate_npu)
        except emulated.EmulatorUnavailable as exc:
            lines.append(f"emulated npu: cannot install: {exc}")
            return 1, lines
    lines.append(_device_line())
    npu_version = _version("torch_npu")
    imported_npu = False
    if npu_version is None:
        lines.append("torch_npu: not installed")
    else:
        try:
            import torch_npu  # noqa: F401  (patches torch)

            imported_npu = True
            lines.append(f"torch_npu {npu_version}, CANN {_cann() or 'not found'}")
        except Exception as exc:
            lines.append(f"torch_npu {npu_version} is installed but does not import ({exc})")
    loaded = None
    rehearsal = legacy_from == REFERENCE and not imported_npu
    if legacy_from and not imported_npu and not rehearsal:
        from shadow.npu import torch_npu_source

        try:
            loaded = torch_npu_source.load(legacy_from)
        except (torch_npu_source.LegacySourceError, OSError) as exc:
            lines.append(f"legacy: --legacy-from {legacy_from}: {exc}")
            return 1, lines
    if npu_version is not None and loaded is None and not targets.active_builtins() and _removed(npu_version):
        # (torch_npu 2.13 deleted the patches: upstream is all this host has; the canary compares 2.12's legacy)
        lines.append(
            f"torch_npu {npu_version} has no legacy patches (they were removed in 2.13): run a canary, the caller "
            "getting upstream's result with torch_npu 2.12.0's legacy compared: npu-shadow run --primary upstream "
            "--legacy-from ~/.cache/npu-shadow/wheels/torch_npu-2.12.0-*.whl (scripts/fetch_torch_npu.sh 2.12.0 "
            "fetches it)"
        )
    if imported_npu:
        ignored = "; --legacy-from ignored" if legacy_from else ""
        lines.append(f"legacy: torch_npu {npu_version} (imported){ignored}")
    elif loaded is not None:
        lines.append(f"legacy: {loaded.origin}")
    elif rehearsal:
        lines.append(
            "legacy: shadow.npu.reference (--legacy-from reference: a rehearsal, our reading of torch_npu 2.12, "
            "checked bitwise against the source of 2.8.0-2.12.0)"
        )
    else:
        lines.append(
            "legacy: none for npu-shadow run: torch_npu is not importable here and no --legacy-from is given, so "
            "a job shadows only legacy patches it installs itself; --legacy-from reference rehearses on "
            "shadow.npu.reference, --legacy-from WHEEL compares torch_npu's own code (the self-test below uses "
            f"the reference){_cached_wheel_hint()}"
        )
    patches = loaded.patch_torch() if loaded is not None else None
    try:
        code, lines = _diagnose_shadowing(lines, port, addr, imported_npu)
        if code == 0:
            if imported_npu or loaded is not None or npu_version is not None:
                lines.append("ok: this host can shadow")
            elif rehearsal:
                lines.append("ok: this host can rehearse shadowing on shadow.npu.reference (--legacy-from reference)")
            else:
                lines.append(
                    "ok: this host can shadow with --legacy-from (reference, or a torch_npu wheel); npu-shadow run "
                    "without it shadows nothing here"
                )
        return code, lines
    finally:
        if patches is not None:
            patches.undo()


def _diagnose_shadowing(lines: list[str], port: int, addr: str, imported_npu: bool) -> tuple[int, list[str]]:
    active = targets.active_builtins()
    if active:
        lines.append("legacy patches active: " + ", ".join(f"{n} ({o})" for n, o in active.items()))
    else:
        origin = "torch_npu" if imported_npu else "shadow.npu.reference, as a rehearsal"
        lines.append(f"legacy patches active: none in this process (shadowing would use {origin})")

    accelerator = torch.accelerator.current_accelerator()
    version = _torch_version()
    needing = ", ".join(row.name for row in catalog.rows(catalog.SHADOWED) if row.needs == "accelerator")
    runs = {"": True, "accelerator": False, "npu_backend": hasattr(torch.nn.Module, "npu")}  # (torch generates it)
    if version < (2, 10):
        lines.append(f"{needing}: upstream needs torch >= 2.10 (torch.accelerator); every comparison would be an error")
    elif accelerator is None:
        lines.append(
            f"{needing} cannot run without an accelerator: upstream asserts one exists "
            "(not exercised here); `npu-shadow doctor --emulate-npu 2` and `npu-shadow run --emulate-npu 2` give "
            "this host two emulated npus that run torch's upstream"
        )
    else:
        runs["accelerator"] = True
        lines.append(f"{needing}: upstream can run on {accelerator.type}")
    if KNOWN_DEFECT_VERSIONS[0] <= version and (accelerator is None or accelerator.type != "cuda"):
        lines.append(
            "known shared defect: upstream parallel_apply and torch_npu's (up to 2.12) both read "
            "torch.is_autocast_enabled() without a device type (CUDA's state); on "
            f"{accelerator.type if accelerator else 'a non-CUDA accelerator'} both run the replicas without "
            "autocast, so shadowing reports a match under autocast (a defect of both, not a divergence); "
            "the single-device oracle (--oracle) counts it as a shared divergence"
        )
    shadowable = [row.name for row in catalog.rows(catalog.SHADOWED) if runs[row.needs]]
    for row in catalog.rows(catalog.CANARY):
        lines.append(
            f"{row.name} ({row.wrapped.strip('`')}, which cannot run twice): compared as a canary A/B, in a job run "
            "with --primary upstream"
        )
    busy = _port_free(addr, port)
    lines.append(f"prometheus port {addr}:{port}: " + ("free" if busy is None else f"cannot bind ({busy})"))
    ok, text = self_test()
    lines.append(f"self-test tensor_type: {'passed' if ok else 'FAILED'} ({text})")
    lines.append("can shadow here: " + ", ".join(shadowable))
    return (0 if ok and shadowable else 1), lines
