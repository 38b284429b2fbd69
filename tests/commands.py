"""Starting the command under test as a user does: ``python -m shadow ARGS`` in the repository's root, its output
captured as text. One helper for every test that runs the ``npu-shadow`` command as a process, and one that runs it
in the test's own process (the same parser and handler, for tests of what a command decides and says rather than of
the process it runs in)."""

from __future__ import annotations

import contextlib
import io
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


def npu_shadow_here(*args: str) -> subprocess.CompletedProcess:
    """``npu-shadow ARGS`` in this process (:func:`shadow.launcher.cli.main`), its exit code and output as
    :func:`npu_shadow` gives them: for a command that reads its sources and prints (``verdict``), where a process of
    its own would only add a Python's start and its imports. An exception the command does not catch is raised."""
    from shadow.launcher import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # (argparse's usage errors)
            code = exc.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
