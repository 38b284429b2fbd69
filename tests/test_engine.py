"""The engine through custom targets: detection, failures on either side, isolation, exporters."""

import os
import types

import pytest
import torch
from fakes import FailingExporter, Recorder

import shadow
from shadow import Target
from shadow.core.model import contract


def scale(x):
    return x * 2


def make_ops(legacy=scale):
    return types.SimpleNamespace(op=legacy)


def run_target(upstream, legacy=scale, calls=1, inputs=None, **target_kwargs):
    ops = make_ops(legacy)
    recorder = Recorder()
    target = Target("op", ops, "op", upstream, **target_kwargs)
    with shadow.install([target], sample_rate=1.0, exporters=[recorder]) as monitor:
        results = [ops.op(inputs if inputs is not None else torch.arange(6.0)) for _ in range(calls)]
    assert ops.op is legacy
    return results, recorder.observations, monitor.stats()["op"]


FAULTS = {
    "dtype": lambda x: scale(x).half(),
    "shape": lambda x: scale(x)[:-1],
    "device": lambda x: scale(x).to("meta"),
    "value": lambda x: scale(x) + 0.5,
    "nan": lambda x: scale(x).index_fill(0, torch.tensor([2]), float("nan")),
    "structure": lambda x: (scale(x),),
    "type": lambda x: scale(x).tolist(),
    "exception": lambda x: 1 / 0,
}


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_each_injected_fault_is_reported_with_its_reason(kind):
    results, observations, stats = run_target(FAULTS[kind])
    assert torch.equal(results[0], torch.arange(6.0) * 2)  # the caller always gets legacy's result
    (observation,) = observations
    expected_outcome = "error" if kind == "exception" else "mismatch"
    assert observation.outcome == expected_outcome
    if kind == "type":
        assert observation.reasons == ("structure",)  # a tensor became a list: the trees differ
    else:
        assert kind in observation.reasons
    assert observation.detail
    assert stats.sampled == 1 and getattr(stats, expected_outcome) == 1


def test_alias_fault_is_reported():
    def identity(x):
        return x

    _, observations, _ = run_target(lambda x: x.clone(), legacy=identity)
    assert observations[0].reasons == ("alias",)
    _, observations, _ = run_target(identity, legacy=identity)
    assert observations[0].outcome == "match"


def test_identical_implementations_never_mismatch_over_random_calls():
    generator = torch.Generator().manual_seed(0)
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]

    def legacy(x, k):
        return {"y": (x * k + 1).to(x.dtype), "n": x.shape[0]}

    def upstream(x, k):
        return {"y": (x * k + 1).to(x.dtype), "n": x.shape[0]}

    ops = types.SimpleNamespace(op=legacy)
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        for i in range(1000):
            n = int(torch.randint(1, 64, (1,), generator=generator))
            x = (torch.randn(n, generator=generator) * 10).to(dtypes[i % len(dtypes)])
            ops.op(x, i % 7)
    stats = monitor.stats()["op"]
    assert stats.sampled == 1000 and stats.match == 1000
    assert stats.mismatch == stats.error == stats.skipped == 0


def test_upstream_raising_never_reaches_the_caller():
    results, observations, stats = run_target(FAULTS["exception"], calls=3)
    assert all(torch.equal(r, torch.arange(6.0) * 2) for r in results)
    assert stats.error == 3 and stats.by_reason == {"exception": 3}
    assert "ZeroDivisionError" in observations[0].detail


def test_legacy_raising_reaches_the_caller_unchanged():
    class Boom(RuntimeError):
        pass

    error = Boom("legacy says no")

    def legacy(x):
        raise error

    ops = make_ops(legacy)
    recorder = Recorder()
    with (
        shadow.install([Target("op", ops, "op", scale)], sample_rate=1.0, exporters=[recorder]),
        pytest.raises(Boom) as caught,
    ):
        ops.op(torch.ones(1))
    assert caught.value is error and str(caught.value) == "legacy says no"
    assert recorder.observations[0].outcome == "error"

    # Both sides raising the same way is agreement, and still the legacy exception reaches the caller.
    with (
        shadow.install([Target("op", ops, "op", legacy)], sample_rate=1.0, exporters=[recorder]),
        pytest.raises(Boom),
    ):
        ops.op(torch.ones(1))
    assert recorder.observations[-1].outcome == "match"


