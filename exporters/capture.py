"""Repro captures: a mismatching call's inputs and both outputs, saved with ``torch.save``.

Files are readable by the owner only and load with ``torch.load(..., weights_only=True)``: everything
that is not a tensor, dtype, number, string or container is replaced by a plain description
(modules by their class name, their state in ``module_state``; exceptions by their text; classes by
their import path, ``{"class": "module:qualname"}``).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import zipfile
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_iter, tree_map

from shadow.core.model.observation import Observation
from shadow.core.model.run_ids import run_id_problem
from shadow.core.support.safe_paths import make_private_directory

FORMAT = 1
_PLAIN = (torch.Tensor, torch.dtype, torch.device, str, int, float, bool, type(None), bytes)


def import_path(obj: Any) -> str | None:
    """``module:qualname`` of a function, method descriptor or class; None if it has none."""
    owner = getattr(obj, "__objclass__", None)  # C method descriptors such as TensorBase.type
    module = getattr(owner or obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        return None
    return f"{module}:{qualname}"


def _plain(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf.detach()
    if isinstance(leaf, _PLAIN):
        return leaf
    if isinstance(leaf, torch.nn.Module):
        return {"module": type(leaf).__qualname__}
    if isinstance(leaf, BaseException):
        return {"exception": type(leaf).__name__, "message": str(leaf)}
    if isinstance(leaf, type):
        return {"class": import_path(leaf) or repr(leaf)}
    try:
        return {"repr": repr(leaf)}
    except Exception as exc:  # a __repr__ that raises: the capture still describes the leaf
        return {"repr": f"<{type(leaf).__qualname__}: repr raised {type(exc).__name__}>"}


def payload(observation: Observation) -> dict[str, Any]:
    """What a capture file holds for an observation with evidence."""
    evidence = observation.evidence
    if evidence is None:
        raise ValueError("observation has no evidence to capture")
    return {
        "format": FORMAT,
        "target": observation.target,
        "outcome": observation.outcome,
        "reasons": list(observation.reasons),
        "signature": observation.signature,
        "detail": observation.detail,
        "args": tree_map(_plain, list(evidence.args)),
        "kwargs": tree_map(_plain, dict(evidence.kwargs)),
        "legacy": tree_map(_plain, evidence.legacy),
        "upstream": tree_map(_plain, evidence.upstream),
        "module_state": {k: v.detach() for k, v in (evidence.module_state or {}).items()},
        "legacy_fn": import_path(evidence.legacy_fn),
        "upstream_fn": import_path(evidence.upstream_fn),
        "exact": evidence.exact,
        "device": evidence.device,
    }


def size_of(data: Any) -> int:
    """Bytes of tensor data in a payload (what dominates the file)."""
    return sum(t.numel() * t.element_size() for t in tree_iter(data) if isinstance(t, torch.Tensor))


def save(data: dict[str, Any], path: str) -> None:
    """Write a capture readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        torch.save(data, handle)


def load(path: str, locations: set[str] | None = None) -> dict[str, Any]:
    """Read a capture safely (weights_only); tensors of devices absent here come to the CPU. ``locations``, when
    given, receives the device each tensor was saved from ("npu:1"), present here or not."""

    def place(storage: Any, location: str) -> Any:
        if locations is not None:
            locations.add(location)
        try:
            return torch.serialization.default_restore_location(storage, location)
        except RuntimeError:  # (a device this process does not have)
            return storage

    with _opened_capture(path) as handle:
        try:
            data = torch.load(handle, weights_only=True, map_location=place)
        except Exception as exc:  # unpickling errors come in many types
            raise ValueError(f"{path} is not a loadable capture: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an npu-shadow capture (format {FORMAT})")
    for key, kind in _FIELDS.items():
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{path}: malformed capture: {key!r} must be a {kind.__name__}, got {data.get(key)!r:.80}")
    if not all(isinstance(k, str) for k in data["kwargs"]):
        raise ValueError(f"{path}: malformed capture: 'kwargs' keys must be strings")
    for key, check, kind in _OPTIONAL_FIELDS:
        if key in data and not check(data[key]):
            raise ValueError(f"{path}: malformed capture: {key!r} must be {kind}, got {type(data[key]).__name__}")
    _check_size(data, path)
    return data


#: The most a capture's records may hold once read (its zip entries' sizes added up): a few MB of deflated zeros
#: must not inflate into more memory than the host has.
MAX_INFLATED_BYTES = 256 << 20


