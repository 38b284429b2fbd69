"""A ``torch.load`` call's checkpoint, read once for the shadow run.

The primary loads from the caller's path or stream, as the unwrapped call does. The shadow run never opens the path
again and never reads the caller's stream: :func:`replay` takes, before the primary runs, an open descriptor of the
file at the path (or the stream's position), and once the primary ran it reads those bytes into a buffer of the
shadow run's own. A file replaced at the path in between (a trainer republishing ``latest.pt`` by an atomic rename)
is seen by its identity (device, inode, size, modification time) and skipped; it is never compared as a difference.

Before the shadow load runs, the bytes are checked as data:

- its memory is sized from the archive's records (each storage's uncompressed size: a small deflated file can
  load to a large object), plus the bytes themselves, against the memory free (``oom`` where it would not fit);
- its pickle may name only the globals torch's weights-only unpickler allows: anything else (a whole model's class,
  an ``argparse.Namespace``, a ``__reduce__`` of the user's) could run the user's code a second time, so the call is
  skipped (``ineligible``) unless the checkpoints are declared trusted; so is a callable ``map_location``, which the
  shadow load would call again. TorchScript archives and formats that cannot be read statically are skipped too.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.model.target import CannotReplay
from shadow.core.support import memory

#: A shadow run's arguments: (args, kwargs).
Arguments = tuple[tuple, dict]


def checkpoint_of(args: tuple, kwargs: dict) -> Any:
    """The ``f`` argument of a ``torch.load`` call."""
    return args[0] if args else kwargs.get("f")


def is_path(f: Any) -> bool:
    return isinstance(f, (str, bytes, os.PathLike))


def regular_file(path: Any) -> bool | None:
    """Whether ``path`` names a regular file (a FIFO, a device or a directory is not: reading one could block or
    never end), None where it cannot be told (absent, unreadable). ``stat`` opens nothing."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _with_checkpoint(args: tuple, kwargs: dict, checkpoint: Any) -> Arguments:
    if args:
        return (checkpoint, *args[1:]), dict(kwargs)
    return args, {**kwargs, "f": checkpoint}


def refusal(args: tuple, kwargs: dict, *, trusted: bool = False) -> str | None:
    """Why a ``torch.load`` call cannot be loaded a second time, told before it runs (and without opening anything),
    or None: a callable ``map_location`` (the shadow load would call it again) unless the checkpoints are trusted, a
    path that is not a regular file (a FIFO, a device: reading it twice could block), a stream that cannot seek."""
    f = checkpoint_of(args, kwargs)
    location = args[1] if len(args) > 1 else kwargs.get("map_location")
    if callable(location) and not isinstance(location, (str, dict, torch.device)) and not trusted:
        return "a callable map_location would be called a second time (trust the checkpoints to compare)"
    if is_path(f):
        if regular_file(f) is False:
            return "the checkpoint is not a regular file (a FIFO, a device): it cannot be read twice"
        return None
    try:
        if callable(getattr(f, "seekable", None)) and f.seekable() and callable(getattr(f, "tell", None)):
            return None
    except Exception:
        pass
    return "a stream that cannot seek back cannot be read twice"


def replay(args: tuple, kwargs: dict, *, trusted: bool = False) -> Callable[[], Arguments] | None:
    """Taken before the primary loads (a call :func:`refusal` let through): a function giving the shadow run's
    arguments once it has (the checkpoint read once, into a buffer of its own, checked as data), or None where the
    shadow run takes the call's own (a path that cannot be opened: both sides raise for it).

    Raises (from the function): CannotReplay (reason ``ineligible``), memory.InsufficientMemory (reason ``oom``).
    """
    f = checkpoint_of(args, kwargs)
    if is_path(f):
        return _from_path(args, kwargs, f, trusted)
    return _from_stream(args, kwargs, f, trusted)


def _refuse() -> Arguments:
    raise CannotReplay("the checkpoint is not a regular file (a FIFO, a device): it cannot be read twice")


def _by_name(kwargs: dict, path: Any) -> bool:
    """Calls upstream serves by the file's name (a ``.safetensors`` path, ``mmap``): the shadow run reads the path."""
    return os.fsdecode(os.fspath(path)).endswith(".safetensors") or bool(kwargs.get("mmap"))


def _from_path(args: tuple, kwargs: dict, path: Any, trusted: bool) -> Callable[[], Arguments] | None:
    try:  # (non-blocking: a FIFO put at the path since refusal() looked must not hang the job)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError, TypeError):
        return None
    opened = os.fdopen(descriptor, "rb")  # (closed once read, or when dropped unread)
    status = os.fstat(descriptor)
    held = _identity(status)
    if not stat.S_ISREG(status.st_mode):
        opened.close()
        return _refuse

    def shadow_arguments() -> Arguments:
        with opened:
            try:
                now = _identity(os.stat(path))
            except OSError:
                now = None
            if now != held or _identity(os.fstat(opened.fileno())) != held:
                raise CannotReplay(
                    "the file at the checkpoint's path was replaced or rewritten while it loaded: the shadow run "
                    "cannot read what the primary read"
                )
            if _by_name(kwargs, path):  # (its pickle and records read from the open file; its storages never copied)
                _check_content(opened, held[2], args, kwargs, trusted, copied=False)
                return args, kwargs
            memory.check_host_fits(held[2], "the checkpoint's bytes, read once for the shadow load")
            data = opened.read(held[2] + 1)
        if len(data) != held[2]:
            raise CannotReplay("the checkpoint changed size while it was read")
        _check_content(io.BytesIO(data), len(data), args, kwargs, trusted, copied=True)
        return _with_checkpoint(args, kwargs, io.BytesIO(data))

    return shadow_arguments


