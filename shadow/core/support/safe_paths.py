"""Directories the tool writes where other users might reach: refused when they are not private.

A capture directory or a multiprocess metrics directory that another user owns or can write could hold planted
symlinks or files (the job would then write where that user chooses, or read their values as its own).
"""

from __future__ import annotations

import contextlib
import os
import stat
import string

#: The longest name one path component may have (NAME_MAX on Linux and macOS).
NAME_MAX = 255


def directory_problem(path: str) -> str | None:
    """Why ``path`` is not a private directory (owned by this user, writable by no one else), or None. A path
    that does not exist yet has no problem: it will be created private."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link (give the directory itself)"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.filemode(info.st_mode)})"
    return None


def check_private_directory(path: str, setting: str) -> None:
    """Raise ValueError naming ``setting`` when :func:`directory_problem` finds one."""
    problem = directory_problem(path)
    if problem is not None:
        raise ValueError(f"{setting}={path!r} is not valid: {problem}")


def make_private_directory(path: str, setting: str) -> None:
    """Create ``path`` (mode 0700) if needed, once it passes :func:`check_private_directory`."""
    check_private_directory(path, setting)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{setting}={path!r} is not valid: cannot create it: {exc.strerror or exc}") from None
    check_private_directory(path, setting)


def long_component(path: str) -> str | None:
    """The first component of ``path`` longer than a file name can be, if any."""
    return next((part for part in path.split(os.sep) if len(part.encode()) > NAME_MAX), None)


def template_problem(template: str) -> str | None:
    """Why a file path template (``{pid}`` and ``{rank}`` allowed, plain: no format spec or conversion) cannot
    name a file to write, or None: empty, a bad or unknown field, a name longer than a file name can be, or an
    existing directory."""
    if not template:
        return "empty"
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"bad template: {exc}"
    for _, field, spec, conversion in fields:
        if field is None:
            continue
        if field not in ("pid", "rank"):
            return f"unknown field {{{field}}}: only {{pid}} and {{rank}}"
        if spec or conversion:
            return f"{{{field}}} takes no format spec or conversion (write {{{field}}})"
    longest = template.format(pid="4194304", rank="none")  # the longest values they take
    too_long = long_component(longest)
    if too_long is not None:
        return f"a name of {len(too_long.encode())} bytes is longer than a file name can be"
    example = template.format(pid=os.getpid(), rank="none")
    if template.endswith(os.sep) or os.path.isdir(example):
        return "a directory, not a file"
    if os.path.lexists(example) and not stat.S_ISREG(os.lstat(example).st_mode):
        return "not a regular file (a device, a FIFO, a socket or a link): every line written there would be lost"
    return None


def open_own_file(path: str, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` (created with ``mode`` if ``flags`` has O_CREAT) for this user's own writing: never through
    a symbolic link, never blocking (a FIFO planted there is refused, not waited on), and only a regular file
    owned by this user that no one else can write. Raises OSError saying what is wrong."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise OSError(f"{path} is owned by another user (uid {info.st_uid})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OSError(f"{path} is writable by others (mode {stat.filemode(info.st_mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_regular_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: into a new file beside it, then renamed over it, only where
    ``path`` is a regular file or does not exist (renaming over a device such as /dev/null would replace it).
    Raises OSError saying what is wrong; the new file is removed then."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise OSError(f"{path} exists and is not a regular file: not replaced")
    partial = f"{path}.{os.getpid()}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
