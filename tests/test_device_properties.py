"""The rehearsal npu behaves like a device where a setting asks it to (an asynchronous queue, counted host
synchronizations, nondeterministic reductions, a memory capacity), training stays bitwise unchanged under each,
an honest job under nondeterministic reductions counts no divergence, and ``scripts/device_check.sh`` validates a
device (here the emulated npu) and writes its bundle."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from commands import npu_shadow
from fakes import Recorder
from torch import nn

import shadow
from shadow.launcher import validate
from shadow.npu import emulated, reference
from shadow.npu.device_properties import DeviceProperties

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def properties():
    """Sets the emulated npu's device properties; every one off again afterwards."""
    try:
        yield lambda text: emulated.set_properties(DeviceProperties.parse(text))
    finally:
        emulated.set_properties(DeviceProperties())


def syncs_of(call):
    before = emulated.host_syncs()
    call()
    after = emulated.host_syncs()
    return after[0] - before[0], after[1] - before[1]


# --------------------------------------------------------------------------- the emulated device


def kernels_of(call):
    before = emulated.kernels()
    call()
    return emulated.kernels() - before


def test_kernels_are_counted_per_op_on_the_device_and_per_thread():
    x = torch.arange(1000, dtype=torch.float32, device="npu")
    assert kernels_of(lambda: (x * 2).sum().add_(1)) == 3  # (one each: mul, sum, add_; none for their copies inside)
    assert kernels_of(lambda: torch.ones(4).add_(1)) == 0  # (the host's)
    assert kernels_of(lambda: torch.ones(4).to("npu")) == 1  # (a copy onto the device)
    assert kernels_of(lambda: x.cpu()) == 0  # (a read of the device by the host: host_syncs counts it)
    other = []
    thread = __import__("threading").Thread(target=lambda: other.append(kernels_of(lambda: x + 1)))
    before = emulated.kernels()
    thread.start()
    thread.join()
    assert other == [1] and emulated.kernels() == before


def test_host_reads_are_counted_per_thread_and_the_kernels_own_copies_are_not():
    x = torch.arange(1000, dtype=torch.float32, device="npu")
    assert syncs_of(lambda: (x * 2).sum().add_(1)) == (0, 0)  # (queued work; torch's CPU kernels copy inside)
    assert syncs_of(lambda: x.sum().item()) == (1, 1)
    assert syncs_of(lambda: x.cpu()) == (1, 1)
    assert syncs_of(lambda: x.to("cpu", non_blocking=True)) == (0, 1)
    assert syncs_of(lambda: torch.equal(x, x)) == (1, 1)  # (a plain value the host must see)
    assert syncs_of(lambda: x.nonzero()) == (1, 1)  # (a shape that depends on the values)
    assert syncs_of(lambda: torch.npu.synchronize()) == (1, 0)
    other = []
    thread = __import__("threading").Thread(target=lambda: other.append(syncs_of(lambda: x.sum().item())))
    before = emulated.host_syncs()
    thread.start()
    thread.join()
    assert other == [(1, 1)] and emulated.host_syncs() == before  # (each thread its own count)


def test_a_queue_makes_host_reads_wait_for_queued_work_and_events_tell_when_it_is_done(properties):
    x = torch.ones(16, device="npu")
    properties("kernel_time=0.9s")
    y = x + 1  # queued: the host goes on
    event = torch.Event(device="npu")
    event.record()
    stream = torch.accelerator.current_stream()
    assert not event.query() and not stream.query()  # (the kernel's 0.9 s are not over)
    assert syncs_of(event.synchronize) == (1, 0)
    assert event.query()  # (the synchronize waited for it)
    z = y * 2
    assert not stream.query()
    assert syncs_of(lambda: z.cpu()) == (1, 1) and stream.query()  # (the read waited for z's kernel)
    assert torch.equal(z.cpu(), torch.full((16,), 4.0))


