"""The torch_npu wheels the test command fetches into the cache (their source is read, never imported)."""

import os

import pytest

from shadow.npu import wheels

#: Releases whose wheel was missing when a test asked for it (named in the test summary: see conftest.py).
MISSING: dict[str, int] = {}


def wheel(version: str = "2.12.0") -> str:
    """The cached wheel of ``version``. Where it is not there the test skips, saying why, and the summary names the
    release; under CI (CI=true) it fails instead: evidence that cannot be missing silently."""
    path = wheels.cached_wheel(version)
    if path is None:
        MISSING[version] = MISSING.get(version, 0) + 1
        why = (
            f"torch_npu {version} wheel not in {wheels.wheel_cache()}: the test command fetches it from "
            "the package index, which this machine could not reach"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why} (under CI the differential tests may not skip)")
        pytest.skip(why)
    return str(path)


def summary_line() -> str | None:
    """One line naming what was not tested, or None."""
    if not MISSING:
        return None
    releases = ", ".join(sorted(MISSING))
    return f"npu-shadow: NOT tested against torch_npu {releases} (wheel not fetched): {sum(MISSING.values())} skipped"
