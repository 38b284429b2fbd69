"""A target made of one catalog row and this one factory (tests/test_catalog.py)."""

import torch

from shadow.core.model.target import Target


def tensor_neg() -> Target:
    """``Tensor.neg`` against torch's own, compared exactly."""
    return Target(name="tensor_neg", owner=torch.Tensor, attribute="neg", upstream=torch._C.TensorBase.neg, exact=True)
