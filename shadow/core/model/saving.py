"""A ``torch.save`` call, run a second time into a buffer of its own, and what the two runs wrote.

The primary saves to the caller's path or stream, as the unwrapped call does. The shadow run never touches them:
it saves the same object into a ``BytesIO`` of its own (:func:`replay`). Once both ran, each side's output is read
as data (:func:`written`): the file at the caller's path, or the bytes the primary added to the caller's stream
(from where it stood before the call; a write-only file through a descriptor of our own), and the shadow run's
buffer. Nothing is unpickled to read them: an archive's
records are read from its central directory, each record reduced to its size and a digest.

:func:`difference` compares them: the same records (names inside the archive, which is named after the file,
aside) are a match; different records are loaded back, on the host and with torch's weights-only unpickler, and
compared by what they hold: the same content is ``close`` (the byte layout differs, and the detail names the
records), different content a mismatch.

Pickling runs the reducers of what is saved, so only objects whose pickling runs torch's own code are saved twice:
containers (dicts, lists, tuples, named tuples, of their exact types) of tensors, parameters and plain values, keyed
by plain values, with no Python attributes on the tensors, saved with Python's own ``pickle`` (:func:`refusal`,
decided before either save runs; the shadow save's warnings never reach the job:
:mod:`shadow.core.runs.sides`). Anything else (a whole module, an
``argparse.Namespace``, a ``str`` subclass, a class of the job's) is skipped unless the checkpoints are declared
trusted (``trusted_checkpoints``). A save the caller's destination fails (a full disk: an OSError) is not compared
(:func:`environment_failure`): the shadow run saved into memory and never met that environment.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import hashlib
import io
import os
import pickle
import stat
import threading
import types
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from shadow.core.model import loaded
from shadow.core.model.checkpoint import is_path, regular_file
from shadow.core.model.target import Alike, CannotCompare
from shadow.core.support import memory

#: Values whose pickling runs no code but torch's and Python's own.
_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, torch.Size)

#: Where the caller's stream stood when the primary began to save into it, per thread: (id of the stream, offset).
_STARTS = threading.local()


def destination(args: tuple, kwargs: dict) -> Any:
    """The ``f`` argument of a ``torch.save(obj, f, ...)`` call."""
    return args[1] if len(args) > 1 else kwargs.get("f")


def saved_object(args: tuple, kwargs: dict) -> Any:
    """The ``obj`` argument of a ``torch.save`` call."""
    return args[0] if args else kwargs.get("obj")


def zipped(args: tuple, kwargs: dict) -> bool:
    """Whether the call writes torch's zip format (the default) or the legacy pickle stream."""
    flag = args[4] if len(args) > 4 else kwargs.get("_use_new_zipfile_serialization", True)
    return bool(flag)


#: Containers whose pickling runs only Python's own code (their exact types: a subclass may reduce itself).
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)
#: What a namedtuple's class pickles by, when it adds nothing of its own.
_NAMEDTUPLE_OWN = {"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__getnewargs_ex__"}


def _plain_namedtuple(value: Any) -> bool:
    """A namedtuple whose class (collections.namedtuple's, pickled by reference) adds no pickling of its own."""
    kind = type(value)
    return (
        isinstance(value, tuple) and hasattr(kind, "_fields") and kind.__bases__ == (tuple,)
        and not _NAMEDTUPLE_OWN & set(vars(kind))
    )  # fmt: skip


def tensors_of(obj: Any) -> list[torch.Tensor] | None:
    """The tensors of a tree of tensors and plain values, or None where pickling ``obj`` would run anything but
    Python's and torch's own code: a leaf, or a dict's key, of another type (a ``str`` subclass too: it may reduce
    itself), a tensor with Python attributes of its own (pickled with it), a container of a subclass' type."""
    found: list[torch.Tensor] = []
    pending, seen = [obj], set()
    while pending:
        value = pending.pop()
        kind = type(value)
        if kind in (torch.Tensor, torch.nn.Parameter):
            if vars(value):  # (a tensor's own attributes are pickled with it, by their own reducers)
                return None
            found.append(value)
        elif kind in _PLAIN:
            continue
        elif kind in _CONTAINERS or _plain_namedtuple(value):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, dict):
                if any(type(key) not in _PLAIN for key in value):
                    return None
                pending.extend(value.values())
            else:
                pending.extend(value)
        else:
            return None
    return found