def _from_stream(args: tuple, kwargs: dict, stream: Any, trusted: bool) -> Callable[[], Arguments]:
    start = stream.tell()

    def shadow_arguments() -> Arguments:
        left_at = stream.tell()  # (where the primary left the stream: it is left there)
        try:
            end = stream.seek(0, io.SEEK_END)
            memory.check_host_fits(end, "the checkpoint's bytes, read once for the shadow load")
            stream.seek(0)
            data = stream.read(end)
        finally:
            stream.seek(left_at)
        if not isinstance(data, bytes) or len(data) != end:
            raise CannotReplay("the stream did not give back the bytes the primary read")
        _check_content(io.BytesIO(data[start:]), end - start, args, kwargs, trusted, copied=True)
        buffer = io.BytesIO(data)  # (the whole stream: offsets inside it are as the primary saw them)
        buffer.seek(start)
        return _with_checkpoint(args, kwargs, buffer)

    return shadow_arguments


# --------------------------------------------------------------------------- the bytes as data


def _check_content(source: Any, size: int, args: tuple, kwargs: dict, trusted: bool, copied: bool) -> None:
    """The shadow load's storages must fit where they go (sized from the archive's records; ``copied``: the bytes
    are held too), and unless trusted its pickle may name only torch's weights-only globals."""
    head = source.read(8)
    source.seek(0)
    if head[:4] == b"PK\x03\x04":
        storages, pickle, count = *_zip_records(source), 1
    elif _is_safetensors(source, size):
        storages, pickle, count = size, b"", 0  # (no pickle: upstream's loader reads a header and raw tensors)
    else:
        storages, pickle, count = size, source.read(min(size, _PICKLE_LIMIT)), _LEGACY_PICKLES
    what = "the shadow load's storages (sized from the archive's records)"
    memory.check_host_fits(storages + (size if copied else 0), what)
    location = args[1] if len(args) > 1 else kwargs.get("map_location")
    device = _named_device(location)
    if device is not None and device.type != "cpu":
        memory.check_device_fits(device, storages, what)
    if trusted or not count or _weights_only_on_both_sides(args, kwargs):
        return
    unsafe = _unsafe_globals(pickle, count)
    if unsafe:
        shown = ", ".join(sorted(unsafe)[:3]) + (f" and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
        raise CannotReplay(
            f"the checkpoint's pickle names {shown}, outside torch's weights-only globals: loading it again could run "
            "the job's code a second time (trust the checkpoints to compare)"
        )


def _weights_only_on_both_sides(args: tuple, kwargs: dict) -> bool:
    """Whether legacy and upstream both load with torch's weights-only unpickler, which runs none of the job's code:
    ``weights_only`` true or left to its default (true in torch and in torch_npu's copies since 2.6), no
    ``pickle_module`` (which turns the default off) and no variable forcing it off, in any spelling (upstream reads
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` lower-cased, torch_npu's copy as it is)."""
    weights_only = kwargs.get("weights_only")
    return (
        weights_only in (None, True)
        and len(args) < 3
        and kwargs.get("pickle_module") is None
        and os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") in ("0", "")
    )


def _named_device(location: Any) -> torch.device | None:
    if isinstance(location, (str, torch.device)):
        try:
            return torch.device(location)
        except (RuntimeError, ValueError):
            return None
    return None


def _is_safetensors(source: Any, size: int) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON header that fits in the file."""
    head = source.read(9)
    source.seek(0)
    if len(head) < 9:
        return False
    return 8 + int.from_bytes(head[:8], "little") <= size and head[8:9] == b"{"


#: The largest pickle read statically (a data.pkl, or a legacy checkpoint's pickles before its storages).
_PICKLE_LIMIT = 64 << 20


def _zip_records(source: Any) -> tuple[int, bytes]:
    """(the storages' uncompressed bytes, the pickle) of a zip checkpoint, from its central directory."""
    try:
        archive = zipfile.ZipFile(source)
        infos = archive.infolist()
        names = {info.filename for info in infos}
        if any(name.endswith("/constants.pkl") for name in names):
            raise CannotReplay("a TorchScript archive (torch.load hands it to torch.jit.load): not compared")
        storages = sum(info.file_size for info in infos if "/data/" in info.filename)
        pickles = [info for info in infos if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1]
        if len(pickles) != 1 or pickles[0].file_size > _PICKLE_LIMIT:
            raise CannotReplay("the checkpoint's archive has no single data.pkl of a readable size")
        return storages, archive.read(pickles[0])
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise CannotReplay(f"the checkpoint's archive cannot be read ({exc})") from exc


#: The pickles before the storages of torch's legacy format: magic number, protocol, system info, the object.
_LEGACY_PICKLES = 4


def _unsafe_globals(pickle: bytes, count: int) -> set[str]:
    """The globals the first ``count`` pickles of ``pickle`` name that torch's weights-only unpickler does not allow by
    itself (a user's ``add_safe_globals`` declares a class loadable, not safe to run twice); a pickle that cannot be
    read statically (an opcode torch's reader does not know) is all unsafe."""
    from torch import _weights_only_unpickler as weights_only

    allowed = weights_only._get_allowed_globals()
    stream, found = io.BytesIO(pickle), set()
    for _ in range(count):
        try:
            found |= weights_only.get_globals_in_pkl(stream)
        except Exception:
            return {"<a pickle that cannot be read statically>"}
    return {name for name in found if name not in allowed}