def test_comparator_and_exporter_failures_are_counted_and_swallowed(monkeypatch, caplog):
    import shadow.core.calls.sampled.findings

    def broken_compare(*args, **kwargs):
        raise RuntimeError("comparator bug")

    monkeypatch.setattr(shadow.core.calls.sampled.findings, "start_comparing", broken_compare)
    ops = make_ops()
    with shadow.install([Target("op", ops, "op", scale)], sample_rate=1.0, exporters=[FailingExporter()]) as monitor:
        out = [ops.op(torch.ones(2)) for _ in range(5)]
    assert all(torch.equal(o, torch.full((2,), 2.0)) for o in out)
    stats = monitor.stats()["op"]
    assert stats.skipped == 5 and stats.by_reason["comparator"] == 5 and stats.export_errors == 5
    # logged, but at most once a minute per kind
    assert sum("comparator bug" in r.getMessage() for r in caplog.records) == 1
    assert sum("disk full" in r.getMessage() for r in caplog.records) == 1


def test_upstream_out_of_memory_is_skipped_as_oom():
    def oom(x):
        raise torch.OutOfMemoryError("out of memory: tried to allocate 1 TiB")

    _, observations, stats = run_target(oom)
    assert observations[0].outcome == "skipped" and observations[0].reasons == ("oom",)
    assert stats.skipped == 1 and stats.error == 0


def test_nested_calls_are_part_of_the_callers_call_and_run_by_the_side_that_made_them():
    ops = types.SimpleNamespace()

    def legacy(x, depth=0):
        return x + (ops.op(x, depth - 1) if depth > 0 else 0)

    ops.op = legacy
    with shadow.install([Target("op", ops, "op", legacy)], sample_rate=1.0) as monitor:
        ops.op(torch.ones(1), 1)
    stats = monitor.stats()["op"]
    # one call of the job's, shadowed; the inner calls (legacy's and the upstream run's) are part of it
    assert stats.calls == 1 and stats.match == 1 and stats.skipped == 0


def test_upstream_runs_in_the_callers_grad_mode_on_copies_of_the_arguments():
    seen = {}

    def upstream(x):
        seen["grad_enabled"] = torch.is_grad_enabled()
        x.add_(100)  # on its own copy
        return x * 2 - 200

    ops = make_ops(lambda x: x * 2)
    x = torch.zeros(3)
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(x)
    assert seen["grad_enabled"] is True  # the caller's (its graph never reaches x: see test_same_call.py)
    assert torch.equal(x, torch.zeros(3))
    assert monitor.stats()["op"].match == 1


def test_a_call_whose_legacy_writes_an_argument_in_place_is_skipped():
    """Arguments are copied after legacy (never at the cost of legacy's memory): where legacy changed one, upstream
    could not start from what legacy started from."""
    ran = []

    def legacy(x):
        x.add_(1)
        return x * 2

    ops = make_ops(legacy)
    x = torch.zeros(3)
    with shadow.install([Target("op", ops, "op", lambda x: ran.append(x) or x)], sample_rate=1.0) as monitor:
        ops.op(x)
    assert torch.equal(x, torch.ones(3))  # legacy's in-place change, exactly once
    assert ran == []
    assert monitor.stats()["op"].by_reason == {"inplace": 1}


def test_rng_is_replayed_for_upstream_and_left_where_legacy_left_it():
    def legacy(x):
        return torch.nn.functional.dropout(x, 0.5, training=True)

    torch.manual_seed(0)
    expected = legacy(torch.ones(100))
    expected_state = torch.get_rng_state()

    ops = make_ops(legacy)
    torch.manual_seed(0)
    with shadow.install([Target("op", ops, "op", legacy)], sample_rate=1.0) as monitor:
        got = ops.op(torch.ones(100))
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), expected_state)
    assert monitor.stats()["op"].match == 1  # same mask on both sides


def test_upstream_drawing_more_random_numbers_leaves_every_generator_where_legacy_left_it():
    import random

    import numpy as np

    def legacy(x):
        return x + torch.rand(1)

    def upstream(x):
        out = x + torch.rand(1)
        random.random()
        np.random.rand(3)
        torch.rand(1000)
        return out

    def states():
        return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    legacy(torch.zeros(1))
    expected = states()

    ops = make_ops(legacy)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0) as monitor:
        ops.op(torch.zeros(1))
    got = states()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and (got[2] == expected[2]).all()
    assert monitor.stats()["op"].match == 1  # upstream's torch.rand(1) drew the same number as legacy's