def test_nondeterministic_reductions_vary_from_run_to_run_unless_deterministic_algorithms_are_on(properties):
    w = torch.randn(256, 64, device="npu")
    rng = torch.get_rng_state(), [torch.npu.get_rng_state(i) for i in range(2)]
    assert torch.equal(w.sum(0), w.sum(0))  # (off by default)
    properties("nondeterministic=1e-4")
    sums = [w.sum(0).cpu() for _ in range(3)]
    assert not torch.equal(sums[0], sums[1]) and not torch.equal(sums[1], sums[2])
    assert torch.allclose(sums[0], sums[1], rtol=3e-4, atol=0)  # (last bits, not values)
    assert torch.equal(rng[0], torch.get_rng_state())  # (the emulator's own generator, never the job's)
    assert all(torch.equal(a, torch.npu.get_rng_state(i)) for i, a in enumerate(rng[1]))
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert torch.equal(w.sum(0), w.sum(0))
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("capacity=lots", "not a number"),
        ("kernel_time=2s", "kernel_time must be in [0, 1)"),
        ("speed=1", "is not capacity=SIZE"),
        ("capacity=1GiB,capacity=2GiB", "each once"),
        ("nondeterministic=-1", ">= 0"),
    ],
)
def test_bad_device_properties_are_refused_naming_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=__import__("re").escape(why)):
        DeviceProperties.parse(text)


def test_device_properties_read_as_written():
    assert DeviceProperties.parse("capacity=2GiB, kernel_time=20us ,nondeterministic=1e-6") == DeviceProperties(
        2 << 30, pytest.approx(2e-5), 1e-6
    )


@pytest.mark.slow
def test_a_bad_emulated_device_setting_fails_the_launcher_before_the_job_naming_it(tmp_path):
    marker = tmp_path / "ran"
    done = npu_shadow(
        "run",
        "--emulate-npu",
        "2",
        "--emulated-device",
        "kernel_time=fast",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        timeout=120,
    )
    assert done.returncode == 2 and "--emulated-device" in done.stderr and not marker.exists()


# --------------------------------------------------------------------------- the tool on it


@pytest.mark.parametrize(
    "text", ["capacity=512MiB", "kernel_time=20us", "nondeterministic=1e-4", "capacity=512MiB,kernel_time=20us"]
)
def test_training_stays_bitwise_unchanged_under_every_device_property(properties, text):
    """Shadowed at rate 1 with every extra run, against unwrapped, each under the property (nondeterministic
    reductions with deterministic algorithms asked for, as a job that wants repeatable training does)."""
    properties(text)
    device, sizes = validate.find_device(), validate.SMALL
    torch.use_deterministic_algorithms("nondeterministic" in text, warn_only=True)
    patches = reference.patch_torch()
    try:
        plain = validate.train(device, sizes, sizes.steps, None)
        shadowed = validate.train(device, sizes, sizes.steps, lambda: shadow.install(**validate.EVERY_RUN))
    finally:
        patches.undo()
        torch.use_deterministic_algorithms(False)
    assert plain.state.keys() == shadowed.state.keys()
    assert all(torch.equal(plain.state[k], shadowed.state[k]) for k in plain.state)
    assert shadowed.stats["parallel_apply"].match == sizes.steps  # (compared, every call)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        # (a ReLU: the noise moving its input across zero makes a rare large gradient difference, on either side)
        return self.head(torch.relu(self.conv(x)).flatten(1))


