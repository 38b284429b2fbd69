"""How far one sampled call travels through the project's code on the caller's thread.

Every Python call on the caller's thread is followed (``sys.setprofile``); a call counts where its code lives in
the project (``shadow/``, ``exporters/``), and the path is the sequence of those calls' files, a file repeated in a
row counted once. Reported for one sampled ``x.type(torch.float16)`` and one
sampled ``DataParallel.parallel_apply`` on the emulated npu, at ``shadow.install``'s defaults (each after a warm-up
call, so imports and first-call caches are not counted):

- files: the project files the call entered;
- functions: the project functions it called (distinct);
- switches: how often the path moves to another file;
- returns: the moves back to a file the path had left (switches less the first entries: files - 1).

The review that asked for this counted the same way (a profiler hook over the project's files); the goal for one
sampled ``.type()`` is at most 20 files and 30 returns.

Run: ``python benchmarks/call_path.py`` (prints the calls' figures, ``.type()`` with and without an exporter
attached; ``--list`` also lists the files).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT = tuple(os.path.join(ROOT, part) + os.sep for part in ("shadow", "exporters"))


@dataclasses.dataclass
class Path:
    """What one call crossed: the files (in the order first entered), functions, switches and returns above."""

    files: list[str] = dataclasses.field(default_factory=list)
    functions: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    switches: int = 0
    returns: int = 0

    def line(self, name: str) -> str:
        return (
            f"{name}: {len(self.files)} files, {len(self.functions)} functions, {self.switches} file switches, "
            f"{self.returns} returns to a file already left"
        )


#: The emulated npu stands in for a device's own runtime (torch_npu's C++ on an NPU, CUDA's on a GPU): a call into it
#: (``torch.npu.max_memory_allocated``, say) is the device's, not a step of the tool's call path.
_DEVICE = os.path.join(ROOT, "shadow", "npu", "emulated") + os.sep


def _project_file(filename: str) -> str | None:
    if not filename.startswith(_PROJECT) or filename.startswith(_DEVICE):
        return None
    return os.path.relpath(filename, ROOT)


def follow(call: Callable[[], object]) -> Path:
    """The path ``call()`` takes through the project's files on this thread: the project files of its calls, in
    the order they are made, a file repeated in a row counted once."""
    path = Path()
    thread = threading.get_ident()
    last: list[str] = []

    def profile(frame, event, _arg):
        if event != "call" or threading.get_ident() != thread:
            return
        file = _project_file(frame.f_code.co_filename)
        if file is None:
            return
        path.functions.add((file, frame.f_code.co_firstlineno))
        if last and last[0] == file:
            return
        if last:
            path.switches += 1
            path.returns += file in path.files
        if file not in path.files:
            path.files.append(file)
        last[:] = [file]

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return path


def tensor_type(exporters: tuple = ()) -> Path:
    """One sampled ``x.type(torch.float16)`` (legacy: our reading of torch_npu's patch), told to ``exporters``."""
    import shadow
    from shadow.npu import reference

    torch.Tensor.type = reference.npu_type
    try:
        with shadow.install(["tensor_type"], sample_rate=1.0, exporters=list(exporters)):
            x = torch.ones(4, 4)
            x.type(torch.float16)  # (warm-up)
            return follow(lambda: x.type(torch.float16))
    finally:
        del torch.Tensor.type


def parallel_apply() -> Path:
    """One sampled ``DataParallel.parallel_apply`` over two emulated npu devices."""
    import shadow
    from shadow.npu import emulated, reference

    emulated.install(devices=2)
    before = torch.nn.DataParallel.parallel_apply
    torch.nn.DataParallel.parallel_apply = reference.npu_parallel_apply
    try:
        with shadow.install(["parallel_apply"], sample_rate=1.0):
            dp = torch.nn.DataParallel(torch.nn.Linear(8, 4).to("npu:0"), device_ids=[0, 1])
            x = torch.randn(4, 8, device="npu:0")
            dp(x)  # (warm-up)
            replicas = dp.replicate(dp.module, dp.device_ids)
            inputs, kwargs = dp.scatter((x,), {}, dp.device_ids)
            return follow(lambda: dp.parallel_apply(replicas, inputs, kwargs))
    finally:
        torch.nn.DataParallel.parallel_apply = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the files each call entered")
    listing = parser.parse_args().list
    from exporters.prometheus import PrometheusExporter

    with_exporter = ("sampled .type() with a Prometheus exporter", lambda: tensor_type((PrometheusExporter(),)))
    for name, measure in (("sampled .type()", tensor_type), with_exporter, ("sampled parallel_apply", parallel_apply)):
        path = measure()
        print(path.line(name))
        if listing:
            print("\n".join(f"  {file}" for file in path.files))


if __name__ == "__main__":
    main()
