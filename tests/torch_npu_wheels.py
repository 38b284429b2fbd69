"""The torch_npu wheels the test command fetches into the cache (their source is read, never imported)."""

import pytest

from shadow.npu import torch_npu_source


def wheel(version: str = "2.12.0") -> str:
    """The cached wheel of ``version``; skips the test, saying why, when it is not there."""
    path = torch_npu_source.cached_wheel(version)
    if path is None:
        pytest.skip(
            f"torch_npu {version} wheel not in {torch_npu_source.wheel_cache()}: the test command fetches it from "
            "the package index, which this machine could not reach"
        )
    return str(path)