def test_an_honest_job_under_nondeterministic_reductions_is_never_rolled_back(properties):
    """Both sides' convolutions and backward reductions vary run to run, as a device's do under cudnn.benchmark: the
    forward and gradient burn-ins fix thresholds from the A/A runs, nearly every difference after is noise, and
    what lands beyond is as rare as legacy's own A/A runs beyond: the verdict never rolls the job back (before the
    gradient floor every backward comparison was a ``grad`` mismatch)."""
    from fakes import counts_of

    from shadow.analysis import decisions, verdict

    properties("nondeterministic=1e-5")
    torch.manual_seed(0)
    model = _Net().to("npu:0")
    parallel = nn.DataParallel(model, device_ids=[0, 1])
    recorder = Recorder()
    patches = reference.patch_torch()
    try:
        with shadow.install(
            ["parallel_apply"], sample_rate=1.0, seed=1, aa_rate=1.0, backward_rate=1.0, exporters=[recorder]
        ) as monitor:
            for _ in range(260):  # (the burn-ins' 200 A/A runs, then judged)
                x = torch.randn(8, 3, 8, 8).to("npu:0")
                parallel(x).square().mean().backward()
            stats = monitor.stats()["parallel_apply"]
    finally:
        patches.undo()
    checks = stats.noise_checks
    assert stats.error == 0 and stats.noise >= 20 and stats.backward_runs >= 100, stats
    for evidence in ("forward", "gradients"):  # (judged, below the typical error or above it within the thresholds)
        assert checks.get(f"{evidence}/ab/below", 0) + checks.get(f"{evidence}/ab/within", 0) >= 20, checks
    decided = verdict.decide("parallel_apply", counts_of(stats), decisions.DEFAULT_MAX_RATE)
    assert decided.decision != verdict.ROLLBACK, decided.why


@pytest.mark.slow
def test_the_device_check_validates_the_emulated_npu_and_writes_its_bundle(tmp_path):
    out = tmp_path / "bundle"
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "device_check.sh"), "--small", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    bundle = json.loads((out / "device-check.json").read_text())
    assert bundle["device"].startswith("emulated npu") and bundle["bitwise_holds"]
    assert bundle["doctor"]["exit"] == 0
    assert bundle["nondeterministic"]["counts"]["parallel_apply"]["calls"] > 0
    noise = bundle["noise"]  # (a real divergence under heavy-tailed noise: seen where it is above the size limit)
    assert noise["holds"] and noise["wrong 1000x"]["decision"] == "rollback", noise
    assert noise["honest"]["decision"] != "rollback" and noise["wrong 20x"]["decision"] != "promote"
    for arm in ("defaults", "rate_0.01", "rate_1"):
        assert bundle["cost"][arm]["step_ratio"] > 0 and bundle["cost"][arm]["memory_ratio"] >= 1.0
    assert bundle["sampled_call"]["sync_counter"] == "emulated npu"
    assert set(bundle["comparator"]) == {"float32", "bfloat16"}
    assert {figures["pass"] for figures in bundle["comparator"].values()} == {"one pass: the emulated npu's kernel"}
    text = (out / "device-check.md").read_text()
    assert "training bitwise unchanged, canary at rate 1 | yes" in text and "comparator / assert_close" in text
    calls = noise["honest"]["calls"]  # (every call judged once the burn-in is over, those held during it included)
    assert f"upstream honest ({calls} calls, A/A every call) | " in text and f" beyond of {calls} (A/A " in text


def _floor_sequence(scale: float, calls: int, seed: int) -> dict:
    """A job's sequence of calls through one NoiseFloor: heavy-tailed A/A errors (as a nondeterministic backward's
    are) and A/B errors ``scale`` times as large, each call judged: {(run, check): count} after the burn-in."""
    import collections

    import numpy as np

    from shadow.core.judging.noise import NoiseFloor

    rng, floor, judged = np.random.default_rng(seed), NoiseFloor(), collections.Counter()
    for _ in range(calls):
        check = floor.add_aa("s", [("grad:w", float(rng.lognormal(0.0, 1.5)))], 0.0, True)
        judged[("aa", check)] += bool(check)
        error = float(scale * rng.lognormal(0.0, 1.5))
        judged[("ab", floor.judge("s", [("grad:w", error)])[0])] += 1
    return judged


