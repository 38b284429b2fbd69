"""install(): discovery of active patches, restoring exactly, and clear errors for bad arguments."""

import logging
import types

import pytest
import torch

import shadow
import shadow.core.calls.monitor
from shadow import Target, Tolerance
from shadow.core.model import targets as builtin


def test_discovers_the_fake_torch_npu_patches_and_restores_identity(fake_torch_npu):
    before = {
        "type": torch.Tensor.type,
        "parallel_apply": torch.nn.DataParallel.parallel_apply,
        "data_parallel": torch.nn.parallel.data_parallel,
    }
    assert before["type"].__module__ == "torch_npu.utils.tensor_methods"
    monitor = shadow.install()
    assert set(monitor.targets) == {"parallel_apply", "data_parallel", "tensor_type"}
    assert torch.Tensor.type is not before["type"]
    assert monitor.experiment("tensor_type").legacy is before["type"]
    monitor.uninstall()
    assert torch.Tensor.type is before["type"]
    assert torch.nn.DataParallel.parallel_apply is before["parallel_apply"]
    assert torch.nn.parallel.data_parallel is before["data_parallel"]
    monitor.uninstall()  # twice is harmless


def test_without_torch_npu_nothing_is_installed_and_it_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(shadow.core.calls.monitor, "_NOTICES", shadow.core.calls.monitor._Notices())
    with caplog.at_level(logging.INFO, logger="shadow"), pytest.warns(RuntimeWarning) as warned:
        first = shadow.install()
        second = shadow.install()
    assert first.targets == () and second.targets == () and first.stats() == {}
    assert sum("nothing is shadowed" in r.getMessage() for r in caplog.records) == 1
    (warning,) = [w for w in warned if "npu-shadow" in str(w.message)]  # said once, naming what was looked for
    assert "torch.Tensor.type" in str(warning.message) and "stats() stays empty" in str(warning.message)


def test_reference_patches_count_as_a_rehearsal(caplog):
    from shadow.npu import reference

    patches = reference.patch_torch()
    try:
        with caplog.at_level(logging.INFO, logger="shadow"), shadow.install() as monitor:
            assert set(monitor.targets) == {"parallel_apply", "data_parallel", "tensor_type"}
        assert any("rehearsal" in r.getMessage() for r in caplog.records)
    finally:
        patches.undo()


def test_inherited_attribute_is_deleted_again_on_uninstall():
    class Base:
        def op(self):
            return 1

    class Owner(Base):
        pass

    with shadow.install([Target("op", Owner, "op", Base.op)]):
        assert "op" in vars(Owner)
    assert "op" not in vars(Owner)
    assert Owner.op is Base.op


def test_staticmethod_stays_a_staticmethod():
    class Owner:
        @staticmethod
        def op(x):
            return x + 1

    raw = vars(Owner)["op"]
    with shadow.install([Target("op", Owner, "op", lambda x: x + 1)], sample_rate=1.0) as monitor:
        assert Owner().op(1) == 2 and Owner.op(1) == 2
    assert vars(Owner)["op"] is raw
    assert monitor.stats()["op"].match == 2


