"""scripts/torch_npu_tests.py: torch_npu-style tests run on the emulated npu unshadowed and under the monitor, every
outcome the same, the journal's counts read back (the script runs the Ascend/pytorch repository's own tests the same
way: docs/targets.md)."""

import os
import subprocess
import sys

import pytest
from torch_npu_wheels import wheel

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A test file as torch_npu's are written: its TestCase, npu tensors, its format functions.
STYLE = """
import io
import torch
import torch_npu
from torch_npu.testing.testcase import TestCase, run_tests


class TestLikeTorchNpus(TestCase):
    def test_save_and_load(self):
        x = torch.randn(4).npu()
        buffer = io.BytesIO()
        torch.save({"x": x}, buffer)
        buffer.seek(0)
        self.assertRtolEqual(x.cpu(), torch.load(buffer)["x"].cpu())

    def test_repr_of_an_internal_format(self):
        x = torch_npu.npu_format_cast(torch.ones(2, 2).npu(), torch_npu.Format.FRACTAL_NZ)
        self.assertEqual(torch_npu.get_npu_format(x), 29)
        self.assertNotIn("device=", repr(x))  # (torch_npu's own repr: the host copy's)

    def test_fails_on_its_own(self):
        self.assertEqual(torch.ones(1).npu().cpu().item(), 2.0)


if __name__ == "__main__":
    run_tests()
"""


def test_the_script_runs_a_checkouts_tests_twice_and_finds_no_flip(tmp_path):
    wheel("2.14.0")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_style.py").write_text(STYLE)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "torch_npu_tests.py"), "--checkout", str(tmp_path),
         "test/test_style.py"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 tests, unshadowed 1 failed, 2 passed" in done.stdout, done.stdout
    assert "outcomes that differ under the monitor: 0" in done.stdout
    assert "torch_save: match 1" in done.stdout and "torch_load: match 1" in done.stdout, done.stdout
    assert "tensor_repr: mismatch 1" in done.stdout and "format=internal" in done.stdout, done.stdout