def test_legacy_and_upstream_are_judged_alike_against_thresholds_a_burn_in_fixed():
    """Heavy-tailed noise (a nondeterministic backward's): the threshold is 6 x the 0.995 quantile of the burn-in's 200
    A/A errors, so an honest A/B error and a later A/A error land beyond it equally often (exchangeable: the rate an
    independent simulation gives, numpy's, is the rate the floor counts on both sides), and above the typical error
    (the burn-in's median) on half the calls each; errors 20 times legacy's own land beyond on far more calls."""
    import math

    import numpy as np

    from shadow.core.judging.noise import BURN_IN, FACTOR, QUANTILE

    rng, trials = np.random.default_rng(7), 50_000
    burn_in = np.sort(rng.lognormal(0.0, 1.5, (trials, BURN_IN)), axis=1)
    thresholds = FACTOR * burn_in[:, math.ceil(QUANTILE * BURN_IN) - 1]
    expected = float(np.mean(rng.lognormal(0.0, 1.5, trials) > thresholds))  # (about 1 in 10,000)
    assert 2e-5 < expected < 1e-3
    honest = _floor_sequence(1.0, 40_000, seed=1)
    judged = 40_000 - BURN_IN
    ab_rate, aa_rate = honest[("ab", "beyond")] / judged, honest[("aa", "beyond")] / judged
    assert honest[("ab", "pending")] == honest[("ab", "")] == 0 or honest[("ab", "pending")] <= BURN_IN, honest
    assert abs(ab_rate - aa_rate) < 0.002 and ab_rate < 0.01 and aa_rate < 0.01, honest
    above = {pair: (honest[(pair, "within")] + honest[(pair, "beyond")]) / judged for pair in ("ab", "aa")}
    # (the burn-in's median is one draw's: near 1/2, the same for both sides)
    assert abs(above["ab"] - above["aa"]) < 0.02 and abs(above["aa"] - 0.5) < 0.1, above
    shifted = _floor_sequence(20.0, 1_000, seed=1)
    assert shifted[("ab", "beyond")] > 20 * max(1, shifted[("aa", "beyond")]), shifted


# --------------------------------------------------------------------------- no wait on a sampled call


class _Cast(nn.Module):
    def forward(self, x):
        return torch.relu(x).type(torch.float32) * 2


def _dataparallel_and_input():
    torch.manual_seed(0)
    return nn.DataParallel(_Cast().to("npu:0"), device_ids=[0, 1]), torch.randn(8, 16).to("npu:0")


def test_a_sampled_call_makes_no_host_synchronization_on_the_callers_thread(properties):
    """With the device's queue asynchronous, a sampled parallel_apply and a sampled .type() return without waiting
    for the device (their comparisons are read later); the counts are exact once read (before: 4 and 2 host
    synchronizations, the comparator's reads)."""
    parallel, x = _dataparallel_and_input()
    properties("kernel_time=2ms")
    recorder = Recorder()
    patches = reference.patch_torch()
    try:
        unwrapped = syncs_of(lambda: (parallel(x), x.type(torch.float16)))
        with shadow.install(sample_rate=1.0, seed=1, oracle=0.0, aa_rate=0.0, exporters=[recorder]) as monitor:
            parallel(x), x.type(torch.float16)  # (warm)
            sampled = [syncs_of(lambda: parallel(x))[0], syncs_of(lambda: x.type(torch.float16))[0]]
            stats = monitor.stats()
    finally:
        patches.undo()
    assert unwrapped[0] == 0 and sampled == [0, 0]
    for name in ("parallel_apply", "tensor_type"):
        assert stats[name].sampled == stats[name].match == len(recorder.of(name)) >= 2


