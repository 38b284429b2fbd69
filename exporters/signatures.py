"""Which signature values a job's processes show, at most MAX_SIGNATURES per target between them.

Each process caps its own signatures (:mod:`shadow.core.calls.gate.coverage`), and an endpoint that aggregates a
folder of processes caps what it serves (:class:`exporters.prometheus.SignatureCappedCollector`). Processes that
export on their own (each rank its own folder, endpoint and Pushgateway group) would still show their caps added
up: twelve ranks, 1,200 values on the Pushgateway. Under the launcher they share its metrics folder, and admit a
signature value there: a slot file per value (``slot-<n>`` holding it, whole from the moment it exists: written
beside it and linked there), at most MAX_SIGNATURES slots per target (one that is no regular file is never opened
to wait on, never used); a value that finds no slot is exported as ``other``. A process asks once per new value.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading

from shadow.core.model.observation import MAX_SIGNATURES, OTHER_SIGNATURE
from shadow.core.support.safe_paths import check_private_directory

#: The launcher's metrics folder, shared by the job's processes on a node (the bootstrap's METRICS_DIR).
SHARED_DIR_VARIABLE = "NPU_SHADOW_METRICS_DIR"


class JobSignatures:
    """The signature values this node's processes of the job may show, admitted in ``directory``."""

    def __init__(self, directory: str, limit: int = MAX_SIGNATURES) -> None:
        self.directory = os.path.join(directory, "signatures")
        self.limit = limit
        self._known: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls) -> JobSignatures | None:
        """The job's admission where the launcher shares a metrics folder, else None (a process on its own)."""
        directory = os.environ.get(SHARED_DIR_VARIABLE)
        if not directory:
            return None
        try:
            check_private_directory(directory, SHARED_DIR_VARIABLE)
        except ValueError:
            return None  # (not the launcher's private folder: each process keeps its own cap)
        return cls(directory)

    def admit(self, target: str, signature: str) -> str:
        """``signature`` where the job shows it (already, or in a free slot), else OTHER_SIGNATURE."""
        if signature in ("", OTHER_SIGNATURE):
            return signature
        with self._lock:
            key = (target, signature)
            if key not in self._known:
                self._known[key] = self._admitted(target, signature)
            return self._known[key]

    def _admitted(self, target: str, signature: str) -> str:
        folder = os.path.join(self.directory, hashlib.sha256(target.encode()).hexdigest()[:16])
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            wanted = signature.encode("utf-8", "surrogatepass")
            for slot in range(self.limit):
                path = os.path.join(folder, f"slot-{slot}")
                found = _read(path)
                if found is None and _claim(folder, path, wanted):
                    return signature
                if (found if found is not None else _read(path)) == wanted:
                    return signature
        except OSError:
            return signature  # (the folder cannot be used: this process's own cap still holds)
        return OTHER_SIGNATURE


#: What a slot that is no regular file of this user's reads as (a FIFO planted there: never opened to wait on).
_UNUSABLE = b"\0"


def _claim(folder: str, path: str, value: bytes) -> bool:
    """Make the slot at ``path`` hold ``value``, whole from the moment it exists (written beside it, then linked
    there: a rank that reads it never finds it empty); False where another process made it first."""
    partial = os.path.join(folder, f".claim-{os.getpid()}-{threading.get_ident()}")
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(value)
        os.link(partial, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(partial)


def _read(path: str) -> bytes | None:
    """A slot's value; None where there is no slot; :data:`_UNUSABLE` where it is no regular file (never waited
    on)."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return _UNUSABLE
    with os.fdopen(handle, "rb") as opened:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return _UNUSABLE
        return opened.read(4096)
