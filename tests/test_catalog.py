"""One row per built-in target (shadow.npu.catalog): everything else about the built-ins is derived from it, so a
target is one row and one factory."""

import json
import os
import subprocess
import sys

import pytest

from shadow.npu import catalog

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_ADDED = """
import json, sys
from shadow.npu import catalog
catalog.CATALOG += (catalog.Row(
    "tensor_neg", "torch.Tensor", "neg", "torch_npu/utils/tensor_methods.py", "_npu_neg", "row_target:tensor_neg",
    risky=("*",), wrapped="`torch.Tensor.neg`", upstream="`torch._C.TensorBase.neg`",
),)
import torch
import shadow
from shadow.analysis import census
from shadow.core.model import targets
from shadow.core.model.observation import BUILTIN_RISKY, BUILTIN_TARGETS
from shadow.launcher import doctor, setting_values
from shadow.npu import torch_npu_source
with shadow.install(["tensor_neg"], sample_rate=1.0) as monitor:
    negated = torch.arange(3.0).neg()
    stats = monitor.stats()["tensor_neg"]
code, lines = doctor.diagnose(0)
print(json.dumps({
    "names": list(BUILTIN_TARGETS), "risky": BUILTIN_RISKY["tensor_neg"],
    "setting": "tensor_neg" in setting_values.BUILTINS,
    "place": targets.PLACES["tensor_neg"][0]() is torch.Tensor,
    "patch": [p.definition for p in torch_npu_source.PATCHES if p.target == "tensor_neg"],
    "census": [t for o, a, t in census._shadowing() if (o, a) == (torch.Tensor, "neg")],
    "docs": [line for line in catalog.docs_table().splitlines() if "tensor_neg" in line],
    "doctor": [line for line in lines if line.startswith("can shadow here")],
    "compared": stats.match, "value": negated.tolist(),
}))
"""


@pytest.mark.slow
def test_a_target_added_as_one_row_and_one_factory_is_a_built_in_everywhere():
    """A process whose catalog has one more row (its factory in tests/row_target.py): the target installs by name,
    compares, and the vocabulary, settings, places, torch_npu's patches, the census, doctor and the docs table all
    have it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, ROOT])}
    done = subprocess.run([sys.executable, "-c", _ADDED], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["names"][-1] == "tensor_neg" and found["risky"] == ["*"] and found["setting"] and found["place"]
    assert found["patch"] == ["_npu_neg"] and found["census"] == ["tensor_neg"]
    assert found["docs"] and "`torch_npu/utils/tensor_methods.py`: `_npu_neg`" in found["docs"][0]
    assert "tensor_neg" in found["doctor"][0]
    assert found["compared"] == 1 and found["value"] == [-0.0, -1.0, -2.0]


def test_the_docs_table_is_the_catalogs():
    with open(os.path.join(ROOT, "docs", "targets.md"), encoding="utf-8") as file:
        assert catalog.docs_table() in file.read()


def test_every_row_names_a_factory_and_a_place_that_exist():
    for row in catalog.CATALOG:
        assert callable(row.factory_function()), row.name
        assert hasattr(row.resolve_owner(), row.attribute) or row.name == "module_npu", row.name