def test_a_deferred_comparison_is_published_once_read_and_every_one_by_the_flush(properties, tmp_path):
    from exporters.journal import JsonlExporter

    parallel, x = _dataparallel_and_input()
    properties("kernel_time=0.3s")
    journal = tmp_path / "journal.jsonl"
    recorder = Recorder()
    patches = reference.patch_torch()
    try:
        with shadow.install(
            ["parallel_apply"],
            sample_rate=1.0,
            seed=1,
            oracle=0.0,
            exporters=[recorder, JsonlExporter(str(journal), all_outcomes=True)],
        ) as monitor:
            for _ in range(3):
                parallel(x)
            held = len(monitor._experiments[0].record.deferred)
    finally:
        patches.undo()
    assert held >= 1  # (compared, not yet read when the calls returned: neither agreement nor divergence)
    assert [o.outcome for o in recorder.observations] == ["match"] * 3  # (the flush read every one)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert sum(line.get("outcome") == "match" for line in lines) == 3


def test_an_exporter_that_keeps_evidence_gets_the_comparison_at_once(properties):
    class Capturing(Recorder):
        captures = True

    parallel, x = _dataparallel_and_input()
    properties("kernel_time=50ms")
    recorder = Capturing()
    patches = reference.patch_torch()
    try:
        with shadow.install(["parallel_apply"], sample_rate=1.0, seed=1, oracle=0.0, exporters=[recorder]) as monitor:
            parallel(x)
            assert len(recorder.observations) == 1 and not monitor._experiments[0].record.deferred
    finally:
        patches.undo()


# --------------------------------------------------------------------------- device memory


def _deep_net():
    return nn.Sequential(
        *[m for _ in range(12) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())]
    )


def _peak_of_a_step(monitor=None):
    """Device 0's peak allocation over one DataParallel training step of a deep CNN (its activations dominate)."""
    torch.manual_seed(0)
    parallel = nn.DataParallel(_deep_net().to("npu:0"), device_ids=[0, 1])
    x = torch.randn(32, 16, 16, 16).to("npu:0")
    patches = reference.patch_torch()
    try:
        installed = monitor() if monitor else None
        try:
            parallel(x).sum().backward()  # (warm)
            torch.npu.reset_peak_memory_stats(0)
            before = torch.npu.memory_allocated(0)
            parallel(x).sum().backward()
            peak = torch.npu.max_memory_allocated(0) - before
            stats = installed.stats() if installed else None
        finally:
            if installed:
                installed.uninstall()
    finally:
        patches.undo()
    return peak, stats


def test_a_shadow_run_compared_forward_only_adds_no_second_copy_of_the_activations():
    """Rate 1, no backward comparison: the shadow run keeps no activations, so the device's peak stays within 30%
    of the unwrapped step's (it was 1.94x: the shadow forward's activations held beside the job's), and the
    summary and the metrics say what it added."""
    from shadow.launcher.launch import summary

    plain, _ = _peak_of_a_step()
    lean, stats = _peak_of_a_step(lambda: shadow.install(["parallel_apply"], sample_rate=1.0, seed=1, oracle=0.0))
    assert stats["parallel_apply"].match == 2 and lean <= 1.3 * plain, (lean, plain)
    assert 0 < stats["parallel_apply"].shadow_peak_bytes <= 0.3 * plain
    assert "device memory: a shadow side raised the device's peak allocation by at most" in summary(stats)


def test_at_the_launchers_defaults_the_shadow_side_adds_at_most_30_percent_of_the_peak():
    """Whatever the draws: even where every sampled call draws a backward comparison (the defaults draw one in 20),
    its two graphs, which would hold the step's activations twice more, are not made (backward skip ``memory``).
    Without the bound the same step's peak is 2.9x the unwrapped one (1.08x with it)."""
    from shadow.launcher.config import Config

    settings = Config(backward_rate=1.0, budget=None).monitor_settings(False)  # (no call skipped for its time)
    plain, _ = _peak_of_a_step()
    peaks, stats = {}, {}
    for bound in (settings.backward_memory, None):
        configured = dataclasses.replace(settings, backward_memory=bound)
        peaks[bound], stats[bound] = _peak_of_a_step(lambda s=configured: shadow.install(sample_rate=0.01, settings=s))
    bounded = stats[settings.backward_memory]["parallel_apply"]
    assert bounded.sampled == 2 and peaks[settings.backward_memory] <= 1.3 * plain, (peaks, plain)
    assert bounded.backward_runs == 0 and dict(bounded.backward_skips) == {"memory": 2}
    assert stats[None]["parallel_apply"].backward_runs == 2 and peaks[None] > 1.3 * plain  # (what it bounds)


