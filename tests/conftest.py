import importlib
import os
import sys

import pytest
import torch

from shadow.npu import emulated, reference, torch_npu_source

HERE = os.path.dirname(__file__)

FAKE_TORCH_NPU = os.path.join(HERE, "fake_torch_npu")
sys.path.insert(0, HERE)  # for the helper modules beside the tests

pytest_plugins = ["ci_skips", "tiers", "pytester"]


def pytest_configure(config):
    """Every test process has a 2-device emulated npu, installed before any test module is imported (torch
    fixes its tensor type names at the first Tensor.type(str) call). The first run builds it (~45 s)."""
    emulated.install(devices=2)


def pytest_terminal_summary(terminalreporter):
    """A loud line where differential tests skipped for want of a torch_npu wheel."""
    from torch_npu_wheels import summary_line

    line = summary_line()
    if line is not None:
        terminalreporter.write_line(line, red=True, bold=True)


def _patched_objects():
    parallel = importlib.import_module("torch.nn.parallel")
    dataloader = importlib.import_module("torch.utils.data.dataloader")
    return (
        vars(torch.Tensor).get("type"),
        vars(torch.Tensor).get("type_raw"),
        torch.nn.DataParallel.parallel_apply,
        parallel.data_parallel,
        torch.load,
        vars(torch.nn.Module).get("to"),
        vars(torch.nn.Module).get("npu"),
        vars(torch.nn.Module).get("cast_weight"),
        vars(dataloader._MultiProcessingDataLoaderIter).get("__init__"),
        importlib.import_module("torch.optim.optimizer")._get_foreach_kernels_supported_devices,
        vars(torch.Tensor).get("__repr__"),
        torch.save,
        torch.serialization.save,
        torch.serialization._save,
        torch.serialization._legacy_save,
        vars(torch.UntypedStorage).get("cpu"),
        vars(torch.TypedStorage).get("_deepcopy"),
    )


@pytest.fixture(autouse=True)
def torch_left_as_found():
    """Every test must leave torch's patched attributes exactly as it found them."""
    before = _patched_objects()
    yield
    after = _patched_objects()
    assert all(a is b for a, b in zip(before, after)), "a test left torch patched"


@pytest.fixture(scope="session")
def torch_npu_legacy():
    """torch_npu 2.12.0's own legacy functions, from its wheel's source (skips when the wheel is not cached)."""
    from torch_npu_wheels import wheel

    return torch_npu_source.load(wheel("2.12.0"))


@pytest.fixture(params=["reference", "torch_npu 2.12.0 source"])
def legacy_patches(request):
    """torch patched with each legacy in turn: shadow.npu.reference's, and torch_npu 2.12.0's own code."""
    if request.param == "reference":
        patches = reference.patch_torch()
    else:
        patches = request.getfixturevalue("torch_npu_legacy").patch_torch()
    try:
        yield request.param
    finally:
        patches.undo()


@pytest.fixture
def fake_torch_npu():
    """Import a fake torch_npu that patches torch like the real one; undo it afterwards."""
    sys.path.insert(0, FAKE_TORCH_NPU)
    try:
        module = importlib.import_module("torch_npu")
        yield module
    finally:
        if "torch_npu" in sys.modules:
            sys.modules["torch_npu"]._unpatch()
        for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
            del sys.modules[name]
        sys.path.remove(FAKE_TORCH_NPU)


@pytest.fixture(scope="module")
def legacy_213() -> torch_npu_source.TorchNpuLegacy:
    """torch_npu 2.13.0's own legacy, read from its wheel (not installed)."""
    from torch_npu_wheels import wheel

    return torch_npu_source.load(wheel("2.13.0"))


def installed(legacy: torch_npu_source.TorchNpuLegacy):
    """``legacy`` patched onto torch while the fixture using this lives."""
    patches = legacy.patch_torch()
    try:
        yield legacy
    finally:
        patches.undo()


@pytest.fixture
def patched(legacy_213: torch_npu_source.TorchNpuLegacy):
    """torch with torch_npu 2.13.0's patches installed, for one test."""
    yield from installed(legacy_213)
