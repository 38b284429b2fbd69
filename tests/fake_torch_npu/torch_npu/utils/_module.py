from shadow.npu import reference


def npu_parallel_apply(self, replicas, inputs, kwargs):
    return reference.npu_parallel_apply(self, replicas, inputs, kwargs)


def npu_data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    return reference.npu_data_parallel(module, inputs, device_ids, output_device, dim, module_kwargs)
