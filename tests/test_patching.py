"""The legacy side announces new patches; it never calls up into whoever listens."""

import torch

from shadow.npu import reference
from shadow.npu.patching import LEGACY_PATCHED, Announcer


def test_listeners_hear_each_announcement_once_in_order():
    heard = []
    announcer = Announcer()
    first, second = (lambda: heard.append("first")), (lambda: heard.append("second"))
    announcer.subscribe(first)
    announcer.subscribe(second)
    announcer.subscribe(first)  # once, however often
    announcer.announce()
    announcer.unsubscribe(first)
    announcer.announce()
    assert heard == ["first", "second", "second"]


def test_reference_patches_are_announced():
    heard = []

    def listener():
        heard.append(torch.Tensor.type is reference.npu_type)  # announced after patching

    LEGACY_PATCHED.subscribe(listener)
    try:
        patches = reference.patch_torch()
        patches.undo()
    finally:
        LEGACY_PATCHED.unsubscribe(listener)
    assert heard == [True]
