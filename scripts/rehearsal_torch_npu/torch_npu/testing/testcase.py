"""``torch_npu.testing.testcase`` for the rehearsal: torch's own ``TestCase`` with torch_npu's ``assertRtolEqual``
(relative error within ``prec``, ``prec16`` for half precision, as torch_npu's compares)."""

import numpy as np
import torch
from torch.testing._internal.common_utils import TestCase as _TorchTestCase
from torch.testing._internal.common_utils import run_tests

__all__ = ["TestCase", "run_tests"]


def _array(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.float().numpy() if value.dtype in (torch.bfloat16, torch.float16) else value.numpy()
    return np.asarray(value)


class TestCase(_TorchTestCase):
    def assertRtolEqual(self, x, y, prec=1.0e-4, prec16=1.0e-3, auto_trans_dtype=False, message=None):
        half = any(isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) for v in (x, y))
        first, second = _array(x), _array(y)
        self.assertEqual(first.shape, second.shape, message)
        if first.dtype == np.bool_ or not np.issubdtype(first.dtype, np.number):
            self.assertTrue(np.array_equal(first, second), message)
            return
        tolerance = prec16 if half else prec
        difference = np.abs(first.astype(np.float64) - second.astype(np.float64))
        limit = tolerance * np.maximum(np.abs(second.astype(np.float64)), 1.0)
        self.assertTrue(bool(np.all(difference <= limit)), message or f"relative error above {tolerance}")