def test_a_backward_comparison_whose_graphs_fit_in_the_share_is_made():
    """Where the job's own memory (its parameters and optimizer state, say) dwarfs a call's graph, the backward
    comparison runs from the signature's second sampled call on (the first measures the graph)."""
    from shadow.launcher.config import Config

    settings = Config(backward_rate=1.0, budget=None).monitor_settings(False)
    optimizer_state = torch.empty(512 << 20, dtype=torch.uint8, device="npu:0")  # (512 MiB the job holds)
    try:
        _, stats = _peak_of_a_step(lambda: shadow.install(sample_rate=0.01, settings=settings))
    finally:
        del optimizer_state
    compared = stats["parallel_apply"]
    assert (compared.backward_runs, dict(compared.backward_skips)) == (1, {"memory": 1})


def test_the_graph_memory_bound_refuses_what_it_has_not_measured_or_cannot_fit():
    from shadow.core.calls.gate.graph_memory import GraphMemory

    bound = GraphMemory(0.3)
    assert bound.refuses("s")  # (never measured)
    bound.observe("s", before=1000, after=1100)  # a graph of 100 bytes in a footprint of 1100
    assert not bound.refuses("s") and bound.refuses("t")
    bound.observe("t", before=1100, after=1300)  # 2 x 200 > 0.3 x 1300
    assert bound.refuses("t") and not bound.refuses("s")
    bound.observe("s", before=1000, after=1000)  # (a graph is the most a run of it allocated)
    assert not bound.refuses("s") and GraphMemory(0.0).refuses("s") is True


class _ForceField(nn.Module):
    """A forward that reads its own graph: the force is the gradient of an energy (``torch.autograd.grad`` inside
    the forward, as force-field models do)."""

    def __init__(self):
        super().__init__()
        self.energy = nn.Linear(3, 1)

    def forward(self, positions):
        positions = positions.detach().requires_grad_(True)
        energy = torch.tanh(self.energy(positions)).sum()
        (force,) = torch.autograd.grad(energy, positions, create_graph=True)
        return -force


def test_a_forward_that_reads_its_own_graph_is_compared_with_its_activations_kept():
    torch.manual_seed(0)
    model = _ForceField().to("npu:0")
    parallel = nn.DataParallel(model, device_ids=[0, 1])
    x = torch.randn(8, 3).to("npu:0")
    recorder = Recorder()
    patches = reference.patch_torch()
    try:
        plain = [parallel(x) for _ in range(3)]
        with shadow.install(["parallel_apply"], sample_rate=1.0, seed=1, oracle=0.0, exporters=[recorder]):
            shadowed = [parallel(x) for _ in range(3)]
    finally:
        patches.undo()
    assert all(torch.equal(a, b) for a, b in zip(plain, shadowed, strict=True))
    first, *rest = recorder.observations
    assert first.outcome == "skipped" and first.reasons == ("ineligible",) and "reads its own graph" in first.detail
    assert [o.outcome for o in rest] == ["match", "match"]  # (its activations kept from then on)


@pytest.mark.slow
@pytest.mark.parametrize("out, words", [("", "empty"), ("/dev/null", "cannot be made a folder")])
def test_a_bad_bundle_folder_is_refused_before_the_device_check_runs(tmp_path, out, words):
    """``--out ''`` wrote the bundle into the working directory, a file in its place ended in a traceback after the
    checks had run: either is refused first, naming the setting (exit 2), and nothing is written."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "shadow", "validate", "--small", "--out", out], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and f"--out={out!r} is not valid: {words}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []
