"""The emulated npu's internal formats: what ``torch_npu.npu_format_cast`` and ``torch_npu.get_npu_format`` do.

A real NPU keeps some tensors in an internal layout (``FRACTAL_NZ`` for matmul weights, ``NC1HWC0`` for batch
norm's), and torch_npu's patches branch on it: ``Tensor.__repr__`` prints such a tensor through ``.cpu()``
(torch_npu 2.13/2.14), ``TypedStorage._deepcopy`` casts the copy back to its source's format. The emulated npu
holds every tensor in host memory as torch lays it out; this module gives it the one property those branches read:
a tensor made by :func:`cast` into a format other than ND reports that format, every other tensor ND. Values and
strides are never changed (the rehearsal's layout is torch's).

As in torch_npu, a cast to another format makes a new tensor, and a cast to the format a tensor has returns it.
"""

from __future__ import annotations

import enum

import torch
from torch.utils.weak import WeakIdKeyDictionary


class Format(enum.IntEnum):
    """torch_npu's ``Format`` (ACL's format numbers, as ``torch_npu/npu/_format.py`` of 2.14 has them)."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47
    FRACTAL_NZ_C0_16 = 50
    FRACTAL_NZ_C0_32 = 51
    FRACTAL_NZ_C0_2 = 52
    FRACTAL_NZ_C0_4 = 53
    FRACTAL_NZ_C0_8 = 54

    def __str__(self) -> str:
        return self.name


#: The format of each tensor made by :func:`cast` into one other than ND, while it lives.
_FORMATS = WeakIdKeyDictionary()  # (tensors by identity: a tensor's == compares values)


def get(tensor: torch.Tensor) -> Format:
    """``torch_npu.get_npu_format``: the tensor's format (ND unless :func:`cast` made it in another)."""
    return Format(_FORMATS.get(tensor, Format.ND))


def cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """``torch_npu.npu_format_cast``: ``tensor`` where it has ``acl_format`` already, else a copy in it (an npu
    tensor only: on another device torch_npu's cast fails, and so does this one)."""
    if tensor.device.type != "npu":
        raise RuntimeError(f"npu_format_cast expects an npu tensor, got one on {tensor.device}")
    wanted = int(Format(int(acl_format)))
    if get(tensor) == wanted:
        return tensor
    made = tensor.clone()
    if wanted != Format.ND:
        _FORMATS[made] = wanted
    return made
