"""The emulated npu: a real PrivateUse1 accelerator for torch's own device-generic code."""

import os
import subprocess
import sys
import textwrap
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from shadow.npu import emulated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_torch_sees_an_npu_accelerator_with_two_devices():
    assert torch.accelerator.current_accelerator() == torch.device("npu")
    assert torch.accelerator.device_count() == torch.npu.device_count() == emulated.installed_devices() == 2
    x = torch.arange(6.0, device="npu:1").reshape(2, 3)
    assert x.device == torch.device("npu:1")
    assert (x.t() * 2).sum().item() == 30.0  # views, the CPU fallback, a host read-back
    assert x.to("npu:0").device == torch.device("npu:0")
    assert torch.equal(x.cpu(), torch.arange(6.0).reshape(2, 3))


def test_install_is_idempotent_and_refuses_another_count():
    assert emulated.install(2) == 2
    with pytest.raises(ValueError, match="installed with 2 devices"):
        emulated.install(3)
    with pytest.raises(ValueError, match="1 to 16"):
        emulated.install(True)


def test_current_device_and_streams_are_per_thread():
    seen = {}

    def worker(index):
        with torch.npu.device(index):
            stream = torch.npu.Stream()
            with torch.npu.stream(stream):
                seen[index] = (torch.npu.current_device(), torch.npu.current_stream().stream_id == stream.stream_id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {0: (0, True), 1: (1, True)}
    assert torch.npu.current_device() == 0


def test_random_ops_draw_from_their_own_devices_generator_even_in_threads():
    torch.manual_seed(123)
    cpu_before = torch.get_rng_state()
    states = [torch.npu.get_rng_state(i) for i in (0, 1)]

    def draws():
        out = {}

        def worker(index):
            x = torch.ones(1000, device=f"npu:{index}")
            out[index] = (nn.functional.dropout(x, 0.5), torch.rand(5, device=f"npu:{index}"))

        threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    first = draws()
    for index, state in enumerate(states):
        torch.npu.set_rng_state(state, index)
    second = draws()
    for index in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(first[index], second[index]))
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU generator was never drawn from
    zero = torch.npu.get_rng_state(0)
    torch.rand(5, device="npu:1")
    assert torch.equal(torch.npu.get_rng_state(0), zero)  # one generator per device, not one shared
    assert not torch.equal(torch.npu.get_rng_state(1), states[1])


def test_upstream_dataparallel_forward_and_backward_reduce_gradients_to_device_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2)).to("npu")
    reference = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    x = torch.randn(8, 3, 4, 4)
    out = nn.DataParallel(model, device_ids=[0, 1])(x.to("npu"))
    out.sum().backward()
    assert out.device == torch.device("npu:0")
    assert model[0].weight.grad.device == torch.device("npu:0")
    # BatchNorm per replica sees half the batch: compare the parameter gradients' shape and finiteness,
    # and the eval-mode outputs (no batch statistics) exactly against the CPU
    assert torch.isfinite(model[0].weight.grad).all()
    model.eval(), reference.eval()
    got = torch.nn.parallel.data_parallel(model, x.to("npu"), device_ids=[0, 1])
    assert torch.allclose(got.cpu(), reference(x), rtol=1e-5, atol=1e-6)


def test_upstream_parallel_apply_runs_replicas_without_autocast_on_npu():
    """torch 2.13's parallel_apply reads CUDA's autocast flag: the defect the emulator makes visible."""
    model = nn.Linear(4, 4).to("npu")
    replicas = torch.nn.parallel.replicate(model, [0, 1])
    inputs = [torch.randn(2, 4, device="npu:0"), torch.randn(2, 4, device="npu:1")]
    with torch.autocast("npu", dtype=torch.float16):
        direct = model(inputs[0])
        outputs = torch.nn.parallel.parallel_apply(replicas, inputs, None, [0, 1])
    assert direct.dtype == torch.float16
    assert [o.dtype for o in outputs] == [torch.float32, torch.float32]
    assert [o.device.index for o in outputs] == [0, 1]


def test_npu_type_names_and_classes_work_with_upstream_type():
    x = torch.arange(4)
    half = torch._C.TensorBase.type(x, "torch.npu.HalfTensor")
    assert (half.device, half.dtype) == (torch.device("npu:0"), torch.float16)
    assert torch.npu.HalfTensor.__module__ == "torch.npu" and torch.npu.HalfTensor.__name__ == "HalfTensor"
    by_class = torch._C.TensorBase.type(x.to("npu:1"), torch.npu.FloatTensor)
    assert (by_class.device, by_class.dtype) == (torch.device("npu:1"), torch.float32)  # keeps its npu


