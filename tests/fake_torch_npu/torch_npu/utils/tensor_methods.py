from shadow.npu import reference


def _npu_type(self, dtype=None, non_blocking=False, **kwargs):
    return reference.npu_type(self, dtype, non_blocking, **kwargs)
