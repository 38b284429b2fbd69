"""``npu-shadow validate``: one command that checks this tool on the host's accelerator (an NPU, a GPU, or the
emulated npu with a real device's properties) and writes the figures a team attaches to the pull request that
deletes a patch, as JSON and Markdown (``scripts/device_check.sh`` runs it).

What it runs, on a small CNN in ``nn.DataParallel`` (two device ids: the same device twice where there is one, so
``parallel_apply`` runs) with ``Tensor.type`` casts, legacy being torch_npu's installed patches or
:mod:`shadow.npu.reference`:

- ``doctor``'s report;
- training under deterministic kernels, unwrapped against shadowed at rate 1 with every extra run (A/A, oracle,
  backward, truth), at the launcher's defaults, and in the canary phase (against an unwrapped run of upstream):
  bitwise the same, or the check fails (exit 1);
- training under nondeterministic kernels (``cudnn.benchmark``; the emulated npu's nondeterministic reductions, with
  a heavy tail) at rate 1 with A/A and backward runs: what an honest job counts;
- a real divergence under that noise (a convolution's weight gradient; upstream honest, then wrong on 5% of calls by
  20 and by 1,000 times its own jitter): the honest run never rolled back, the wrong ones never promoted, each with
  the detection limit the verdict states;
- step time and peak device memory against the unwrapped run at the defaults, at 1% and at 100%;
- the host synchronizations a sampled call makes on the caller's thread, and its host time with the device queue
  full, against an unsampled call;
- the comparator against ``torch.testing.assert_close`` on one large pair of tensors on the device.

docs/real-hardware.md says what each figure means and what a real device gave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shadow.core.calls.monitor import install
from shadow.launcher.config import Config


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much each check runs: training steps, batch, image side, timed steps, comparator elements."""

    steps: int
    batch: int
    image: int
    timed_steps: int
    comparator_elements: int


SMALL = Sizes(steps=6, batch=8, image=8, timed_steps=8, comparator_elements=1 << 20)
FULL = Sizes(steps=40, batch=64, image=32, timed_steps=30, comparator_elements=16 << 20)
#: The emulated npu's properties where no real device is present: a queue, and reductions as nondeterministic
#: as a device's backward was seen to be (about 2e-4 of an element, an H200 under cudnn.benchmark), with the heavy
#: tail of a device's spread from call to call (a lognormal's sigma).
EMULATED = "kernel_time=50us"
NONDETERMINISTIC = 2e-4
TAIL = 1.5
#: The noise case: calls of each run (after the burn-in's), the wrong share of the divergent ones and their sizes
#: (times upstream's own jitter: 20x, below what the noise lets a call be seen at, and 1,000x, above it).
NOISE_CALLS = {"small": 600, "full": 3_000}
NOISE_WRONG, NOISE_SIZES = 0.05, (20.0, 1000.0)


