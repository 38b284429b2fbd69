"""LSTM and GRU on the emulated npu: torch's CPU kernels, as for other operators.

ATen runs an LSTM or GRU on a PrivateUse1 device through the fused cell kernels CUDA has
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``), which have no CPU kernel for the boxed CPU fallback to run.
So ``aten::lstm`` and ``aten::gru`` themselves (their ``input`` and ``data`` overloads) are given kernels on the npu
that run torch's CPU ones on CPU copies and bring the results back; autograd records the copies, so gradients reach
the npu tensors. Registered for ``PrivateUse1`` and ``AutogradPrivateUse1`` (no grad, inference mode, and training).

A packed sequence whose ``batch_sizes`` are on the npu (torch_npu 2.12's ``LSTM.forward`` moves them there) runs as
torch_npu's NPU kernel does, by its source's own comment: the sequences padded to the longest and computed at that
fixed length (output ``[T0, B, *]``); with ``batch_sizes`` on the CPU, as torch's packed kernel does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

_LIBRARY: list[Any] = []


def _cpu(tensors: Any) -> Any:
    if isinstance(tensors, torch.Tensor):
        return tensors.cpu()
    return [t.cpu() for t in tensors]


def _back(results: tuple, device: torch.device) -> tuple:
    return tuple(t.to(device) for t in results)


def _lstm_input(input: Any, hx: Any, params: Any, *flags: Any) -> tuple:
    return _back(torch.lstm(input.cpu(), _cpu(hx), _cpu(params), *flags), input.device)


def _gru_input(input: Any, hx: Any, params: Any, *flags: Any) -> tuple:
    return _back(torch.gru(input.cpu(), hx.cpu(), _cpu(params), *flags), input.device)


def _padded(data: torch.Tensor, batch_sizes: torch.Tensor) -> torch.Tensor:
    """The packed ``data`` as ``[T0, B, *]``, zero-padded (torch_npu's fixed-length computation)."""
    padded, _ = pad_packed_sequence(PackedSequence(data, batch_sizes.cpu()))
    return padded


def _lstm_data(data: Any, batch_sizes: Any, hx: Any, params: Any, has_biases: bool, layers: int, dropout: float,
               train: bool, bidirectional: bool) -> tuple:  # fmt: skip
    if batch_sizes.device.type == "cpu":
        found = torch.lstm(data.cpu(), batch_sizes, _cpu(hx), _cpu(params), has_biases, layers, dropout, train,
                           bidirectional)  # fmt: skip
    else:
        found = torch.lstm(_padded(data.cpu(), batch_sizes), _cpu(hx), _cpu(params), has_biases, layers, dropout,
                           train, bidirectional, False)  # fmt: skip
    return _back(found, data.device)


def _gru_data(data: Any, batch_sizes: Any, hx: Any, params: Any, has_biases: bool, layers: int, dropout: float,
              train: bool, bidirectional: bool) -> tuple:  # fmt: skip
    if batch_sizes.device.type == "cpu":
        found = torch.gru(data.cpu(), batch_sizes, hx.cpu(), _cpu(params), has_biases, layers, dropout, train,
                          bidirectional)  # fmt: skip
    else:
        found = torch.gru(_padded(data.cpu(), batch_sizes), hx.cpu(), _cpu(params), has_biases, layers, dropout,
                          train, bidirectional, False)  # fmt: skip
    return _back(found, data.device)


def register() -> None:
    """Give ``aten::lstm`` and ``aten::gru`` their npu kernels (once per process)."""
    if _LIBRARY:
        return
    library = torch.library.Library("aten", "IMPL")
    for key in ("PrivateUse1", "AutogradPrivateUse1"):
        library.impl("lstm.input", _lstm_input, key)
        library.impl("lstm.data", _lstm_data, key)
        library.impl("gru.input", _gru_input, key)
        library.impl("gru.data", _gru_data, key)
    _LIBRARY.append(library)