def test_npu_tensor_type_classes_are_tensor_types_as_on_torch_npu():
    """isinstance, the constructor and torch's set of tensor classes work as torch_npu makes them (its
    TensorType.cpp): a metaclass whose isinstance asks the tensor's backend and dtype."""
    names = ("Bool", "Byte", "Char", "Short", "Int", "Long", "Half", "Float", "Double", "BFloat16")
    classes = [getattr(torch.npu, f"{name}Tensor") for name in names]
    assert all(cls in torch._tensor_classes for cls in classes)
    assert {type(cls).__name__ for cls in classes} == {"tensortype"}
    x = torch.ones(2, 3, device="npu:1", requires_grad=True)
    assert isinstance(x, torch.npu.FloatTensor) and isinstance(x.detach(), torch.npu.FloatTensor)
    assert not isinstance(x.half(), torch.npu.FloatTensor) and isinstance(x.half(), torch.npu.HalfTensor)
    assert not isinstance(x.cpu(), torch.npu.FloatTensor) and not isinstance("x", torch.npu.FloatTensor)
    assert isinstance(x.cpu(), torch.FloatTensor) and not isinstance(x, torch.FloatTensor)
    made = torch.npu.FloatTensor(3)
    assert (made.shape, made.dtype, made.device) == ((3,), torch.float32, torch.device("npu:0"))
    with torch.npu.device(1):
        listed = torch.npu.HalfTensor([1, 2])
    assert (listed.dtype, listed.device, listed.tolist()) == (torch.float16, torch.device("npu:1"), [1.0, 2.0])
    assert [cls.dtype for cls in classes][:3] == [torch.bool, torch.uint8, torch.int8]
    assert (torch.npu.FloatTensor.layout, torch.npu.FloatTensor.is_npu, torch.npu.FloatTensor.is_sparse) == (
        torch.strided,
        True,
        False,
    )
    assert torch.npu.FloatTensor.add is torch.Tensor.add  # torch.Tensor's methods, as on torch's classes
    with pytest.raises(TypeError):
        type("Sub", (torch.npu.FloatTensor,), {})  # not subclassable, as torch's own


def test_torch_npus_type_conversions_on_the_same_device():
    """torch_npu's test_type_conversions_same_device, on the emulated npu."""
    x = torch.randn(5, 5).to("npu:1")
    assert x.int().device == x.device and x.type(torch.int).device == x.device
    assert x.to(torch.int).device == x.device
    assert isinstance(x.type(torch.npu.IntTensor), torch.npu.IntTensor)


def test_build_directory_is_keyed_by_torch_version_and_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_SHADOW_CACHE_DIR", str(tmp_path))
    path = emulated.build_directory()
    assert path.parent == tmp_path / "emulated_npu"
    assert path.name.startswith(f"torch-{torch.__version__}-") and len(path.name.rsplit("-", 1)[1]) == 16
    assert not str(path).startswith(ROOT)


@pytest.mark.slow
def test_refuses_when_torch_npu_is_imported():
    done = run_python(
        """
        import sys
        sys.path.insert(0, "tests/fake_torch_npu")
        import torch_npu
        from shadow.npu import emulated
        try:
            emulated.install(2)
        except emulated.EmulatorUnavailable as exc:
            print(exc)
        """
    )
    assert "torch_npu is imported" in done.stdout, done.stderr


@pytest.mark.slow
def test_refuses_when_another_privateuse1_backend_is_registered():
    done = run_python(
        """
        import torch
        torch.utils.rename_privateuse1_backend("foo")
        from shadow.npu import emulated
        try:
            emulated.install(2)
        except emulated.EmulatorUnavailable as exc:
            print(exc)
        """
    )
    assert "another PrivateUse1 backend is registered in this process ('foo')" in done.stdout, done.stderr


@pytest.mark.slow
def test_refuses_without_a_compiler_and_says_what_to_install(tmp_path):
    done = run_python(
        """
        from shadow.npu import emulated
        try:
            emulated.install(2)
        except emulated.EmulatorUnavailable as exc:
            print(exc)
        """,
        env={"PATH": str(tmp_path), "CXX": "no-such-compiler", "NPU_SHADOW_CACHE_DIR": str(tmp_path)},
    )
    assert "no C++ compiler found" in done.stdout and "build-essential" in done.stdout, done.stderr


