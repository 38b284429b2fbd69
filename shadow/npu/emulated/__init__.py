"""An emulated ``npu`` accelerator: a PrivateUse1 backend on host memory, so torch's real upstream
DataParallel code runs on a machine without an NPU or GPU.

``install(devices=2)`` compiles the C++ backend on first use (``torch.utils.cpp_extension``, about
25 s on 2 idle cores) into a cache directory outside the repository keyed by the torch version, the Python
ABI and the source's hash, loads it, renames PrivateUse1 to ``npu``, registers ``torch.npu`` and the
``npu`` tensor methods, and supplies the collectives CPU builds lack. Later calls, and later processes
that find the cached build (about 0.02 s), do the same without compiling.

Install it before the process's first ``Tensor.type(str)`` call: torch builds its table of tensor type
names once, and ``'torch.npu.*'`` names are valid only if the backend was named by then.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.resources
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from shadow.npu.device_properties import DeviceProperties
from shadow.npu.emulated import collectives, device, rnn

__all__ = [
    "DeviceProperties", "EmulatorUnavailable", "build", "build_directory", "host_syncs", "install", "installed_devices",
    "kernels", "leaf_statistics", "set_kernel_time", "set_memory_capacity", "set_nondeterministic", "set_properties",
    "set_tail",
]  # fmt: skip

EXTENSION_NAME = "npu_shadow_emulated_npu"
#: The C++ sources, one translation unit each: ninja compiles them side by side.
SOURCES = ("emulated_npu.cpp", "autocast_npu.cpp")

_lock = threading.Lock()
_devices = 0
_refusal: EmulatorUnavailable | None = None  # a refusal after the backend was named: every later install repeats it


def _check_type_names() -> None:
    """Refuse where torch's table of tensor type names was fixed before the backend was named npu: torch builds it
    at the process's first ``Tensor.type(str)`` call, and from then on would reject every 'torch.npu.*' name."""
    try:
        torch._C.TensorBase.type(torch.empty(0), "torch.npu.FloatTensor")
    except (ValueError, RuntimeError) as exc:
        raise EmulatorUnavailable(
            f"torch rejects 'torch.npu.FloatTensor' ({exc}): a Tensor.type(str) call ran in this process before "
            "emulated.install(), and torch fixed its tensor type names then, without npu's. Install the emulated "
            "npu before the process's first Tensor.type(str) call (npu-shadow run and the tests do it first)"
        ) from None


def _autograd_threads() -> int:
    """How many of the autograd engine's device threads (``pt_autograd_N``) this process has (Linux; 0 elsewhere)."""
    count = 0
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith("pt_autograd")
    return count


def _stop_autograd_threads(backend: Any, wait: float = 5.0) -> None:
    """At exit, while the interpreter is alive: stop the autograd engine's device threads and let them end (each
    needs the GIL once more, which sleeping gives it), so that none is still ending when the interpreter goes and
    aborts the process (see ``stop_autograd_threads`` in the C++ source)."""
    backend.stop_autograd_threads()
    deadline = time.monotonic() + wait
    while _autograd_threads() and time.monotonic() < deadline:
        time.sleep(0.001)


class EmulatorUnavailable(RuntimeError):
    """The emulated npu cannot be installed in this process; the message says why and what to do."""


def installed_devices() -> int:
    """How many emulated npu devices this process has (0 if it has not installed the emulator)."""
    return _devices


def _sources() -> dict[str, bytes]:
    folder = importlib.resources.files(__package__).joinpath("csrc")
    return {name: folder.joinpath(name).read_bytes() for name in SOURCES}


