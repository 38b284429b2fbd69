"""torch_npu's ten tensor type classes, by name, and the dtype each stands for (one table for the whole tool)."""

from __future__ import annotations

import torch

#: 'FloatTensor' -> torch.float32, ...: the classes torch_npu has as torch_npu.npu.<Name> (torch.npu.<Name>).
NPU_TENSOR_TYPES: dict[str, torch.dtype] = {
    "BoolTensor": torch.bool,
    "ByteTensor": torch.uint8,
    "CharTensor": torch.int8,
    "ShortTensor": torch.int16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
    "HalfTensor": torch.float16,
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "BFloat16Tensor": torch.bfloat16,
}
