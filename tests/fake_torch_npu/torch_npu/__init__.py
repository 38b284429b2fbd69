"""A stand-in for torch_npu (which needs Ascend's CANN libraries): importing it patches torch the way
torch_npu does, with this package's own functions built on shadow.npu.reference."""

from shadow.npu import reference
from torch_npu.utils import _module, tensor_methods

__version__ = "0.0.0+fake"

_patches = reference.patch_torch(tensor_methods._npu_type, _module.npu_parallel_apply, _module.npu_data_parallel)


def _unpatch() -> None:
    """Test helper: put torch back as it was before this module was imported."""
    _patches.undo()
