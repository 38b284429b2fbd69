"""Directories the tool writes where other users might reach: refused when they are not private.

A capture directory or a multiprocess metrics directory that another user owns or can write could hold planted
symlinks or files (the job would then write where that user chooses, or read their values as its own).
"""

from __future__ import annotations

import os
import stat

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
