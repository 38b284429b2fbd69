"""Starting the command under test as a user does: ``python -m shadow ARGS`` in the repository's root, its output
captured as text. One helper for every test that runs the ``npu-shadow`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def npu_shadow(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 300, cwd: str = ROOT
) -> subprocess.CompletedProcess:
    """``npu-shadow ARGS`` run to its end (``timeout`` seconds at most), in ``env`` (its whole environment, as
    subprocess takes it; None: this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "shadow", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
