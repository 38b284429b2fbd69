"""What torch_npu's tests take from ``torch_npu.testing.common_utils``: ``SupportedDevices`` (a test runs where the
device's name starts as one of those listed, else it is skipped), over the emulated npu's name."""

import functools
import unittest

import torch


class SupportedDevices:
    def __init__(self, supported_devices):
        self.supported_devices = supported_devices

    def __call__(self, fn):
        @functools.wraps(fn)
        def dep_fn(slf, *args, **kwargs):
            name = torch.npu.get_device_name(0)
            device = name[:12] if name[:10] == "Ascend910_" else name[:9] if name.startswith("Ascend950") else name[:10]
            if device not in self.supported_devices:
                raise unittest.SkipTest(f"Only run on {self.supported_devices!r}, current device is {device}.")
            return fn(slf, *args, **kwargs)

        return dep_fn
