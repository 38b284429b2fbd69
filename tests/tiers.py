"""The fast tier (``pytest -m "not slow"``) starts no program: a test that starts one (the ``npu-shadow`` command, a
job, a script, Prometheus or any other server, Chromium) is marked ``slow``. Checked as each test runs: a test
without the mark that starts a program fails, naming what it started. A fork of the test's own process is no
program, and neither is a compiler torch or Triton runs to fill a cache of theirs (it runs or not by the cache's
state, not by what the test does)."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

#: Programs started by torch's and Triton's compilers for their caches, never by a test itself.
CACHE_FILLERS = frozenset({"cc", "c++", "gcc", "g++", "clang", "clang++", "ninja", "ld", "ldconfig", "uname", "nvcc"})

_watched: dict[str, list[str]] = {}  # (one test at a time in a process: its programs, while it is not slow)
_lock = threading.Lock()
_original_init = subprocess.Popen.__init__


def _program(args: object) -> str:
    words = os.fsdecode(args).split() if isinstance(args, (str, bytes, os.PathLike)) else list(args)  # type: ignore[call-overload]
    return os.path.basename(os.fsdecode(words[0])) if words else ""


def _counting_init(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
    program = _program(args)
    with _lock:
        for started in _watched.values():
            if program not in CACHE_FILLERS:
                started.append(program)
    _original_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counting_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    if item.get_closest_marker("slow") is None:
        with _lock:
            _watched[item.nodeid] = []
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    result = yield
    with _lock:
        started = _watched.pop(item.nodeid, None)
    if started:
        raise pytest.fail.Exception(
            f"this test started {', '.join(sorted(set(started)))} and is not marked slow: the fast tier starts no "
            "program (mark it @pytest.mark.slow)"
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    with _lock:
        _watched.pop(item.nodeid, None)
    return (yield)