@pytest.mark.parametrize("cached", [False, True], ids=["no-cached-normal", "a-cached-normal"])
def test_numpys_whole_state_is_where_legacy_left_it_its_cached_normal_too(cached):
    """NumPy's legacy generator keeps the second of each pair of normals it draws (``has_gauss``, ``gauss``): an
    upstream that takes that cached normal, or leaves one, moves no word of the key. Every run of the shadow side
    ends with the state legacy left, the cache as it was, for as many runs as a call makes (A/A and backward runs
    restore the same snapshot again)."""
    import numpy as np

    def legacy(x):
        return x * 2

    def upstream(x):
        np.random.standard_normal()  # (the cache taken where there is one, else a pair drawn and one kept)
        return x * 2

    def state():
        name, key, pos, has_gauss, gauss = np.random.get_state()
        return name, key.tolist(), pos, has_gauss, gauss

    def start():
        np.random.seed(7)
        if cached:
            np.random.standard_normal()

    start()
    legacy(torch.ones(3, requires_grad=True)).sum().backward()
    expected = state()
    assert expected[3] == int(cached)
    ops = make_ops(legacy)
    start()
    with shadow.install([Target("op", ops, "op", upstream)], sample_rate=1.0, aa_rate=1.0, backward_rate=1.0,
                        seed=1) as monitor:  # fmt: skip
        ops.op(torch.ones(3, requires_grad=True)).sum().backward()
    assert state() == expected
    assert monitor.stats()["op"].match == 1 and monitor.stats()["op"].backward_runs == 1


class HookedExporter(Recorder):
    def __init__(self):
        super().__init__()
        self.registered, self.calls, self.export_errors = {}, 0, 0

    def record(self, samples):
        for metric, labels, value in samples:
            if metric is contract.SAMPLE_RATE:
                self.registered[labels[0]] = value
            elif metric is contract.CALLS:
                self.calls += value
            elif metric is contract.EXPORT_ERRORS:
                self.export_errors += value


def test_the_record_hook_sees_registration_calls_and_failures_as_samples():
    ops = make_ops()
    hooked = HookedExporter()
    with shadow.install(
        [Target("op", ops, "op", scale)], sample_rate=0.3, seed=2, exporters=[hooked, FailingExporter()]
    ) as monitor:
        for _ in range(500):
            ops.op(torch.ones(1))
    stats = monitor.stats()["op"]
    assert hooked.registered == {"op": 0.3}
    assert hooked.calls == stats.calls == 500  # the last calls arrive with the flush at uninstall
    assert hooked.export_errors == stats.export_errors == stats.sampled == len(hooked.observations)


def test_mismatch_observations_carry_evidence_and_matches_do_not():
    _, observations, _ = run_target(FAULTS["value"])
    evidence = observations[0].evidence
    assert torch.equal(evidence.args[0], torch.arange(6.0))
    assert torch.equal(evidence.legacy, evidence.upstream - 0.5)
    _, observations, _ = run_target(scale)
    assert observations[0].evidence is None


def test_an_exporter_calling_a_wrapped_function_does_not_recurse():
    ops = make_ops()

    class Calling:
        def __init__(self):
            self.seen = 0

        def export(self, observation):
            self.seen += 1
            ops.op(torch.ones(1))  # e.g. a capture that casts a tensor

    exporter = Calling()
    with shadow.install([Target("op", ops, "op", scale)], sample_rate=1.0, exporters=[exporter]) as monitor:
        ops.op(torch.ones(1))
    stats = monitor.stats()["op"]
    assert stats.calls == 1  # the job's call; the exporter's is the tool's work
    assert stats.sampled == stats.match == 1 and stats.skipped == 0  # only the job's call is shadowed
    assert exporter.seen == 1