@contextlib.contextmanager
def _opened_capture(path: str) -> Iterator[Any]:
    """The capture at ``path`` opened for reading, where it is a regular file (never a FIFO, a device or a
    symbolic link: opening one could block or read forever) in torch's zip format whose entries add up to at most
    MAX_INFLATED_BYTES. Raises ValueError saying which it is not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{path}: cannot open the capture ({exc.strerror or exc})") from None
    handle = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file: a capture is never read from anything else")
        try:
            with zipfile.ZipFile(handle) as archive:
                inflated = sum(entry.file_size for entry in archive.infolist())
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise ValueError(f"{path} is not a capture in torch's zip format ({exc})") from None
        if inflated > MAX_INFLATED_BYTES:
            raise ValueError(
                f"{path}: its records would take {inflated >> 20} MiB once read (at most "
                f"{MAX_INFLATED_BYTES >> 20} MiB): refused"
            )
        handle.seek(0)
        yield handle
    finally:
        handle.close()


#: Fields a capture may have, with their checks: replay reads them.
_OPTIONAL_FIELDS = (
    ("exact", lambda v: isinstance(v, bool), "True or False"),
    ("reasons", lambda v: isinstance(v, list) and all(isinstance(r, str) for r in v), "a list of strings"),
    (
        "module_state",
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items()),
        "a dict of tensors",
    ),
    ("legacy_fn", lambda v: v is None or isinstance(v, str), "a string or None"),
    ("upstream_fn", lambda v: v is None or isinstance(v, str), "a string or None"),
    (
        "device",
        lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,31}:\d{1,4}", v) is not None),
        "a device such as 'npu:1', or None",
    ),
    ("run", lambda v: isinstance(v, str) and run_id_problem(v) is None, "a run id"),
)

#: The most values (a shared reference counted each time it is reached) and nesting a capture may have.
MAX_VALUES = 100_000
MAX_DEPTH = 100


def _check_size(data: dict[str, Any], path: str) -> None:
    """Refuse a capture too large or too deep to walk: a few KB of shared references can stand for more values
    than memory holds (every later step walks them), and deep nesting exhausts the stack."""
    pending = [(data[key], 1) for key in ("args", "kwargs", "legacy", "upstream") if key in data]
    seen = 0
    while pending:
        value, depth = pending.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ValueError(f"{path}: malformed capture: more than {MAX_VALUES} values (shared references count)")
        if depth > MAX_DEPTH:
            raise ValueError(f"{path}: malformed capture: nested deeper than {MAX_DEPTH}")
        if isinstance(value, (list, tuple)):
            pending.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())


#: The fields every capture has, with their types.
_FIELDS = {"target": str, "outcome": str, "signature": str, "detail": str, "args": list, "kwargs": dict}


class Captures:
    """A process's repro captures into ``directory``: at most ``max_captures`` files and ``max_bytes`` of tensor
    data. A capture that fails is removed and raised; its attempt still used its name."""

    def __init__(self, directory: str, max_captures: int, max_bytes: int) -> None:
        self.directory, self.max_captures, self.max_bytes = directory, max_captures, max_bytes
        self.written = self.tried = self.failed = self.bytes = 0

    def data(self, observation: Observation, run: str) -> dict | None:
        """What this observation's capture would hold (``run``: whose evidence it is), if it gets one within the
        limits. Raises what describing its evidence raised (counted as failed)."""
        if observation.evidence is None or self.written >= self.max_captures:
            return None
        try:
            data = {**payload(observation), "run": run}
        except Exception:
            self.failed += 1
            raise
        return data if self.bytes + size_of(data) <= self.max_bytes else None

    def path(self, observation: Observation, pid: int) -> str:
        """A fresh name: one that no earlier attempt of this process used, failed or not."""
        self.tried += 1
        # (a target's name is anyone's string: only its plain characters make the file name, inside the directory)
        name = re.sub(r"[^A-Za-z0-9_-]", "_", observation.target)[:64]
        return os.path.join(self.directory, f"{name}-{pid}-{self.tried:04d}.pt")

    def save(self, data: dict, path: str) -> None:
        """Write the capture (0600, in the private directory); a failure removes the partial file and is raised."""
        try:
            make_private_directory(self.directory, "capture_dir")
            save(data, path)
        except BaseException:
            self.failed += 1
            with contextlib.suppress(OSError):
                if os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)  # a partial file; the next capture gets another name anyway
            raise
        self.written += 1
        self.bytes += size_of(data)
