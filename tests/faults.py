"""Importable upstream faults, so that repro captures can name them and replay can re-run them."""

import torch


def type_to_half(self, dtype=None, non_blocking=False, **kwargs):
    """An upstream Tensor.type that casts everything to float16: a dtype divergence."""
    out = torch._C.TensorBase.type(self, dtype, non_blocking, **kwargs)
    return out.half() if isinstance(out, torch.Tensor) else out


def scale(x):
    return x * 2


def scale_wrong(x):
    return x * 2 + (x > 2)


class ScaledGradient(torch.autograd.Function):
    """The identity forward (bitwise), a backward that scales the gradient: a difference only backward shows."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5