def test_an_isolation_that_fails_is_a_counted_skip_never_the_shadow_sides_exception(monkeypatch) -> None:
    """Setting up the shadow run's isolated world is this tool's work: its failure is a "comparator" skip, never
    compared as upstream's exception (a divergence, against promotion)."""
    import contextlib

    from shadow.core.runs import isolation

    @contextlib.contextmanager
    def broken(self, run=0):
        raise RuntimeError("restoring the generators failed")
        yield

    monkeypatch.setattr(isolation.Isolation, "shadow_run", broken)
    owner = types.SimpleNamespace(op=lambda x: x * 2)
    target = shadow.Target("op", owner, "op", lambda x: x * 2)
    with shadow.install([target], sample_rate=1.0, budget=None) as monitor:
        assert torch.equal(owner.op(torch.ones(2)), torch.full((2,), 2.0))
        stats = monitor.stats()["op"]
    assert (stats.error, stats.skipped, dict(stats.by_reason)) == (0, 1, {"comparator": 1})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_childs_counts_start_at_zero_for_every_counter():
    """A forked child (a DataLoader worker) counts its own calls: every count its parent had (outcomes, reasons,
    clusters, signatures past the cap, exporters' failures, ...) is zero there, the whole tally started again (the
    counters reset one by one missed the signatures past the cap)."""
    import dataclasses
    import pickle

    import fakes

    from shadow.core.calls.gate.coverage import MAX_SIGNATURES
    from shadow.core.model.observation import TargetStats

    class Failing:
        def export(self, observation):
            raise RuntimeError("disk full")

    ops, target = fakes.op_target(lambda x: x * 3, signature=lambda args, kwargs: f"s{int(args[0][0])}")
    with shadow.install([target], sample_rate=1.0, first_per_signature=1, exporters=[Failing()]) as monitor:
        for i in range(MAX_SIGNATURES + 5):
            ops.op(torch.full((2,), float(i)))
        monitor.deliver()  # (the exporter's failures are counted as it fails, on delivery)
        parent = monitor.stats()["op"]
        assert parent.signatures_over_cap > 0 and parent.export_errors > 0 and parent.mismatch > 0
        assert parent.clusters > 0 and parent.by_reason
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # (the child: its counts, to the parent, then out without the parent's exit handlers)
            try:
                stats = monitor.stats()["op"]
                fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
                os.write(write, pickle.dumps({k: dict(v) if hasattr(v, "keys") else v for k, v in fields.items()}))
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            child = pickle.loads(pipe.read())
        os.waitpid(pid, 0)
    fresh = TargetStats(primary="legacy")
    assert {k: v for k, v in child.items() if v != getattr(fresh, k)} == {}


def test_a_pure_signature_function_is_never_checked_so_other_threads_draws_are_never_put_back(monkeypatch):
    """The side-effect check of a signature function snapshots every generator around it and puts them back where
    they changed: in a job whose other threads draw random numbers meanwhile (DataParallel's replicas on the npu),
    it took their draws for the function's and rewound them, and the training was no longer bitwise the same (the
    clean-clone run caught it, for tensor_type under load). The built-ins' signature functions are declared pure
    and never checked; a user's is checked as before."""
    import threading

    from shadow.core.calls.gate import coverage as classifier
    from shadow.core.model import targets

    checked = []
    real = classifier.call_without_side_effects
    monkeypatch.setattr(classifier, "call_without_side_effects", lambda f, *a: checked.append(f) or real(f, *a))
    assert targets.tensor_type().signature_pure
    ops = make_ops()
    pure = Target("op", ops, "op", scale, signature=lambda a, k: "s", signature_pure=True, isolate=False)
    with shadow.install([pure], sample_rate=0.0, first_per_signature=1000, seed=1):
        for _ in range(10):
            ops.op(torch.ones(2))
    assert checked == []
    user = Target("op", ops, "op", scale, signature=lambda a, k: "s", isolate=False)
    with shadow.install([user], sample_rate=0.0, first_per_signature=1000, seed=1):
        ops.op(torch.ones(2))
    assert len(checked) == 1

    # a thread drawing random numbers while tensor_type classifies casts: its stream is never rewound
    generator_seed, draws, done = 7, [], threading.Event()

    def drawing():
        torch.manual_seed(generator_seed)
        while not done.is_set() or len(draws) < 2000:
            draws.append(torch.rand(1).item())

    x = torch.ones(2)
    with shadow.install([targets.tensor_type()], sample_rate=0.0, first_per_signature=1000, seed=1):
        thread = threading.Thread(target=drawing)
        thread.start()
        for _ in range(2000):
            x.type(torch.float16)
        done.set()
        thread.join()
    torch.manual_seed(generator_seed)
    assert draws == [torch.rand(1).item() for _ in draws]
