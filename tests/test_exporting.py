"""The exporter protocol declares every hook the core calls, and every call of one is guarded in one place."""

import ast
import os
import types

import faults
import pytest
import torch

import shadow
from shadow.core.calls.record.exporting import HOOKS, Exporter, call_hook
from shadow.core.calls.sampled.drill import Drill

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_protocol_declares_exactly_the_hooks():
    declared = [name for name, value in vars(Exporter).items() if callable(value) and not name.startswith("_")]
    assert declared == list(HOOKS)


def test_every_hook_the_code_calls_is_declared():
    """Hooks are named as string literals where they are called: through call_hook or the publisher's each."""
    called = set()
    for directory, _, files in os.walk(os.path.join(ROOT, "shadow")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name), encoding="utf-8") as file:
                    tree = ast.parse(file.read())
                for node in ast.walk(tree):
                    if not isinstance(node, ast.Call):
                        continue
                    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                    if name in ("call_hook", "each") and node.args:
                        hook = node.args[1 if name == "call_hook" else 0]
                        if isinstance(hook, ast.Constant):
                            called.add(hook.value)
    assert called and called <= set(HOOKS), called - set(HOOKS)
    with pytest.raises(ValueError, match="not an exporter hook"):
        call_hook(object(), "flush_everything")


def test_a_hook_that_raises_anything_is_returned_not_raised():
    class Raising:
        def record(self, samples):
            raise SystemExit(4)

    assert isinstance(call_hook(Raising(), "record", []), SystemExit)
    assert call_hook(object(), "record", []) is None  # an exporter without the hook


def test_an_exporter_failing_to_record_does_not_stop_the_install_nor_its_records():
    class Raising:
        def __init__(self):
            self.observations = []

        def export(self, observation):
            self.observations.append(observation)

        def record(self, samples):
            raise OSError("disk full")

    exporter = Raising()
    ops = types.SimpleNamespace(op=faults.scale)
    with shadow.install([shadow.Target("op", ops, "op", faults.scale)], sample_rate=1.0, exporters=[exporter],
                        drill=Drill("value", 0.0)) as monitor:  # fmt: skip
        ops.op(torch.ones(2))
    assert monitor.stats()["op"].match == 1 and len(exporter.observations) == 1


def test_samples_that_cannot_be_made_are_every_exporters_failure_never_the_callers():
    """The samples are made at delivery, outside any exporter's hook: a failure there (on the caller's thread at a
    flush) is counted as each exporter's, and the record still goes to them."""
    from shadow.core.calls.record.record import Publisher
    from shadow.core.model.observation import Observation

    class Keep:
        def __init__(self):
            self.records, self.samples = [], []

        def export(self, record):
            self.records.append(record)

        def record(self, samples):
            self.samples.extend(samples)

    def unmakeable():
        raise ValueError("no samples today")

    kept, told = Keep(), []
    publisher = Publisher([kept, Keep()])
    observation = Observation("op", "match")
    publisher.export("op", observation, unmakeable, told.append)
    publisher.deliver()
    assert kept.records == [observation] and told == [2]
    assert [(metric.otel_name, labels, value) for metric, labels, value in kept.samples] == [
        ("npu_shadow.export_errors", ("op",), 2)
    ]