def refusal(args: tuple, kwargs: dict, *, trusted: bool = False) -> str | None:
    """Why a ``torch.save`` call cannot be saved a second time and compared, told before it runs, or None: an object
    whose pickling would run the job's code again (unless the checkpoints are trusted: a leaf, a key or a tensor
    attribute of the job's types, a pickle module of the job's), a job recording or rerouting its warnings (a
    second save's would reach it), a path that is not a regular file (a FIFO, a device: what it took cannot be read
    back), a stream that cannot be read back."""
    if not trusted:
        why = _runs_job_code(args, kwargs)
        if why is not None:
            return why
    f = destination(args, kwargs)
    if is_path(f):
        if regular_file(f) is False:
            return "the destination is not a regular file (a FIFO, a device): what was written cannot be read back"
        return None
    try:
        if f.seekable() and (f.readable() or _file_behind(f) is not None):
            return None
    except Exception:
        pass
    return "a stream that cannot seek, be read or be found as a file: what the save wrote cannot be read back"


def _runs_job_code(args: tuple, kwargs: dict) -> str | None:
    """Why saving the call's object a second time would run the job's code again, or None."""
    obj = saved_object(args, kwargs)
    if tensors_of(obj) is None:
        return _object_refusal(obj)
    module = args[2] if len(args) > 2 else kwargs.get("pickle_module", pickle)
    if module is not pickle:
        return "the call names a pickle module of its own: saving again would run its code a second time"
    return None


def _object_refusal(obj: Any) -> str:
    """Why ``obj``, more than tensors and plain values in containers, is not saved twice (naming what it is)."""
    kind = type(obj)
    if isinstance(obj, torch.nn.Module):
        what = f"a whole module ({kind.__module__}.{kind.__qualname__}): its pickle names the job's own classes"
    else:
        what = "more than tensors and plain values in containers (a leaf, a key or a tensor attribute of the job's)"
    return (
        f"the object is {what}: saving it again would run their reducers a second time (--trusted-checkpoints, "
        "or trusted_checkpoints=True, compares such saves)"
    )


#: What torch's archive writer (C++, inline_container.cc) says where the file system fails it: a path's folder
#: missing, a file that cannot be opened, a write the disk refused.
_WRITER_FAILURES = ("Parent directory", "cannot be opened", "file write failed", "PytorchStreamWriter failed")


def environment_failure(error: BaseException) -> str | None:
    """Why an exception of the save that wrote to the caller's destination is the environment's (a full disk, a
    missing folder, a read-only file system: an OSError, or torch's archive writer saying so), not the
    implementation's: the shadow run saved into a buffer of its own and met none of it, so the call is not compared.
    None for any other exception."""
    found: BaseException | None = error
    for _ in range(8):  # (torch's writer raises its own RuntimeError over the stream's OSError: its context)
        if found is None:
            return None
        text = str(found)
        if isinstance(found, OSError) or (
            type(found) is RuntimeError and any(words in text for words in _WRITER_FAILURES)
        ):
            return (
                f"the save to the caller's destination failed ({type(found).__name__}: {text[:160]}): the other "
                "side saved into memory and could not meet the same environment"
            )
        found = found.__cause__ or found.__context__
    return None


