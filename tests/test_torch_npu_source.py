"""torch_npu's own legacy code, loaded from its wheels, against our reference: bitwise, on the emulated npu.

The test command fetches the five torch_npu releases that carry the patches into a cache outside the repository
(``shadow.npu.wheels.wheel_cache()``); without access to the package index these tests skip, saying so.
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.parallel import replicate
from torch.utils._pytree import tree_flatten
from torch_npu_wheels import wheel

from shadow.core.judging.compare import compare
from shadow.npu import reference, torch_npu_source, wheels
from shadow.npu.tensor_types import NPU_TENSOR_TYPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RELEASES = wheels.RELEASES
pytestmark = [
    pytest.mark.skipif(torch.accelerator.current_accelerator() is None, reason="needs the emulated npu"),
    pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0"),
]


@pytest.fixture(scope="module", params=RELEASES)
def legacy(request: pytest.FixtureRequest) -> torch_npu_source.TorchNpuLegacy:
    return torch_npu_source.load(wheel(request.param))


@pytest.fixture(autouse=True)
def type_raw(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_npu's _npu_type calls self.type_raw, which its patch sets to the original Tensor.type."""
    monkeypatch.setattr(torch.Tensor, "type_raw", torch._C.TensorBase.type, raising=False)
    index = torch.accelerator.current_device_index()
    yield
    torch.accelerator.set_device_index(index)


# --------------------------------------------------------------------------- agreement


_TIME = re.compile(r"\d{4}-\d\d-\d\d-\d\d:\d\d:\d\d")


def _message(exc: BaseException) -> str:
    """An exception's text without what differs between two runs of the same code: the time in torch_npu's
    error suffix, and the file and line of the frames in a worker's traceback."""
    text = _TIME.sub("TIME", str(exc))
    if "Original Traceback" in text:
        lines = text.splitlines()
        text = f"{lines[0]} ... {lines[-1]}"
    return text


def run(fn: Callable, *args: Any, **kwargs: Any) -> tuple:
    """(result or exception, current device after the call)."""
    rng = torch.get_rng_state(), torch.npu.get_rng_state_all()
    try:
        result: Any = fn(*args, **kwargs)
    except Exception as exc:
        result = exc
    finally:
        after = torch.accelerator.current_device_index()
        torch.set_rng_state(rng[0])
        torch.npu.set_rng_state_all(rng[1])
    return result, after


def disagreement(ours: tuple, theirs: tuple, inputs: Any = ()) -> str | None:
    """Why two runs differ, bit for bit (None when they agree)."""
    (a, device_a), (b, device_b) = ours, theirs
    if device_a != device_b:
        return f"current device after the call: reference {device_a}, torch_npu {device_b}"
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        if type(a) is not type(b) or _message(a) != _message(b):
            return f"reference {a!r} vs torch_npu {b!r}"
        return None
    comparison = compare(a, b, exact=True, legacy_inputs=inputs, upstream_inputs=inputs)
    if comparison.outcome != "match":
        return comparison.detail
    for x, y in zip(tree_flatten(a)[0], tree_flatten(b)[0]):
        if isinstance(x, torch.Tensor) and (x.stride(), x.requires_grad) != (y.stride(), y.requires_grad):
            return f"stride/requires_grad {x.stride()}/{x.requires_grad} vs {y.stride()}/{y.requires_grad}"
    return None


# --------------------------------------------------------------------------- Tensor.type


NPU_NAMES = [f"{p}.{n}" for p in ("torch.npu", "torch_npu.npu") for n in NPU_TENSOR_TYPES]
OTHER_NAMES = ["torch.FloatTensor", "torch.HalfTensor", "torch.cuda.FloatTensor", "torch.npu.Nothing", "float", ""]
OTHER_CLASSES = [torch.FloatTensor, torch.LongTensor, torch.Tensor, int]
BAD_VALUES = [3, 2.5, [torch.float16], object(), b"torch.npu.FloatTensor"]