class _Net(nn.Module):
    def __init__(self, image: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Linear(16 * image * image, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.flatten(1).type(torch.float32))


@dataclasses.dataclass
class Device:
    """Where the checks run: the device type, the DataParallel device ids, its module (``torch.cuda``, ``torch.npu``)
    and what it is, in words."""

    type: str
    ids: list[int]
    module: Any
    label: str
    emulated: bool = False

    def sync(self) -> None:
        self.module.synchronize()


def find_device(emulated_device: str | None = None) -> Device:
    """The host's accelerator (a GPU, a real NPU), else the emulated npu with ``emulated_device``'s properties."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        from shadow.npu import emulated
        from shadow.npu.device_properties import DeviceProperties

        emulated.install(2)
        emulated.set_properties(DeviceProperties.parse(emulated_device or EMULATED))
        return Device("npu", [0, 1], torch.npu, f"emulated npu, 2 devices ({emulated_device or EMULATED})", True)
    kind = accelerator.type
    module = getattr(torch, kind)
    count = torch.accelerator.device_count()
    emulated_now = (
        kind == "npu"
        and "shadow.npu.emulated" in sys.modules
        and sys.modules["shadow.npu.emulated"].installed_devices()
    )
    name = "emulated npu" if emulated_now else module.get_device_name(0)
    return Device(
        kind, [0, 1] if count > 1 else [0, 0], module, f"{name} ({kind}, {count} device(s))", bool(emulated_now)
    )


@contextlib.contextmanager
def _legacy() -> Iterator[None]:
    """torch_npu's installed patches where torch_npu is imported, else shadow.npu.reference's, for the block."""
    if "torch_npu" in sys.modules:
        yield
        return
    from shadow.npu import reference

    patches = reference.patch_torch()
    try:
        yield
    finally:
        patches.undo()


@contextlib.contextmanager
def _kernels(device: Device, deterministic: bool) -> Iterator[None]:
    """Deterministic kernels, or the device's nondeterministic ones (cudnn.benchmark; the emulated npu's
    nondeterministic reductions), for the block."""
    backends = torch.backends.cudnn
    before = (backends.deterministic, backends.benchmark)
    backends.deterministic, backends.benchmark = deterministic, not deterministic
    emulated = None
    if device.emulated:
        from shadow.npu import emulated

        emulated.set_nondeterministic(0.0 if deterministic else NONDETERMINISTIC)
        emulated.set_tail(0.0 if deterministic else TAIL)
    try:
        yield
    finally:
        backends.deterministic, backends.benchmark = before
        if emulated is not None:
            emulated.set_nondeterministic(0.0)
            emulated.set_tail(0.0)


@dataclasses.dataclass
class Training:
    """One training run's end: its parameters and buffers on the host, step times, peak device memory, the
    monitor's counts (None: unwrapped)."""

    state: dict[str, torch.Tensor]
    step_seconds: list[float]
    peak_bytes: int
    stats: dict[str, Any] | None


