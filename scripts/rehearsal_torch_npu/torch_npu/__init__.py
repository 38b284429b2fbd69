"""A rehearsal ``torch_npu`` for running torch_npu's own tests on the emulated npu (scripts/torch_npu_tests.py).

It is none of torch_npu's code: the surface its serialization, storage and tensor tests use (``torch_npu.npu``,
``npu_format_cast``, ``get_npu_format``, ``Format``, ``testing.testcase``), over the emulated npu. The patches under
test are torch_npu's own, from a release's source: installed by ``npu-shadow run --legacy-from RELEASE`` in the
shadowed run, and here, from ``TORCH_NPU_TESTS_WHEEL``, in the unshadowed one.
"""

import os
import sys
import types

import torch

from shadow.npu import emulated, torch_npu_source
from shadow.npu.emulated import formats, torch_npu_c

if not os.environ.get("NPU_SHADOW_ENABLED"):  # (the unshadowed run: what the launcher does, done here)
    _ITSELF = sys.modules.pop(__name__)  # (the emulator refuses a process where a torch_npu is imported)
    try:
        emulated.install(2)
        _PATCHES = torch_npu_source.load(os.environ["TORCH_NPU_TESTS_WHEEL"]).patch_torch()
    finally:
        sys.modules[__name__] = _ITSELF


class _Npu(types.ModuleType):
    """``torch_npu.npu``: the emulated npu's device module, and torch_npu's ``config`` settings."""

    config = types.SimpleNamespace(allow_internal_format=False)

    def __getattr__(self, name):
        return getattr(torch.npu, name)


npu = _Npu("torch_npu.npu")
#: The emulator's torch_npu._C, and the SoC version of the Ascend 910B1 it reports (tests branch on it).
_C = types.SimpleNamespace(**vars(torch_npu_c), _npu_get_soc_version=lambda: 220)
npu_format_cast = formats.cast
get_npu_format = formats.get
Format = formats.Format
__version__ = "0+rehearsal"
