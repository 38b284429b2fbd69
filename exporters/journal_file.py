"""The journal's file: appended one whole line at a time, rotated by size, shared safely between processes.

Only a regular file of this user's that no one else can write is opened, never through a symlink, never waiting on a
FIFO planted there; 0600, since lines hold tensor values. Each line is one ``write(2)`` with ``O_APPEND``: whole at
the end of the file, even with other writers; a line that cannot be written whole is taken back and raised.
"""

from __future__ import annotations

import errno
import fcntl
import os

from shadow.core.support.safe_paths import open_own_file


class JournalFile:
    """The file at ``path``, rotated past ``max_bytes`` (0: never) keeping ``backups`` old files (path.1, ...)."""

    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        #: Lines not written (a full disk, a file that is not this user's own): each also raised to the caller.
        self.lines_lost = 0
        self._fd: int | None = None
        self._opened_before = False

    def write(self, data: bytes) -> None:
        """Append one line, whole or not at all (OSError where it could not be)."""
        if self._fd is not None and not self._still_named():
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            self._open()
        size = os.fstat(self._fd).st_size
        if self.max_bytes and size and size + len(data) > self.max_bytes:
            self._rotate(len(data))
        written = 0
        try:
            written = os.write(self._fd, data)
        finally:
            if written != len(data):
                self.lines_lost += 1
                if written:  # a line is written whole or not at all: take the part back
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"{self.path}: a line could not be written whole (disk full?); not written")

    def close(self) -> None:
        """Close the file (the next write opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def forget(self) -> None:
        """Drop the descriptor without closing it: a forked child's, whose parent keeps writing through it."""
        self._fd = None

    def _open(self) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd = open_own_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        if not self._opened_before:  # (a torn line is left by a process that died: only a start can find one)
            self._opened_before = True
            self._end_a_torn_line()

    def _end_a_torn_line(self) -> None:
        """A file whose last line is torn (a job killed mid-line, restarted on the same journal) gets its newline
        first: the next line starts whole, never appended to the torn one (readers skip the torn line, said)."""
        size = os.fstat(self._fd).st_size
        if not size:
            return
        try:
            with open(self.path, "rb", opener=lambda path, flags: os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
                f.seek(size - 1)
                last = f.read(1)
        except OSError:
            return
        if last != b"\n":
            os.write(self._fd, b"\n")

    def _still_named(self) -> bool:
        """Whether the path still names the open file (not deleted, renamed or rotated by another process)."""
        try:
            named, held = os.lstat(self.path), os.fstat(self._fd)
        except FileNotFoundError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _rotate(self, incoming: int) -> None:
        """Rotate under an exclusive lock on ``path.lock``, so that processes sharing the path rotate once
        between them; a process that finds the file already rotated just reopens the new one."""
        lock = open_own_file(f"{self.path}.lock", os.O_WRONLY | os.O_CREAT)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._still_named() and os.fstat(self._fd).st_size + incoming > self.max_bytes:
                if self.backups:
                    for index in range(self.backups - 1, 0, -1):
                        older = f"{self.path}.{index}"
                        if os.path.exists(older):
                            os.replace(older, f"{self.path}.{index + 1}")
                    os.replace(self.path, f"{self.path}.1")
                else:
                    os.remove(self.path)
            os.close(self._fd)
            self._fd = None
            self._open()
        finally:
            os.close(lock)  # (releases the lock)