def train(device: Device, sizes: Sizes, steps: int, monitor: Callable[[], Any] | None) -> Training:
    """``steps`` steps of the CNN in DataParallel from a fixed seed, with ``monitor()`` installed (None: unwrapped)."""
    torch.manual_seed(0)
    model = _Net(sizes.image).to(f"{device.type}:0")
    parallel = nn.DataParallel(model, device_ids=device.ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    name = f"torch.{device.type}.FloatTensor"
    device.sync()
    device.module.reset_peak_memory_stats(0)
    installed = monitor() if monitor is not None else None
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            x = torch.randn(sizes.batch, 3, sizes.image, sizes.image).type(name)
            y = torch.randint(0, 10, (sizes.batch,)).to(f"{device.type}:0")
            loss = nn.functional.cross_entropy(parallel(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            device.sync()
            times.append(time.perf_counter() - start)
    finally:
        stats = installed.stats() if installed is not None else None
        if installed is not None:
            installed.uninstall()
    peak = int(device.module.max_memory_allocated(0))
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return Training(state, times, peak, stats)


def _bitwise(a: Training, b: Training) -> bool:
    return a.state.keys() == b.state.keys() and all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def _counts(stats: dict[str, Any] | None) -> dict[str, Any]:
    """Per target with calls: calls, compared, mismatches by reason, noise, skipped."""
    return {
        name: {
            "calls": s.calls, "compared": s.match + s.close + s.mismatch + s.noise + s.error,
            "mismatch": s.mismatch, "error": s.error, "noise": s.noise, "skipped": s.skipped,
            "by_reason": dict(s.by_reason), "backward_runs": s.backward_runs,
        }
        for name, s in (stats or {}).items()
        if s.calls
    }  # fmt: skip


def _defaults() -> dict[str, Any]:
    """The launcher's defaults, as ``shadow.install`` keywords (its sample rate and every setting)."""
    config = Config()
    return {"sample_rate": config.sample_rate, "settings": config.monitor_settings(False)}


def _install(**options: Any) -> Callable[[], Any]:
    return lambda: install(**options)


EVERY_RUN = {"sample_rate": 1.0, "seed": 1, "oracle": 1.0, "aa_rate": 1.0, "backward_rate": 1.0, "truth_rate": 1.0}


def check_bitwise(device: Device, sizes: Sizes) -> dict[str, Any]:
    """Training under deterministic kernels: unwrapped against shadowed (rate 1 with every extra run; the
    launcher's defaults) and, with upstream unwrapped as the reference, the canary phase at rate 1."""
    with _kernels(device, deterministic=True):
        with _legacy():
            plain = train(device, sizes, sizes.steps, None)
            every = train(device, sizes, sizes.steps, _install(**EVERY_RUN))
            defaults = train(device, sizes, sizes.steps, _install(**_defaults()))
            canary = train(device, sizes, sizes.steps, _install(sample_rate=1.0, seed=1, primary="upstream"))
        upstream = train(device, sizes, sizes.steps, None)
    return {
        "shadow_rate_1_every_run": _bitwise(plain, every),
        "shadow_defaults": _bitwise(plain, defaults),
        "canary_rate_1": _bitwise(upstream, canary),
        "counts_rate_1": _counts(every.stats),
    }


def check_nondeterministic(device: Device, sizes: Sizes) -> dict[str, Any]:
    """Training under nondeterministic kernels at rate 1 with A/A and backward runs: what an honest job counts (its
    calls beyond the noise thresholds against legacy's own A/A runs beyond them)."""
    with _kernels(device, deterministic=False), _legacy():
        run = train(device, sizes, sizes.steps, _install(sample_rate=1.0, seed=1, aa_rate=1.0, backward_rate=1.0))
    counts = _counts(run.stats)
    checks = [s.noise_checks for s in (run.stats or {}).values()]
    return {
        "beyond": sum(c.get(f"{e}/ab/beyond", 0) for c in checks for e in ("forward", "gradients")),
        "aa_beyond": sum(c.get(f"{e}/aa/beyond", 0) for c in checks for e in ("forward", "gradients")),
        "mismatches": sum(c["mismatch"] for c in counts.values()),
        "grad_mismatches": sum(c["by_reason"].get("grad", 0) for c in counts.values()),
        "compared": sum(c["compared"] for c in counts.values()),
        "counts": counts,
    }


def _weight_gradient(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A convolution's weight gradient: a reduction a device computes nondeterministically (atomics, the algorithm
    cuDNN's benchmark mode picks; the emulated npu's nondeterministic reductions)."""
    return torch.nn.grad.conv2d_weight(x, weight.shape, grad, padding=1)


def check_noise(device: Device, sizes: Sizes) -> dict[str, Any]:
    """A real divergence under the device's noise: a convolution's weight gradient, legacy against upstream at rate
    1 with an A/A run on every call, upstream honest, then wrong on ``NOISE_WRONG`` of its calls by each of
    ``NOISE_SIZES`` times its own jitter (that many times the difference between two of its runs). The verdict on
    each run's counts (each comparison a cluster): the honest one must not roll back, the wrong ones must not
    promote; each with the detection limit it states."""
    import random
    import types

    from shadow.analysis import decisions, evidence, verdict
    from shadow.core.judging import noise
    from shadow.core.model.target import Target

    calls = noise.BURN_IN + NOISE_CALLS["small" if sizes == SMALL else "full"]
    torch.manual_seed(0)
    on = f"{device.type}:0"
    x, weight = torch.randn(8, 3, 16, 16, device=on), torch.randn(16, 3, 3, 3, device=on)
    grad = torch.randn(8, 16, 16, 16, device=on)
    draws = random.Random(7)  # (the wrong calls' draws: the target's own, no generator of the job's)
    found: dict[str, Any] = {}
    with _kernels(device, deterministic=False):
        cases = [("honest", 0.0, 0.0)] + [(f"wrong {size:g}x", NOISE_WRONG, size) for size in NOISE_SIZES]
        for name, wrong, size in cases:

            def upstream(x: Any, weight: Any, grad: Any, wrong: float = wrong, size: float = size) -> Any:
                result = _weight_gradient(x, weight, grad)
                if draws.random() < wrong:
                    result = result + size * (result - _weight_gradient(x, weight, grad))
                return result

            owner = types.SimpleNamespace(op=_weight_gradient)
            target = Target("weight_gradient", owner, "op", upstream, isolate=False, signature=lambda a, k: "call")
            with install([target], sample_rate=1.0, aa_rate=1.0, seed=1, budget=None, deadline=None) as monitor:
                for _ in range(calls):
                    owner.op(x, weight, grad)
                stats = monitor.stats()["weight_gradient"]
            decided = verdict.decide("weight_gradient", evidence.from_stats(stats), decisions.DEFAULT_MAX_RATE)
            found[name] = {
                "calls": calls, "decision": decided.decision, "detection_limit": decided.detection_limit,
                "lower": decided.lower, "upper": decided.upper, "noise_checks": dict(stats.noise_checks),
                "mismatch": stats.mismatch, "why": decided.why, "size_limit": decided.size_limit,
            }  # fmt: skip
    wrong = [found[name]["decision"] != verdict.PROMOTE for name, _, size in cases if size]
    found["holds"] = found["honest"]["decision"] != verdict.ROLLBACK and all(wrong)
    return found


def check_cost(device: Device, sizes: Sizes) -> dict[str, Any]:
    """Median step time and peak device memory against the unwrapped run: the defaults, 1% and 100%."""
    steps = sizes.timed_steps + 2  # (the first two warm caches up, and are not timed)
    arms = {
        "unwrapped": None,
        "defaults": _install(**_defaults()),
        "rate_0.01": _install(sample_rate=0.01, seed=1, first_per_signature=0),
        "rate_1": _install(sample_rate=1.0, seed=1),
    }
    figures: dict[str, dict[str, float]] = {}
    with _kernels(device, deterministic=True), _legacy():
        for name, monitor in arms.items():
            run = train(device, sizes, steps, monitor)
            figures[name] = {"step_seconds": statistics.median(run.step_seconds[2:]), "peak_bytes": run.peak_bytes}
    base = figures["unwrapped"]
    for arm in figures.values():
        arm["step_ratio"] = arm["step_seconds"] / base["step_seconds"]
        arm["memory_ratio"] = arm["peak_bytes"] / max(base["peak_bytes"], 1)
    return figures


@contextlib.contextmanager
def _host_syncs(device: Device) -> Iterator[list[int]]:
    """Counts the host synchronizations this thread makes in the block into the list it yields: the emulated
    npu's counter, or CUDA's sync debug mode (its warnings); [] where the device has neither."""
    found: list[int] = []
    if device.emulated:
        from shadow.npu import emulated

        before = emulated.host_syncs()[0]
        yield found
        found.append(emulated.host_syncs()[0] - before)
    elif device.type == "cuda":
        mode = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        found.append(sum("synchroniz" in str(w.message) for w in caught))
    else:
        yield found


def check_sampled_call(device: Device, sizes: Sizes) -> dict[str, Any]:
    """One DataParallel forward with the device queue full: host synchronizations on the caller's thread and host
    time until it returns, sampled against unsampled."""
    torch.manual_seed(0)
    model = nn.DataParallel(_Net(sizes.image).to(f"{device.type}:0"), device_ids=device.ids)
    x = torch.randn(sizes.batch, 3, sizes.image, sizes.image).to(f"{device.type}:0")
    filler = torch.randn(512, 512, device=f"{device.type}:0")

    def timed(rounds: int) -> tuple[float, int]:
        seconds, syncs = [], 0
        for _ in range(rounds):
            device.sync()
            queued = [filler @ filler for _ in range(20)]  # (work the call must not wait for)
            with _host_syncs(device) as counted:
                start = time.perf_counter()
                model(x)
                seconds.append(time.perf_counter() - start)
            syncs += counted[0] if counted else 0
            del queued
        device.sync()
        return statistics.median(seconds), syncs

    with _kernels(device, deterministic=True), _legacy():
        model(x)  # (warm)
        unsampled = timed(5)
        with install(sample_rate=1.0, seed=1, aa_rate=0.0, backward_rate=0.0, oracle=0.0, truth_rate=0.0):
            model(x)
            sampled = timed(5)
        with install(sample_rate=1e-9, seed=1, first_per_signature=0):
            gated = timed(5)
    return {
        "unsampled_seconds": unsampled[0],
        "unwrapped_syncs_per_call": unsampled[1] / 5,
        "sampled_seconds": sampled[0],
        "sampled_syncs_per_call": sampled[1] / 5,
        "unsampled_wrapped_seconds": gated[0],
        "host_time_ratio": sampled[0] / unsampled[0],
        "sync_counter": "emulated npu"
        if device.emulated
        else ("cuda sync debug mode" if device.type == "cuda" else "none"),
    }


def check_comparator(device: Device, sizes: Sizes) -> dict[str, Any]:
    """``shadow.compare`` against ``torch.testing.assert_close`` on one pair of float32 and bfloat16 tensors on the
    device (median of 5, each ended by a synchronize), and which pass reduced them (:func:`fused.describe`)."""
    from shadow.core.judging import fused
    from shadow.core.judging.compare import compare

    figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(sizes.comparator_elements, device=f"{device.type}:0").to(dtype)
        b = a + 1e-3 * torch.randn_like(a)

        pair = (a, b)
        calls: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("compare", lambda pair=pair: compare(*pair)),
            ("assert_close", lambda pair=pair: torch.testing.assert_close(*pair, rtol=1.0, atol=1.0)),
        )
        timing = {}
        for name, fn in calls:
            fn()
            runs = []
            for _ in range(5):
                device.sync()
                start = time.perf_counter()
                fn()
                device.sync()
                runs.append(time.perf_counter() - start)
            timing[name] = statistics.median(runs)
        figures[str(dtype).removeprefix("torch.")] = {
            **timing, "ratio": timing["compare"] / timing["assert_close"], "pass": fused.describe(device.type),
        }  # fmt: skip
    return figures


def run_checks(sizes: Sizes, emulated_device: str | None = None) -> dict[str, Any]:
    """Every check on the host's accelerator; the bundle's content."""
    from shadow.launcher.doctor import diagnose

    device = find_device(emulated_device)
    started = time.monotonic()
    code, lines = diagnose(0, emulate_npu=2 if device.emulated else 0, legacy_from="reference")
    bundle: dict[str, Any] = {
        "device": device.label,
        "torch": torch.__version__,
        "sizes": dataclasses.asdict(sizes),
        "doctor": {"exit": code, "lines": lines},
    }
    for name, check in (
        ("bitwise", check_bitwise),
        ("nondeterministic", check_nondeterministic),
        ("noise", check_noise),
        ("cost", check_cost),
        ("sampled_call", check_sampled_call),
        ("comparator", check_comparator),
    ):
        bundle[name] = check(device, sizes)
    bundle["seconds"] = time.monotonic() - started
    bundle["bitwise_holds"] = all(
        bundle["bitwise"][k] for k in ("shadow_rate_1_every_run", "shadow_defaults", "canary_rate_1")
    )
    return bundle


def markdown(bundle: dict[str, Any]) -> str:
    """The bundle as the Markdown a team pastes into the pull request."""
    cost, call, bits, nd = bundle["cost"], bundle["sampled_call"], bundle["bitwise"], bundle["nondeterministic"]

    def held(flag: bool) -> str:
        return "yes" if flag else "**NO**"

    def row(check: str, figure: str, goal: str = "") -> str:
        return f"| {check} | {figure} | {goal} |"

    sizes, doctor = bundle["sizes"], bundle["doctor"]["exit"]
    rows = [
        f"# npu-shadow device check: {bundle['device']}",
        "",
        f"torch {bundle['torch']}; {bundle['seconds']:.0f} s; sizes {sizes}; doctor exit {doctor}",
        "",
        row("check", "figure", "goal"),
        "|---|---|---|",
        row(
            "training bitwise unchanged, shadow at rate 1 with every extra run",
            held(bits["shadow_rate_1_every_run"]),
            "yes",
        ),
        row("training bitwise unchanged, shadow at the launcher's defaults", held(bits["shadow_defaults"]), "yes"),
        row("training bitwise unchanged, canary at rate 1", held(bits["canary_rate_1"]), "yes"),
        row(
            f"mismatches under nondeterministic kernels (of {nd['compared']} compared; beyond the noise thresholds: "
            f"A/B {nd['beyond']}, legacy's own A/A {nd['aa_beyond']})",
            f"{nd['mismatches']} ({nd['grad_mismatches']} grad)",
            "as rare as legacy's own",
        ),
    ]
    wrong = [(f"wrong {size:g}x", "not promote") for size in NOISE_SIZES]
    for name, goal in [("honest", "not rollback"), *wrong]:
        case = bundle["noise"][name]
        checks = case["noise_checks"]
        beyond = checks.get("forward/ab/beyond", 0)
        judged = sum(checks.get(f"forward/ab/{check}", 0) for check in ("below", "within", "beyond"))
        aa = checks.get("forward/aa/beyond", 0)
        what = "honest" if name == "honest" else f"wrong on {NOISE_WRONG:.0%} of calls by {name[6:]} its jitter"
        rows.append(row(
            f"under noise, upstream {what} ({case['calls']} calls, A/A every call)",
            f"{case['decision']}: {beyond} beyond of {judged} (A/A {aa}), detection limit "
            f"{case['detection_limit']:.3g}",
            goal,
        ))  # fmt: skip
    for arm, goal_step, goal_memory in (("defaults", "<= 1.05x", "<= 1.3x"), ("rate_0.01", "", ""), ("rate_1", "", "")):
        figures = cost[arm]
        rows.append(row(f"step time at {arm} / unwrapped", f"{figures['step_ratio']:.3f}x", goal_step))
        rows.append(row(f"peak device memory at {arm} / unwrapped", f"{figures['memory_ratio']:.3f}x", goal_memory))
    syncs = f"{call['sampled_syncs_per_call']:g} (unwrapped {call['unwrapped_syncs_per_call']:g})"
    rows += [
        row(f"host synchronizations per sampled call, caller's thread ({call['sync_counter']})", syncs, "0"),
        row("host time of a sampled call / unsampled, queue full", f"{call['host_time_ratio']:.2f}x", "<= 1.5x"),
    ]
    for dtype, figures in bundle["comparator"].items():
        figure = f"{figures['ratio']:.2f}x ({figures['pass']})"
        rows.append(row(f"comparator / assert_close, {dtype}", figure, "<= 0.5x"))
    return "\n".join(rows) + "\n"


def write_bundle(bundle: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``device-check.json`` and ``device-check.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "device-check.json", out / "device-check.md"
    paths[0].write_text(json.dumps(bundle, indent=2, default=str) + "\n")
    paths[1].write_text(markdown(bundle))
    return paths


def main(out: str, small: bool, emulated_device: str | None) -> int:
    """``npu-shadow validate``: 0 where training stayed bitwise unchanged, 1 where it did not."""
    bundle = run_checks(SMALL if small else FULL, emulated_device)
    json_path, md_path = write_bundle(bundle, Path(out))
    sys.stdout.write(markdown(bundle))
    print(f"npu-shadow validate: wrote {json_path} and {md_path}", file=sys.stderr)
    return 0 if bundle["bitwise_holds"] else 1