def test_installing_twice_over_the_same_attribute_is_an_error():
    with shadow.install(["tensor_type"]), pytest.raises(ValueError, match="already shadowed"):
        shadow.install(["tensor_type"])
    ops = types.SimpleNamespace(op=abs)
    with pytest.raises(ValueError, match="more than one target wraps"):
        shadow.install([Target("a", ops, "op", abs), Target("b", ops, "op", abs)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"targets": ["tensor_typo"]}, r"unknown target 'tensor_typo'; allowed: built-in names \['data_parallel', "),
        ({"targets": [42]}, "unknown target 42"),
        ({"sample_rate": 1.5}, r"sample_rate: expected a number in \[0, 1\], got 1.5"),
        ({"sample_rate": -0.1}, r"sample_rate: expected a number in \[0, 1\]"),
        ({"sample_rate": "0.1"}, r"sample_rate: expected a number in \[0, 1\], got '0.1'"),
        ({"sample_rate": {"tensor_type": 2}}, r"sample_rate\['tensor_type'\]: expected a number in \[0, 1\]"),
        ({"sample_rate": {"nope": 0.1}}, r"sample_rate: unknown target\(s\) \['nope'\]; installed targets are"),
        ({"tolerance": {"tensor_type": 1e-3}}, r"tolerance\['tensor_type'\]: expected a shadow.Tolerance"),
        ({"tolerance": {torch.float32: 1e-3}}, "a tolerance table maps torch.dtype to shadow.Tolerance"),
        ({"tolerance": {"tensor_type": Tolerance(0, 0), torch.float32: Tolerance(0, 0)}}, "not both"),
        ({"exporters": [object()]}, "has neither an export"),
        ({"seed": "x"}, "seed: expected an int or None"),
    ],
)
def test_bad_arguments_fail_before_anything_is_patched(kwargs, message):
    kwargs.setdefault("targets", ["tensor_type"])
    before = vars(torch.Tensor).get("type")
    with pytest.raises(ValueError, match=message):
        shadow.install(**kwargs)
    assert vars(torch.Tensor).get("type") is before


@pytest.mark.parametrize("field, value", [("rtol", -1e-3), ("atol", -1.0), ("atol", float("nan"))])
def test_negative_or_nonfinite_tolerance_is_rejected(field, value):
    with pytest.raises(ValueError, match=f"Tolerance.{field} must be"):
        Tolerance(**{"rtol": 0.0, "atol": 0.0, field: value})


def test_rates_and_tolerances_per_target():
    ops = types.SimpleNamespace(op=lambda x: x * 1, other=lambda x: x)
    targets = [Target("op", ops, "op", lambda x: x + 1e-3), Target("other", ops, "other", lambda x: x)]
    with shadow.install(
        targets, sample_rate={"op": 1.0, "other": 0.0}, tolerance={"op": Tolerance(0.0, 1e-2)}
    ) as monitor:
        for _ in range(10):
            ops.op(torch.ones(2))
            ops.other(torch.ones(2))
    stats = monitor.stats()
    assert stats["op"].sampled == 10 and stats["op"].close == 10
    assert stats["other"].calls == 10 and stats["other"].sampled == 0


def test_builtin_targets_name_their_risky_signatures():
    # (stated here: a name or class of a device other than the current one, torch_npu's own names, and npu elsewhere)
    assert builtin.tensor_type().risky_signatures == (
        "npu_name/noncurrent/*", "npu_class/noncurrent/*", "torch_npu_name/*", "npu_name_elsewhere/*",
        "npu_class_elsewhere/*",
    )  # fmt: skip
    x = torch.ones(1)
    assert builtin.tensor_type_signature((x, "torch.npu.HalfTensor"), {}) == "npu_name/cpu/blocking"
    assert builtin.tensor_type_signature((x,), {"dtype": torch.half, "non_blocking": True}) == "dtype/cpu/nonblocking"
    assert builtin.tensor_type_signature((x, "torch.FloatTensor"), {}) == "name/cpu/blocking"
    assert builtin.tensor_type_signature((x, torch.FloatTensor), {}) == "class/cpu/blocking"
    assert builtin.tensor_type_signature((x,), {}) == "none/cpu/blocking"
    with torch.autocast("cpu"):
        assert builtin.parallel_apply_signature((None, [1, 2], [], None), {}).startswith("replicas=2+/grad=on")


def test_warns_when_torch_npu_is_installed_but_not_imported_yet(monkeypatch):
    import os
    import sys
    import warnings

    fake = os.path.join(os.path.dirname(__file__), "fake_torch_npu")
    monkeypatch.syspath_prepend(fake)
    assert "torch_npu" not in sys.modules
    with pytest.warns(RuntimeWarning, match="torch_npu is installed but not imported yet"):
        shadow.install(["tensor_type"]).uninstall()
    assert "torch_npu" not in sys.modules  # the check does not import it
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shadow.install(["tensor_type"]).uninstall()  # not installed here: no warning