def type_arguments() -> list[Any]:
    npu_classes = [getattr(torch.npu, name) for name in NPU_TENSOR_TYPES]
    dtypes = [torch.float16, torch.float64, torch.int32, torch.bool, torch.bfloat16]
    return [None, *dtypes, *NPU_NAMES, *OTHER_NAMES, *npu_classes, *OTHER_CLASSES, *BAD_VALUES]


def source_tensor(rng: random.Random, device: str) -> torch.Tensor:
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
    base = (torch.randn(2, 3, 4, 5) * 10).to(dtype).to(device)
    layout = rng.choice(["contiguous", "transposed", "channels_last", "expanded", "sliced"])
    if layout == "transposed":
        return base.transpose(1, 3)
    if layout == "channels_last":
        return base.contiguous(memory_format=torch.channels_last)
    if layout == "expanded":
        return base[:, :1].expand(2, 3, 4, 5)
    if layout == "sliced":
        return base[:, 1:, ::2]
    return base


def test_tensor_type_agrees_with_torch_npu(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    rng = random.Random(f"tensor_type {legacy.version}")
    arguments = type_arguments()
    calls = [
        (arg, device, current, nb)
        for arg in arguments
        for device in ("cpu", "npu:0", "npu:1")
        for current in (0, 1)
        for nb in (False, True)
    ]
    rng.shuffle(calls)
    differences = []
    for arg, device, current, non_blocking in calls[:400] + [c for c in calls if c[0] in NPU_NAMES[:2]]:
        tensor = source_tensor(rng, device)
        torch.accelerator.set_device_index(current)
        ours = run(reference.npu_type, tensor, arg, non_blocking)
        torch.accelerator.set_device_index(current)
        theirs = run(legacy.tensor_type, tensor, arg, non_blocking)
        why = disagreement(ours, theirs, inputs=tensor)
        if why:
            differences.append(f".type({arg!r}, non_blocking={non_blocking}) of {device} with current {current}: {why}")
    assert not differences, "\n".join(differences[:10])


def test_tensor_type_tables_agree(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    assert set(legacy.tensor_types) == set(reference.NPU_TYPE_NAMES)
    for name, cls in legacy.tensor_types.items():
        assert cls is getattr(torch.npu, name.rpartition(".")[2])
        assert reference.npu_type_dtype(name) == reference.npu_type_dtype(cls) == cls.dtype


# --------------------------------------------------------------------------- parallel_apply, data_parallel


class Net(torch.nn.Module):
    """A small CNN with dropout (RNG on each replica's device), keyword arguments and a failure on request."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.drop = torch.nn.Dropout(0.25)
        self.head = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor, scale: float = 1.0, fail_on: int = -1, as_dict: bool = False) -> Any:
        if x.device.index == fail_on:
            raise ValueError(f"replica on {x.device} refuses")
        y = self.head(self.drop(torch.relu(self.conv(x))).flatten(1)) * scale
        return {"logits": y, "mean": y.mean()} if as_dict else y


def dp_call(rng: random.Random, net: Net) -> dict[str, Any]:
    replicas = rng.choice([1, 2])
    kwargs: dict[str, Any] = rng.choice([{}, {"scale": 0.5}, {"as_dict": True}, {"fail_on": 1}, {"fail_on": 0}])
    return {
        "replicas": replicas,
        "kwargs": kwargs,
        "grad": rng.random() < 0.5,
        "autocast": rng.choice([None, torch.float16, torch.bfloat16]),
        "current": rng.choice([0, 1]),
        "train": rng.random() < 0.5,
        "devices_given": rng.random() < 0.8,
        "mismatch": rng.choice([None] * 6 + ["inputs", "kwargs", "devices"]),
    }


def _under(call: dict, fn: Callable, *args: Any) -> tuple:
    torch.accelerator.set_device_index(call["current"])
    with (
        torch.set_grad_enabled(call["grad"]),
        torch.autocast("npu", dtype=call["autocast"] or torch.float16, enabled=call["autocast"] is not None),
    ):
        return run(fn, *args)


def test_parallel_apply_agrees_with_torch_npu(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    rng = random.Random(f"parallel_apply {legacy.version}")
    torch.manual_seed(0)
    net = Net().to("npu:0")
    differences = []
    for _ in range(60):
        call = dp_call(rng, net)
        net.train(call["train"])
        devices = list(range(call["replicas"]))
        replicas = replicate(net, devices)
        inputs = [(torch.randn(2, 3, 6, 6, device=f"npu:{d}"),) for d in devices]
        kwargs_tup = [dict(call["kwargs"]) for _ in devices] if call["kwargs"] else None
        given = devices if call["devices_given"] else None
        if call["mismatch"] == "inputs":
            inputs = inputs[:-1] if len(inputs) > 1 else inputs * 2
        elif call["mismatch"] == "kwargs":
            kwargs_tup = [{}] * (len(devices) + 1)
        elif call["mismatch"] == "devices":
            given = [*devices, 0]
        ours = _under(call, reference.parallel_apply, replicas, inputs, kwargs_tup, given)
        theirs = _under(call, legacy.parallel_apply_function, replicas, inputs, kwargs_tup, given)
        why = disagreement(ours, theirs, inputs)
        if why:
            differences.append(f"{call}: {why}")
    assert not differences, "\n".join(differences[:10])


def test_data_parallel_agrees_with_torch_npu(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    rng = random.Random(f"data_parallel {legacy.version}")
    torch.manual_seed(1)
    differences = []
    for _ in range(40):
        call = dp_call(rng, None)
        where = rng.choice(["npu:0"] * 5 + ["npu:1", "cpu"])
        net = Net().to(where).train(call["train"])
        device_ids = rng.choice([None, [0], [0, 1], [torch.device("npu", 0), torch.device("npu", 1)]])
        output_device = rng.choice([None, None, 1])
        batch = torch.randn(rng.choice([1, 3, 4]), 3, 6, 6, device=rng.choice(["npu:0", "cpu"]))
        module_kwargs = dict(call["kwargs"]) or None
        args = (net, batch, device_ids, output_device, 0, module_kwargs)
        ours = _under(call, reference.npu_data_parallel, *args)
        theirs = _under(call, legacy.data_parallel, *args)
        why = disagreement(ours, theirs, batch)
        if why:
            differences.append(f"{call} on {where}, device_ids={device_ids}, output_device={output_device}: {why}")
    assert not differences, "\n".join(differences[:10])


def test_npu_parallel_apply_is_the_method_form(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    net = Net().to("npu:0").eval()
    dp = torch.nn.DataParallel(net, device_ids=[0, 1])
    replicas = replicate(net, [0, 1])
    inputs = [(torch.randn(2, 3, 6, 6, device=f"npu:{d}"),) for d in (0, 1)]
    assert (
        disagreement(
            run(reference.npu_parallel_apply, dp, replicas, inputs, None),
            run(legacy.parallel_apply, dp, replicas, inputs, None),
        )
        is None
    )


# --------------------------------------------------------------------------- the loader itself


def test_loaded_functions_say_where_they_come_from() -> None:
    path = wheel("2.12.0")
    loaded = torch_npu_source.load(path)
    assert loaded.version == "2.12.0"
    assert loaded.origin == f"torch_npu 2.12.0 source (from {path})"
    assert torch_npu_source.origin_of(loaded.tensor_type) == "torch_npu 2.12.0 source"
    assert torch_npu_source.origin_of(reference.npu_type) is None
    assert "torch_npu" not in sys.modules  # read, never imported


def test_a_source_without_the_patch_fails_naming_it_and_the_version(tmp_path: Any) -> None:
    with zipfile.ZipFile(wheel("2.12.0")) as original, zipfile.ZipFile(tmp_path / "cut.whl", "w") as cut:
        for item in original.infolist():
            if item.filename.startswith("torch_npu/") and not item.filename.endswith((".so", ".py")):
                continue
            data = original.read(item)
            if item.filename == "torch_npu/utils/_module.py":
                data = data.replace(b"def npu_data_parallel(", b"def renamed_data_parallel(")
            if item.filename.endswith(".py") or "dist-info" in item.filename:
                cut.writestr(item, data)
    loaded = torch_npu_source.load(tmp_path / "cut.whl")  # (the release lacks that target, and says why)
    assert loaded.data_parallel is None and loaded.parallel_apply is not None
    assert re.search(r"torch_npu 2\.12\.0 .*_module\.py has no 'npu_data_parallel'", loaded.missing["data_parallel"])


def test_a_source_with_none_of_the_patches_fails_naming_each(tmp_path: Any) -> None:
    with zipfile.ZipFile(wheel("2.12.0")) as original, zipfile.ZipFile(tmp_path / "cut.whl", "w") as cut:
        for item in original.infolist():
            patched = {patch.member for patch in torch_npu_source.PATCHES}
            if (item.filename.endswith(".py") and item.filename not in patched) or "dist-info" in item.filename:
                cut.writestr(item, original.read(item))
    with pytest.raises(torch_npu_source.LegacySourceError, match=r"torch_npu 2\.12\.0 .* has none of the patches") as e:
        torch_npu_source.load(tmp_path / "cut.whl")
    for patch in torch_npu_source.PATCHES:
        assert f"{patch.target}: " in str(e.value)
    with pytest.raises(torch_npu_source.LegacySourceError, match="defines none of the patches"):
        torch_npu_source.check(tmp_path / "cut.whl")


def test_paths_that_hold_no_torch_npu_are_refused(tmp_path: Any) -> None:
    (tmp_path / "not-a-wheel.whl").write_text("hello")
    with pytest.raises(torch_npu_source.LegacySourceError, match="neither a torch_npu wheel"):
        torch_npu_source.load(tmp_path / "not-a-wheel.whl")
    with pytest.raises(torch_npu_source.LegacySourceError, match="no torch_npu wheel or torch_npu package"):
        torch_npu_source.load(tmp_path)


def test_an_unpacked_package_loads_and_its_module_code_never_runs(tmp_path: Any) -> None:
    """A site-packages directory works too; the package's own module-level code (here a marker that would
    write a file) never runs: only the patch definitions are executed."""
    with zipfile.ZipFile(wheel("2.11.0")) as original:
        original.extractall(tmp_path, [n for n in original.namelist() if n.endswith(".py") or "dist-info" in n])
    marker = tmp_path / "ran"
    module = tmp_path / "torch_npu/utils/_module.py"
    module.write_text(f"open({str(marker)!r}, 'w').close()\n" + module.read_text())
    loaded = torch_npu_source.load(tmp_path)
    assert loaded.version == "2.11.0"
    assert not marker.exists()


@pytest.mark.slow
def test_without_an_accelerator_loading_fails_saying_why() -> None:
    script = (
        "import torch\nfrom shadow.npu import torch_npu_source as s\n"
        f"try:\n    s.load({wheel('2.12.0')!r})\nexcept s.LegacySourceError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "needs an accelerator" in done.stdout, done.stderr


def test_where_the_accelerator_is_not_an_npu_its_name_and_module_stand_in(monkeypatch) -> None:
    """On a CUDA host torch_npu's code sees torch.cuda as torch.npu and reads the device string 'npu' as 'cuda'.
    Shown with a stand-in accelerator named 'cpu' whose device module is the emulated npu's."""
    from shadow.npu import legacy_host

    monkeypatch.setattr(legacy_host, "device_module", lambda: ("cpu", torch.npu))
    loaded = torch_npu_source.load(wheel("2.12.0"))
    cast = loaded.tensor_type(torch.ones(2, device="npu:1"), "torch.npu.HalfTensor")
    assert cast.device == torch.device("cpu") and cast.dtype == torch.float16  # device='npu' read as 'cpu'
    seen = loaded.parallel_apply_function.__globals__["torch"]
    assert seen is not torch and seen.npu.set_device is torch.npu.set_device and seen.float16 is torch.float16
    assert seen.npu.get_mm_bmm_format_nd() and seen.npu.is_jit_compile_false()  # (torch_npu's defaults)


def _code_in(code: Any, name: str) -> Any:
    """The code object of the function ``name`` defined at the top of a module's code."""
    return next((c for c in code.co_consts if hasattr(c, "co_name") and c.co_name == name), None)


def _same_code(first: Any, second: Any) -> bool:
    """Equal bytecode, names and constants, nested code objects compared the same way."""
    if (first.co_code, first.co_names, first.co_varnames) != (second.co_code, second.co_names, second.co_varnames):
        return False
    if len(first.co_consts) != len(second.co_consts):
        return False
    for a, b in zip(first.co_consts, second.co_consts):
        if hasattr(a, "co_code") and hasattr(b, "co_code"):
            if not _same_code(a, b):
                return False
        elif a != b or type(a) is not type(b):
            return False
    return True


def test_each_loaded_function_is_the_wheels_own_bytecode(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    """The loader compiles torch_npu's source with torch_npu's compiler flags, not its own (this module and the
    loader both use ``from __future__ import annotations``, which would turn annotations into strings)."""
    with zipfile.ZipFile(wheel(legacy.version)) as archive:
        sources = {m: archive.read(f"torch_npu/utils/{m}.py").decode() for m in ("_module", "tensor_methods")}
    plain = {m: compile(text, m, "exec", dont_inherit=True) for m, text in sources.items()}
    loaded = {
        ("tensor_methods", "_npu_type"): legacy.tensor_type,
        ("_module", "npu_parallel_apply"): legacy.parallel_apply,
        ("_module", "npu_data_parallel"): legacy.data_parallel,
        ("_module", "_parallel_apply"): legacy.parallel_apply_function,
    }
    for (member, name), function in loaded.items():
        assert _same_code(function.__code__, _code_in(plain[member], name)), name


def test_legacys_device_and_stream_code_is_torch_npus_own(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    """torch.npu.set_device, device, stream, current_stream, Stream... as the patches call them are torch_npu's own
    runtime Python (torch_npu/npu/utils.py, streams.py), compiled as the wheel has it, never a re-implementation."""
    with zipfile.ZipFile(wheel(legacy.version)) as archive:
        tables = {**torch_npu_source.RUNTIME, **torch_npu_source.RUNTIME_WHERE_PRESENT}
        plain = {
            member: compile(archive.read(member).decode(), member, "exec", dont_inherit=True)
            for member in tables
            if member in archive.namelist()
        }
    present = {
        member: tuple(n for n in names if member in plain and _code_in(plain[member], n) is not None)
        for member, names in torch_npu_source.RUNTIME_WHERE_PRESENT.items()
    }
    # (what the patches call, stated here apart from the loader's tables: torch.npu's device and stream functions,
    # and the two npu_config switches of the releases whose npu_config.py defines them)
    always = {"set_device", "current_device", "device", "synchronize", "stream", "set_stream", "current_stream",
              "default_stream", "_get_device_index", "Stream", "Event"}  # fmt: skip
    config = "torch_npu/npu/npu_config.py"
    switches = {n for n in ("get_mm_bmm_format_nd", "is_jit_compile_false")
                if config in plain and _code_in(plain[config], n) is not None}  # fmt: skip
    assert set(legacy.runtime) == always | switches
    compared = 0
    for member, names in {**torch_npu_source.RUNTIME, **present}.items():
        for name in names:
            loaded, code = legacy.runtime[name], _code_in(plain[member], name)
            functions = (
                {name: loaded}
                if not isinstance(loaded, type)
                else {n: f for n, f in vars(loaded).items() if hasattr(f, "__code__")}
            )
            for function_name, function in functions.items():
                expected_code = code if not isinstance(loaded, type) else _code_in(code, function_name)
                assert _same_code(function.__code__, expected_code), f"{member}: {name}.{function_name}"
                compared += 1
    assert compared > 20
    # the functions the patch calls are these: torch.npu as _parallel_apply sees it
    npu = legacy.parallel_apply_function.__globals__["torch"].npu
    for name in ("set_device", "current_stream", "device", "stream", "Stream"):
        assert getattr(npu, name) is legacy.runtime[name]


def test_legacy_runs_over_torch_npus_thread_local_device(legacy: torch_npu_source.TorchNpuLegacy) -> None:
    """The emulator's torch_npu._C keeps the device as torch_npu's NPUFunctions.cpp does: per thread, -1 until set
    (_npu_getLocalDevice); torch_npu's ``device`` context then leaves a thread that had none on device 0, its own
    behaviour, which a re-implementation over torch.accelerator cannot show."""
    from shadow.npu.emulated import torch_npu_c

    seen: dict[str, Any] = {}

    def fresh_thread() -> None:
        seen["before"] = torch_npu_c._npu_getLocalDevice()
        with legacy.runtime["device"](1):
            seen["inside"] = (torch_npu_c._npu_getLocalDevice(), torch.accelerator.current_device_index())
        seen["after"] = torch_npu_c._npu_getLocalDevice()
        legacy.runtime["set_device"]("npu:1")
        seen["set"] = torch.accelerator.current_device_index()
        stream = legacy.runtime["Stream"](device=0)
        with legacy.runtime["stream"](stream):
            seen["stream"] = torch.accelerator.current_stream(0).stream_id == stream.stream_id
        seen["left"] = (torch.accelerator.current_device_index(), torch.accelerator.current_stream(0).stream_id)

    main_device = torch.accelerator.current_device_index()
    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert seen == {"before": -1, "inside": (1, 1), "after": 0, "set": 1, "stream": True, "left": (1, 0)}
    assert torch.accelerator.current_device_index() == main_device  # another thread's device is its own


def test_legacy_parallel_apply_sets_each_workers_device_through_torch_npus_c(
    legacy: torch_npu_source.TorchNpuLegacy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RFC's difference (legacy calls torch.npu.set_device in each worker) runs through torch_npu's own
    set_device into torch_npu._C._npu_setDevice, where a real NPU's runtime would see it."""
    from shadow.npu.emulated import torch_npu_c

    calls: list[tuple[str, int]] = []
    original = torch_npu_c._npu_setDevice

    def recording(device: int) -> None:
        calls.append((threading.current_thread().name, device))
        original(device)

    monkeypatch.setattr(torch_npu_c, "_npu_setDevice", recording)
    module = torch.nn.Linear(3, 2).to("npu:0")
    replicas = replicate(module, [0, 1])
    inputs = [(torch.randn(4, 3, device=f"npu:{i}"),) for i in (0, 1)]
    outputs = legacy.parallel_apply_function(replicas, inputs, None, [0, 1])
    assert [o.device.index for o in outputs] == [0, 1]
    assert sorted(device for _, device in calls) == [0, 1]
    assert all(name != threading.current_thread().name for name, _ in calls)  # in the worker threads


def _fetch(tmp_path: Any, ci: str, *versions: str) -> subprocess.CompletedProcess:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
        "NPU_SHADOW_WHEEL_DIR": str(tmp_path / "wheels"),
        "PIP_CONFIG_FILE": os.devnull,  # no index, no local wheel folder: nothing can be fetched
        "PIP_NO_INDEX": "1",
        "CI": ci,
    }
    return subprocess.run(
        ["bash", "scripts/fetch_torch_npu.sh", *versions], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_a_wheel_that_cannot_be_fetched_fails_ci_and_is_said_elsewhere(tmp_path: Any) -> None:
    under_ci = _fetch(tmp_path, "true", "2.12.0")
    assert under_ci.returncode == 1 and "missing: 2.12.0" in under_ci.stderr
    local = _fetch(tmp_path, "", "2.12.0")
    assert local.returncode == 0 and "tests that need torch_npu 2.12.0 will skip" in local.stderr


def test_a_missing_wheel_fails_under_ci_and_skips_loudly_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_npu_wheels

    monkeypatch.setattr(torch_npu_wheels, "MISSING", {})
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="under CI the differential tests may not skip"):
        torch_npu_wheels.wheel("0.0.1")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match=r"torch_npu 0\.0\.1 wheel not in"):
        torch_npu_wheels.wheel("0.0.1")
    assert torch_npu_wheels.summary_line() == (
        "npu-shadow: NOT tested against torch_npu 0.0.1 (wheel not fetched): 2 skipped"
    )


@pytest.mark.slow
def test_the_demo_fetches_torch_npus_wheel_and_falls_back_only_where_it_cannot(tmp_path: Any) -> None:
    index = tmp_path / "index"  # a local package folder standing for the package index
    index.mkdir()
    shutil.copy(wheel("2.12.0"), index)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
        "NPU_SHADOW_WHEEL_DIR": str(tmp_path / "empty-cache"),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
    }
    run = functools.partial(
        subprocess.run, ["bash", "scripts/demo_legacy.sh"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    fetched = run(env=env)
    assert fetched.returncode == 0, fetched.stderr
    option, path = fetched.stdout.split("\n")[:2]
    assert option == "--legacy-from" and path.startswith(str(tmp_path / "empty-cache"))
    assert "legacy: torch_npu 2.12.0's own code" in fetched.stderr
    unreachable = run(env={**env, "NPU_SHADOW_WHEEL_DIR": str(tmp_path / "other"), "PIP_FIND_LINKS": ""})
    assert unreachable.returncode == 0 and unreachable.stdout == "--legacy-from\nreference\n"  # (a rehearsal)
    assert "legacy: shadow.npu.reference, NOT torch_npu's own code" in unreachable.stderr


# PyTorch's dynamo tests of Tensor.type (test/dynamo/test_functions.py, test_tensor_type to test_tensor_type5), as
# torch_npu adapts them: cuda -> npu.
def _tensor_type1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a.to(torch.float16)
    return b.type(m.type())


def _tensor_type2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a.to("npu")
    return m + b.type(m.type())


def _tensor_type3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a.type(torch.HalfTensor)
    return b.type(m.type())


def _tensor_type4(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a.type("torch.HalfTensor")
    return b.type(m.type())


def _tensor_type5(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m = a.type(torch.npu.HalfTensor)
    return b.type(m.type())


@pytest.mark.parametrize("shadowed", [False, True], ids=["legacy alone", "shadowed"])
# (where dynamo graph-breaks inside legacy it meets the wrapper's sampled path, which sees it is compiling and skips:
# its clock reads are what dynamo warns about)
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin `time")
def test_compiled_code_runs_with_the_wheels_legacy(torch_npu_legacy: torch_npu_source.TorchNpuLegacy, shadowed) -> None:
    """torch.compile imports a traced function's module by its name: the loaded files are modules of their own
    (never named torch_npu), so compiled code calling .type() works with the wheel's legacy as with ours."""
    import contextlib

    import shadow

    torch._dynamo.reset()
    patches = torch_npu_legacy.patch_torch()
    try:
        with shadow.install(["tensor_type"], sample_rate=1.0) if shadowed else contextlib.nullcontext():
            for function in (_tensor_type1, _tensor_type2, _tensor_type3, _tensor_type4, _tensor_type5):
                a, b = torch.randn(10), torch.randn(10)
                expected = function(a, b)
                got = torch.compile(function, backend="eager", fullgraph=False)(a, b)
                assert (got.device, got.dtype) == (expected.device, expected.dtype), function.__name__
                assert torch.equal(got.cpu(), expected.cpu()), function.__name__
    finally:
        patches.undo()
        torch._dynamo.reset()
