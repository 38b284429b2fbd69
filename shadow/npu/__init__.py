"""What stands in for torch_npu and the NPU, beneath everything else: the reference legacy (``reference``),
torch_npu's own patch source (``torch_npu_source``), its tensor-type table (``tensor_types``) and the emulated
npu device (``emulated``). Imports nothing from the rest of the project.
"""