def _file_behind(stream: Any) -> Any:
    """The path of the regular file a write-only stream writes (``open(path, "wb")``), found by its name and checked
    to be the very file (device and inode), or None."""
    name = getattr(stream, "name", None)
    if not isinstance(name, (str, bytes)):
        return None
    try:
        held, named = os.fstat(stream.fileno()), os.stat(name)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    same = (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
    return name if same and stat.S_ISREG(held.st_mode) else None


def _where_writes_land(stream: Any) -> int:
    """Where the next write into ``stream`` lands: where it stands, or, for a file opened to append (``"a+b"``),
    its end whatever it stands at."""
    try:
        appending = bool(fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_APPEND)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        appending = False
    if not appending:
        return stream.tell()
    stream.flush()  # (what the job wrote before lands at the end first; the save's writes follow it)
    return os.fstat(stream.fileno()).st_size


def _size(obj: Any) -> int:
    """The bytes of the distinct storages of the tensors in ``obj`` (0 where it is not a tree of them)."""
    storages = {}
    for tensor in tensors_of(obj) or ():
        storage = tensor.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


#: How many times a checkpoint's size a sampled save holds on the host at its peak (4.3 measured: the shadow run's
#: buffer, which grows by reallocating, what it wrote read back, the primary's file read back, a record read to
#: digest it): a save is compared only where that fits.
HOLDS = 5


def replay(args: tuple, kwargs: dict) -> Callable[[], tuple[tuple, dict]]:
    """Taken before the primary saves: notes where the caller's stream stands (what the primary adds is read from
    there), and returns the function that gives the shadow run its arguments, the same call into a ``BytesIO`` of its
    own (raises memory.InsufficientMemory where the two outputs would not fit on the host)."""
    f = destination(args, kwargs)
    if not is_path(f):
        _STARTS.stream = (id(f), _where_writes_land(f))
    size = _size(saved_object(args, kwargs))

    def shadow_arguments() -> tuple[tuple, dict]:
        memory.check_host_fits(HOLDS * size, "the checkpoint written a second time, both read back to compare")
        buffer = io.BytesIO()
        if len(args) > 1:
            return (args[0], buffer, *args[2:]), dict(kwargs)
        return args, {**kwargs, "f": buffer}

    return shadow_arguments


@dataclasses.dataclass(frozen=True, eq=False)
class Written:
    """What one side's save wrote: its bytes and, for a zip archive, each record's size and digest by its name
    inside the archive (the archive's own folder, named after the file, left out)."""

    data: bytes
    records: dict[str, tuple[int, str]] | None

    def __repr__(self) -> str:
        kind = f"{len(self.records)} records" if self.records is not None else "a pickle stream"
        return f"<Written: {len(self.data):,} bytes, {kind}>"


def _records(data: bytes) -> dict[str, tuple[int, str]] | None:
    if data[:4] != b"PK\x03\x04":
        return None
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        found = {}
        for info in archive.infolist():
            digest = hashlib.blake2b(archive.read(info), digest_size=16).hexdigest()
            found[info.filename.partition("/")[2]] = (info.file_size, digest)
        return found
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return None  # (compared as bytes)


def written(result: Any, args: tuple, kwargs: dict) -> Written:
    """What a save wrote to its destination (a target's ``snapshot``): the file at the path, or the bytes added to
    the stream since the call began (the stream is left where the save left it)."""
    f = destination(args, kwargs)
    if is_path(f):
        with open(f, "rb") as opened:
            memory.check_host_fits(os.fstat(opened.fileno()).st_size, "the checkpoint written, read back")
            data = opened.read()
    else:
        end = f.tell()
        noted = getattr(_STARTS, "stream", None)
        start = noted[1] if noted is not None and noted[0] == id(f) else 0
        _STARTS.stream = None
        memory.check_host_fits(end - start, "the checkpoint written, read back")
        if f.readable():
            try:
                f.seek(start)
                data = f.read(end - start)
            finally:
                f.seek(end)
        else:  # (a write-only file: read through a descriptor of our own; torch flushed it as the save ended)
            with open(_file_behind(f), "rb") as opened:
                data = os.pread(opened.fileno(), end - start, start)
        if len(data) != end - start:
            raise RuntimeError(f"{len(data)} of the {end - start} bytes the save wrote could be read back")
    data = bytes(data)  # (one copy: a memoryview or bytearray read is made bytes once)
    return Written(data, _records(data))


def _load(data: bytes, trusted: bool) -> Any:
    """What a checkpoint loads back to, on the host, as the comparator reads it: weights-only, or (the checkpoints
    declared trusted, whose saves were made of the job's objects) as the job's own load would."""
    found = torch.load(io.BytesIO(data), map_location="cpu", weights_only=not trusted)
    return loaded.comparable(found)


def _first_difference(legacy: Any, upstream: Any, path: str = "") -> str | None:
    """Where two trees of :func:`shadow.core.model.loaded.comparable` first differ, or None."""
    if isinstance(legacy, torch.Tensor) or isinstance(upstream, torch.Tensor):
        same = (
            isinstance(legacy, torch.Tensor) and isinstance(upstream, torch.Tensor)
            and (legacy.dtype, legacy.shape, legacy.stride(), legacy.requires_grad)
            == (upstream.dtype, upstream.shape, upstream.stride(), upstream.requires_grad)
            and bool(torch.equal(legacy.view(torch.uint8) if legacy.numel() else legacy,
                                 upstream.view(torch.uint8) if upstream.numel() else upstream))
        )  # fmt: skip
        return None if same else path or "the tensor"
    if isinstance(legacy, dict) and isinstance(upstream, dict):
        if list(legacy) != list(upstream):
            return f"{path or 'the object'}: keys {list(legacy)[:5]} / {list(upstream)[:5]}"
        return next(
            (found for key in legacy if (found := _first_difference(legacy[key], upstream[key], f"{path}[{key!r}]"))),
            None,
        )
    if isinstance(legacy, (list, tuple)) and isinstance(upstream, (list, tuple)):
        if type(legacy) is not type(upstream) or len(legacy) != len(upstream):
            return f"{path or 'the object'}: {type(legacy).__name__} of {len(legacy)} / {len(upstream)}"
        pairs = zip(legacy, upstream, strict=True)
        return next((f for i, (a, b) in enumerate(pairs) if (f := _first_difference(a, b, f"{path}[{i}]"))), None)
    return None if type(legacy) is type(upstream) and legacy == upstream else path or "the object"


def difference(legacy: Written, upstream: Written, *, trusted: bool = False) -> str | Alike | None:
    """None where both saves wrote the same records (or the same stream); where they did not, what they load back to
    compared (``trusted``: the job's objects loaded as the job would; else weights-only): the same content is
    :class:`~shadow.core.model.target.Alike` (the byte layout differs: ``close``; a storage key that is a memory
    address, as the legacy format's are, is layout), else the first place where they differ. Two saves that cannot
    be loaded back to compare are no finding: CannotCompare is raised (the call is not compared)."""
    if legacy.records is not None and legacy.records == upstream.records:
        return None
    if legacy.records is None and legacy.data == upstream.data:
        return None
    if legacy.records is not None and upstream.records is not None:
        names = sorted(set(legacy.records) ^ set(upstream.records))
        names += sorted(
            n for n in set(legacy.records) & set(upstream.records) if legacy.records[n] != upstream.records[n]
        )
        layout = f"records {', '.join(names[:6])}{' ...' if len(names) > 6 else ''} differ"
    else:
        layout = f"the files differ ({len(legacy.data):,} / {len(upstream.data):,} bytes)"
    try:
        found = _first_difference(_load(legacy.data, trusted), _load(upstream.data, trusted))
    except (pickle.UnpicklingError, RuntimeError, loaded.Uncomparable, AttributeError, ImportError) as exc:
        how = "" if trusted else " weights-only"
        raise CannotCompare(f"{layout}; what they hold cannot be loaded{how} ({type(exc).__name__})") from exc
    if found is None:
        return Alike(f"{layout}; both load back to the same content")
    return f"{layout}; they load back to different content at {found}"


def kept(result: Any) -> Any:
    """What the evidence keeps of a side's output: its records (never the checkpoint's bytes)."""
    if isinstance(result, Written):
        return types.MappingProxyType(result.records or {"<pickle stream>": (len(result.data), "")})
    return result