@pytest.mark.slow
def test_a_regular_wheel_install_ships_the_source_and_installs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), ROOT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("npu_shadow-*.whl")
    shipped = zipfile.ZipFile(wheel).namelist()
    assert all(f"shadow/npu/emulated/csrc/{source}" in shipped for source in emulated.SOURCES), shipped
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    done = subprocess.run(  # from outside the repository: only the installed copy can be imported
        [
            sys.executable,
            "-c",
            "import torch; from shadow.npu import emulated; emulated.install(2);"
            "print(emulated.__file__); print(torch.ones(2, device='npu:1').device)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert done.returncode == 0, done.stderr
    installed_at, device = done.stdout.split()
    assert installed_at.startswith(str(site)) and device == "npu:1"


@pytest.mark.slow
def test_a_load_never_waits_on_a_lock():
    """A published build is imported straight away: neither cpp_extension's lock file (a killed build leaves it)
    nor a builder holding its turn makes a load wait."""
    import fcntl

    build = emulated.build()
    (build / "lock").write_text("")  # as a build killed halfway leaves it
    try:
        with open(build.parent / f"{build.name}.flock", "a") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)  # another process's builder, holding its turn
            done = run_python(
                """
                import torch
                from shadow.npu import emulated
                emulated.install(devices=2)
                print(torch.ones(1, device="npu:1").device)
                """
            )
    finally:
        (build / "lock").unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "npu:1"


def test_the_build_key_follows_what_the_compiler_is_given(monkeypatch):
    """build.ninja holds the include paths of the venv that built it: another venv gets a build of its own."""
    import sysconfig

    from torch.utils import cpp_extension

    first = emulated.build_directory()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"include": "/another/venv/include/python3.11"})
    second = emulated.build_directory()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/another/venv/site-packages/torch/include"])
    third = emulated.build_directory()
    assert len({first, second, third}) == 3 and first.parent == second.parent == third.parent


def test_a_build_is_published_whole_by_a_rename(tmp_path, monkeypatch):
    built_in = []

    def fake_compile(workspace):
        built_in.append(workspace)
        (workspace / f"{emulated.EXTENSION_NAME}.so").write_bytes(b"built")

    monkeypatch.setenv("NPU_SHADOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(emulated, "_compile", fake_compile)
    build = emulated.build_directory()
    emulated._build(build)
    (workspace,) = built_in
    assert Path(workspace).parent == build.parent and Path(workspace) != build  # built beside, under another name
    assert (build / f"{emulated.EXTENSION_NAME}.so").read_bytes() == b"built"
    assert not Path(workspace).exists()
    assert sorted(p.name for p in build.parent.iterdir()) == sorted([build.name, f"{build.name}.flock"])
    emulated._build(build)  # published already: nothing built again
    assert len(built_in) == 1


FORWARD_BACKWARD = """
import torch
from shadow.npu import emulated
emulated.install(devices=2)
model = torch.nn.Linear(8, 8).to("npu:0")
out = torch.nn.DataParallel(model, device_ids=[0, 1])(torch.randn(4, 8, device="npu:0"))
out.sum().backward()
print("done", flush=True)
"""


@pytest.mark.slow
def test_a_process_that_ran_backward_on_two_emulated_devices_exits_cleanly():
    """The autograd engine's device threads are stopped at exit while the interpreter is alive; left to the
    engine's static destructor, one of them aborted about every other run ("terminate called without an active
    exception", exit code 134)."""
    codes = [run_python(FORWARD_BACKWARD) for _ in range(8)]
    assert [(c.returncode, c.stdout.strip()) for c in codes] == [(0, "done")] * 8, codes[0].stderr[-2000:]


@pytest.mark.slow
def test_a_type_table_fixed_before_install_is_refused_saying_why():
    done = run_python(
        """
        import torch
        torch.ones(1).type("torch.DoubleTensor")  # torch fixes its type names here, before npu exists
        from shadow.npu import emulated
        try:
            emulated.install(devices=2)
        except emulated.EmulatorUnavailable as exc:
            print("refused:", exc)
        from shadow.launcher import doctor
        code, lines = doctor.diagnose(port=0, emulate_npu=2)
        print("doctor:", code, *[line for line in lines if line.startswith("emulated npu")])
        """
    )
    assert done.returncode == 0, done.stderr
    assert "refused: torch rejects 'torch.npu.FloatTensor'" in done.stdout
    assert "doctor: 1 emulated npu: cannot install: torch rejects 'torch.npu.FloatTensor'" in done.stdout
    assert "a Tensor.type(str) call ran in this process before emulated.install()" in done.stdout


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_lstm_and_gru_run_on_the_npu_as_on_the_cpu_gradients_too(cls) -> None:
    torch.manual_seed(0)
    model = cls(3, 4, num_layers=2, bidirectional=True)
    x = torch.randn(5, 2, 3, requires_grad=True)
    expected, _ = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    on_npu = model.to("npu:1")
    on_npu.zero_grad()
    x_npu = x.detach().to("npu:1").requires_grad_()
    output, _ = on_npu(x_npu)
    output.sum().backward()
    assert output.device == torch.device("npu:1") and torch.allclose(output.cpu(), expected)
    assert all(torch.allclose(p.grad.cpu(), g) for p, g in zip(on_npu.parameters(), grads))
    assert torch.allclose(x_npu.grad.cpu(), x.grad)
    with torch.inference_mode():
        assert torch.allclose(on_npu(x_npu.detach())[0].cpu(), expected)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x.detach(), [5, 3])
    cpu_packed = model.cpu()(packed)[0].data
    assert torch.allclose(model.to("npu:1")(torch.nn.utils.rnn.pack_padded_sequence(x_npu, [5, 3]))[0].data.cpu(),
                          cpu_packed)  # fmt: skip