def _build_key() -> str:
    """What makes one build differ from another: the source, and what the compiler is given beside it (torch's
    and Python's headers, which live in each virtual environment, and the compiler). Two venvs sharing the cache
    get a build each instead of rebuilding each other's."""
    from torch.utils import cpp_extension

    parts = [
        *(hashlib.sha256(name.encode() + b"\0" + text).hexdigest() for name, text in _sources().items()),
        *cpp_extension.include_paths(),
        sysconfig.get_paths()["include"],
        os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "",
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_directory() -> Path:
    """Where the compiled backend is cached: ``$NPU_SHADOW_CACHE_DIR`` (default ``~/.cache/npu-shadow``),
    then one folder per torch version, Python ABI and build key (:func:`_build_key`)."""
    root = os.environ.get("NPU_SHADOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "npu-shadow"
    )
    abi = sysconfig.get_config_var("SOABI") or f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / "emulated_npu" / f"torch-{torch.__version__}-{abi}-{_build_key()}"


def is_built() -> bool:
    """Whether this torch and Python have a finished build in the cache (an install then only loads it)."""
    return _library(build_directory()).exists()


def _refuse_foreign_backend(devices: int) -> None:
    if "torch_npu" in sys.modules:
        raise EmulatorUnavailable(
            "torch_npu is imported: this process has the real npu backend; the emulated npu is for hosts without one"
        )
    name = torch._C._get_privateuse1_backend_name()
    if name != "privateuseone":
        raise EmulatorUnavailable(
            f"another PrivateUse1 backend is registered in this process ({name!r}); the emulated npu needs it free"
        )
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:
        raise EmulatorUnavailable(
            f"this process already has an accelerator ({accelerator.type}): no need to emulate one"
        )
    if not 1 <= devices <= 16:
        raise ValueError(f"devices must be an integer from 1 to 16, got {devices!r}")


def _ninja_directory() -> str | None:
    """Where a ninja executable is: PATH, else the ninja wheel's (a venv that is not activated)."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja
    except ImportError:
        raise EmulatorUnavailable(
            "ninja is not installed: 'pip install ninja' (needed to build the emulated npu)"
        ) from None
    return ninja.BIN_DIR


def _check_compiler() -> None:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        raise EmulatorUnavailable(
            f"no C++ compiler found ({compiler!r} or 'g++'): install one to build the emulated npu, "
            "e.g. 'apt-get install build-essential' on Debian or Ubuntu"
        )


def _library(build: Path) -> Path:
    return build / f"{EXTENSION_NAME}.so"


def _load() -> Any:
    """The compiled backend: imported straight from its published build (no build tool runs, no lock is
    waited on), built first where there is none."""
    if EXTENSION_NAME in sys.modules:
        return sys.modules[EXTENSION_NAME]
    build = build_directory()
    if not _library(build).exists():
        _build(build)
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, _library(build))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[EXTENSION_NAME] = module
    return module


#: How often a build in progress says it is still going.
PROGRESS_SECONDS = 10.0

_COMPILE = """
import sys
from torch.utils import cpp_extension
workspace, name, *sources = sys.argv[1:]
# (-O1: the backend is glue around torch's kernels; -O2 built a third slower, and 2,000 device ops and 100
# DataParallel steps took the same time with either)
paths = [f"{workspace}/{source}" for source in sources]
cpp_extension.load(name, paths, build_directory=workspace, extra_cflags=["-O1"])
"""


def _compile(workspace: Path) -> None:
    """Compile the backend in ``workspace``, in a process of its own (which imports what it built: this process
    imports only the published copy, once). Raises EmulatorUnavailable with the compiler's last words."""
    env = dict(os.environ)
    ninja_directory = _ninja_directory()
    if ninja_directory:
        env["PATH"] = ninja_directory + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryFile("w+") as said:  # (a file, not a pipe: a compiler's words never fill it and stall)
        compiling = subprocess.Popen(
            [sys.executable, "-c", _COMPILE, str(workspace), EXTENSION_NAME, *SOURCES],
            stdout=said, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        started = time.monotonic()
        while True:
            try:
                returncode = compiling.wait(PROGRESS_SECONDS)
                break
            except subprocess.TimeoutExpired:  # (a line every few seconds: a silent minute looks like a hang)
                print(f"npu-shadow: still building the emulated npu ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
        said.seek(0)
        words = said.read()
    if returncode != 0:
        raise EmulatorUnavailable(f"compiling the emulated npu failed: {words[-2000:]}")


def _build(build: Path) -> None:
    """Compile into a folder of this build's own and publish it by renaming it to ``build``: a folder under that
    name is always a finished build. Builders of the same key take turns (a lock the kernel releases when its
    holder dies); a load never takes it."""
    try:
        build.parent.mkdir(parents=True, exist_ok=True)
        with open(build.parent / f"{build.name}.flock", "a") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)  # (released by the kernel when this process ends, however it ends)
            if _library(build).exists():
                return  # another builder published it while this one waited
            workspace = Path(tempfile.mkdtemp(prefix=f".{build.name}.", dir=build.parent))
            try:
                for name, text in _sources().items():
                    (workspace / name).write_bytes(text)
                # (the one long step a first run has: said, so that a silent minute is not taken for a hang)
                print(
                    f"npu-shadow: building the emulated npu into {build.parent} (once per torch and Python: "
                    "about 25 s on 2 idle cores, minutes on a busy machine)",
                    file=sys.stderr,
                    flush=True,
                )
                started = time.monotonic()
                _compile(workspace)
                print(f"npu-shadow: emulated npu built in {time.monotonic() - started:.0f} s", file=sys.stderr)
                if build.exists():  # a folder an older layout left unfinished: replaced
                    shutil.rmtree(build)
                os.rename(workspace, build)
            finally:
                shutil.rmtree(workspace, ignore_errors=True)
    except EmulatorUnavailable:
        raise
    except Exception as exc:
        raise EmulatorUnavailable(f"building the emulated npu in {build} failed: {exc}") from exc


def build() -> Path:
    """Compile the backend into its cache now (a launcher does this once, before the job's processes
    start, so they only load it). Returns the build directory; raises :class:`EmulatorUnavailable`."""
    _check_compiler()
    build = build_directory()
    if not _library(build).exists():
        _build(build)
    return build


def set_memory_capacity(bytes_per_device: int) -> None:
    """Give each emulated device a memory capacity, as a real device has (0: the host's memory, unbounded): an
    allocation beyond it raises ``torch.OutOfMemoryError``, and ``torch.npu.mem_get_info`` answers from it. The
    emulated npu must be installed."""
    if isinstance(bytes_per_device, bool) or not isinstance(bytes_per_device, int) or bytes_per_device < 0:
        raise ValueError(f"a memory capacity is a whole number of bytes >= 0, got {bytes_per_device!r}")
    _installed_backend().set_memory_capacity(bytes_per_device)


def set_kernel_time(seconds: float) -> None:
    """Make the emulated npu's work asynchronous, as a device's is (0: work is done when the call returns): each
    kernel is queued on its stream and takes ``seconds`` of device time there, and a host read of the device (a
    copy to the host, ``.item()``, a synchronize, an event's synchronize) waits until the work queued before it is
    done. The values are computed at once; what is emulated is which host reads wait, and how long
    (:func:`host_syncs` counts them per thread, with the queue off too)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1:
        raise ValueError(f"a kernel time is a number of seconds in [0, 1), got {seconds!r}")
    _installed_backend().set_kernel_time(float(seconds))


def set_nondeterministic(relative: float) -> None:
    """Make the emulated npu's reductions nondeterministic, as a device's atomics and run-time algorithm choices
    are (0: off): convolutions and backward's reductions vary each element of their result by up to ``relative``
    of it, from a generator of the emulator's own (never the job's), unless
    ``torch.use_deterministic_algorithms(True)`` is on."""
    if isinstance(relative, bool) or not isinstance(relative, (int, float)) or not 0 <= relative < 1:
        raise ValueError(f"a nondeterministic variation is a relative size in [0, 1), got {relative!r}")
    _installed_backend().set_nondeterministic(float(relative))


def set_tail(sigma: float) -> None:
    """Give the nondeterministic reductions a heavy tail (0: off): each kernel's variation is the relative size of
    :func:`set_nondeterministic` times a lognormal(0, ``sigma``) draw of its own (1.5: most calls a fraction of it,
    one in fifty beyond 20 times their median), as a device's spread varies from call to call."""
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma <= 5:
        raise ValueError(f"a nondeterministic tail is a lognormal's sigma in [0, 5], got {sigma!r}")
    _installed_backend().set_tail(float(sigma))


def host_syncs() -> tuple[int, int]:
    """(host synchronizations, device-to-host copies) the calling thread has made on the emulated npu since it
    started: every wait for the device (a blocking copy either way, a scalar read, an op whose result the host
    must see, a synchronize) and every copy to the host. The counterpart of ``torch.cuda.set_sync_debug_mode``."""
    syncs, copies = _installed_backend().host_syncs()
    return int(syncs), int(copies)


def kernels() -> int:
    """The kernels the calling thread has queued on the emulated npu since it started (an op on npu tensors, a copy
    onto a device, a kernel of ours such as :func:`leaf_statistics`; what a kernel does inside itself is not counted
    again), with the queue off too: what a test counts where a device's profiler would."""
    return int(_installed_backend().kernels())


def leaf_statistics(
    legacy: torch.Tensor, upstream: torch.Tensor, rtol: float, atol: float, equal_nan: bool, bitwise: bool, wide: bool
) -> torch.Tensor:
    """npu-shadow's comparator statistics of two flat tensors on one emulated npu device, as one kernel of the
    device (queued on the current stream, no host read): int64[8], the layout of
    ``shadow.core.judging.compare``'s statistics, computed in float64 where ``wide`` else float32; ``bitwise``: the
    two have the same dtype and their bits are compared too."""
    return _installed_backend().leaf_statistics(legacy, upstream, rtol, atol, equal_nan, bitwise, wide)


def _installed_backend() -> Any:
    if not _devices:
        raise EmulatorUnavailable("the emulated npu is not installed: install() first")
    return device._backend


def set_properties(properties: DeviceProperties) -> None:
    """Give the installed emulated npu a device's ``properties`` (those left at 0 are off)."""
    set_memory_capacity(properties.capacity)
    set_kernel_time(properties.kernel_time)
    set_nondeterministic(properties.nondeterministic)
    set_tail(properties.tail)


def install(devices: int = 2, seed: int = 67280421310721) -> int:
    """Give this process ``devices`` emulated npu devices; returns the count. Idempotent.

    Raises :class:`EmulatorUnavailable` when torch_npu is imported, another PrivateUse1 backend or an
    accelerator is present, or no C++ toolchain can build the backend; ``ValueError`` for a bad count
    or a second install asking for another count.
    """
    global _devices, _refusal
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(f"devices must be an integer from 1 to 16, got {devices!r}")
    with _lock:
        if _devices:
            if devices != _devices:
                raise ValueError(f"the emulated npu is installed with {_devices} devices; cannot change to {devices}")
            return _devices
        if _refusal is not None:
            raise _refusal
        _refuse_foreign_backend(devices)
        _check_compiler()
        backend = _load()
        backend.install(devices, seed)
        atexit.register(_stop_autograd_threads, backend)
        torch.utils.rename_privateuse1_backend("npu")
        device._bind(backend)
        torch._register_device_module("npu", device)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        collectives.provide_missing()
        rnn.register()
        try:
            _check_type_names()
        except EmulatorUnavailable as exc:
            _refusal = exc
            raise
        _devices = devices
        return devices
