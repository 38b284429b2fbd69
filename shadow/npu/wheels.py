"""Which torch_npu releases npu-shadow reads, and where their wheels are cached: no torch import, so the set-up
scripts ask it in a fraction of a second."""

from __future__ import annotations

import os
from pathlib import Path

#: The torch_npu releases that carry the three patches npu-shadow was built for (torch_npu 2.13 removed them).
RELEASES = ("2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0")

#: Releases after them, read by ``npu-shadow census`` (what torch_npu still patches); fetched into the cache too.
LATER_RELEASES = ("2.13.0", "2.14.0")


def wheel_cache() -> Path:
    """Where the test command keeps torch_npu wheels: ``$NPU_SHADOW_WHEEL_DIR``, else ``wheels`` under
    ``$NPU_SHADOW_CACHE_DIR`` (default ``~/.cache/npu-shadow``)."""
    explicit = os.environ.get("NPU_SHADOW_WHEEL_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("NPU_SHADOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "npu-shadow"
    )
    return Path(base) / "wheels"


def cached_wheel(version: str) -> Path | None:
    """The cached torch_npu wheel of ``version``, if one is there."""
    matches = sorted(wheel_cache().glob(f"torch_npu-{version}-*.whl"))
    return matches[0] if matches else None