@pytest.fixture
def capacity():
    """The emulated npu with a device's memory capacity, put back to the host's afterwards."""
    from shadow.npu import emulated

    def set_to(bytes_per_device: int) -> None:
        emulated.set_memory_capacity(bytes_per_device)

    try:
        yield set_to
    finally:
        emulated.set_memory_capacity(0)


def test_a_capacity_makes_the_emulated_npu_answer_and_fail_as_a_device(capacity):
    """mem_get_info, memory_allocated, max_memory_allocated and reset_peak_memory_stats answer from the device's
    own counts, and an allocation past the capacity raises torch.OutOfMemoryError."""
    capacity(64 << 20)
    before = torch.npu.memory_allocated(0)
    x = torch.ones(4 << 20, device="npu:0")  # (16 MiB)
    assert torch.npu.memory_allocated(0) - before == 16 << 20
    assert torch.npu.mem_get_info(0) == ((64 << 20) - torch.npu.memory_allocated(0), 64 << 20)
    with pytest.raises(torch.OutOfMemoryError, match="NPU out of memory"):
        torch.empty(64 << 20, dtype=torch.uint8, device="npu:0")
    peak = torch.npu.max_memory_allocated(0)
    del x
    assert torch.npu.memory_allocated(0) == before and torch.npu.max_memory_allocated(0) == peak
    torch.npu.reset_peak_memory_stats(0)
    assert torch.npu.max_memory_allocated(0) == before


def test_a_shadow_side_that_would_not_fit_the_device_is_a_skip_never_the_jobs_out_of_memory(capacity):
    """On a device with a capacity, the job's call fits and its shadow side would not (the argument copies, or
    upstream's own working memory): each call is skipped with reason oom, the job gets exactly its result, and the
    device holds afterwards what the unwrapped call leaves."""
    import types

    import shadow

    def legacy(x):
        return x * 2

    def greedy(x):  # (upstream needs 48 MiB of working memory the device does not have)
        scratch = torch.empty(48 << 20, dtype=torch.uint8, device=x.device)
        return x * 2 + scratch[:1].float() * 0

    for upstream, isolate, size in ((legacy, True, 10 << 20), (greedy, False, 2 << 20)):
        ops = types.SimpleNamespace(op=legacy)
        x = torch.randn(size // 4, device="npu:0")
        expected = legacy(x)
        capacity(torch.npu.memory_allocated(0) + (30 << 20))
        held = torch.npu.memory_allocated(0)
        target = shadow.Target("op", ops, "op", upstream, isolate=isolate)
        with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
            got = ops.op(x)
            stats = monitor.stats()["op"]
        assert torch.equal(got, expected) and stats.skipped == 1 and stats.by_reason == {"oom": 1}, stats
        assert torch.npu.memory_allocated(0) == held + got.numel() * got.element_size()
        del got
        capacity(0)
