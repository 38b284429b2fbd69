"""A torch_npu release's files, read as data (never imported, never run): a wheel or a directory holding the
``torch_npu`` package, each member bounded in size, count and nesting, decoded as Python source and parsed. Torch-free,
so that reading a release (``npu-shadow census``) needs no torch; :mod:`shadow.npu.torch_npu_source` loads the
patches from what it reads.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import io
import os
import stat
import tokenize
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path


class LegacySourceError(ValueError):
    """The given path holds no usable torch_npu source; the message names what is missing."""


#: What a release's source may hold before it is refused as not a torch_npu release (torch_npu 2.14.0: 1,660 files,
#: the largest 3.1 MB, its syntax trees at most 57 deep).
MAX_MEMBER_BYTES = 16 << 20
MAX_MEMBERS = 20_000
MAX_TOTAL_BYTES = 512 << 20
MAX_SYNTAX_DEPTH = 200


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``): a member name or a patched name from a hostile source
    never reaches a terminal raw."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class ReleaseFiles:
    """The files of one torch_npu release: a wheel (zip) or a directory holding the ``torch_npu`` package.

    Everything in it is data from outside: only regular files inside the source are read (a link, a FIFO or a
    device is refused, never opened), each at most MAX_MEMBER_BYTES (a wheel member is inflated no further), at most
    MAX_MEMBERS of them and MAX_TOTAL_BYTES in all; text in UTF-8 or the encoding its first lines declare. Anything
    else raises :class:`LegacySourceError` naming the file (the commands exit 2)."""

    def __init__(self, path: str | os.PathLike) -> None:
        text = os.fspath(path)
        if text == "installed":
            try:
                distribution = importlib.metadata.distribution("torch_npu")
            except importlib.metadata.PackageNotFoundError:
                raise LegacySourceError("no torch_npu distribution is installed in this environment") from None
            text = os.fspath(distribution.locate_file(""))
        self.path = Path(text)
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        self._read_bytes = 0
        if self.path.is_file():
            try:
                self._zip = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError, ValueError):
                raise LegacySourceError(
                    f"{printable(str(self.path))} is neither a torch_npu wheel nor a directory"
                ) from None
        elif (self.path / "torch_npu" / "utils").is_dir():
            self._root = self.path
        elif self.path.name == "torch_npu" and (self.path / "utils").is_dir():
            self._root = self.path.parent
        else:
            raise LegacySourceError(f"{printable(str(self.path))}: no torch_npu wheel or torch_npu package there")

    def read(self, member: str) -> str | None:
        """The text of ``member``, None where it is absent. Raises LegacySourceError for anything but a regular file
        of at most MAX_MEMBER_BYTES in UTF-8 (or its declared encoding)."""
        data = self._member_bytes(member) if self._zip is not None else self._file_bytes(member)
        if data is None:
            return None
        self._read_bytes += len(data)
        if self._read_bytes > MAX_TOTAL_BYTES:
            raise LegacySourceError(f"{printable(str(self.path))}: more than {MAX_TOTAL_BYTES >> 20} MiB of source")
        return _decoded(data, member).replace("\r\n", "\n")

    def _member_bytes(self, member: str) -> bytes | None:
        assert self._zip is not None
        try:
            info = self._zip.getinfo(member)
        except KeyError:
            return None
        if info.is_dir():
            return None
        _check_size(member, info.file_size)
        try:
            with self._zip.open(info) as opened:
                data = opened.read(MAX_MEMBER_BYTES + 1)  # (a member that inflates past its stated size stops here)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
            raise LegacySourceError(f"{printable(member)}: cannot be read from the wheel ({exc})") from None
        _check_size(member, len(data))
        return data

    def _file_bytes(self, member: str) -> bytes | None:
        assert self._root is not None
        path = self._root / member
        try:
            status = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise LegacySourceError(f"{printable(member)}: cannot be read ({exc.strerror})") from None
        if not _inside(path, self._root) or not stat.S_ISREG(status.st_mode):
            raise LegacySourceError(
                f"{printable(member)}: not a regular file inside {printable(str(self._root))} (a link, a FIFO or a "
                "device is never read)"
            )
        _check_size(member, status.st_size)
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            with os.fdopen(os.open(path, flags), "rb") as opened:
                if not stat.S_ISREG(os.fstat(opened.fileno()).st_mode):
                    raise LegacySourceError(f"{printable(member)}: not a regular file")
                data = opened.read(MAX_MEMBER_BYTES + 1)
        except OSError as exc:
            raise LegacySourceError(f"{printable(member)}: cannot be read ({exc.strerror})") from None
        _check_size(member, len(data))
        return data

    def _names(self) -> Iterator[str]:
        if self._zip is not None:
            yield from self._zip.namelist()
        else:
            for entry in self._root.glob("torch_npu-*.dist-info/METADATA"):
                yield entry.relative_to(self._root).as_posix()

    def python_files(self) -> Iterator[str]:
        """The package's ``.py`` files, as members (``torch_npu/utils/_module.py``): in a directory, the regular
        files below ``torch_npu`` (links are not followed); at most MAX_MEMBERS."""
        if self._zip is not None:
            found = [n for n in self._zip.namelist() if n.startswith("torch_npu/") and n.endswith(".py")]
        else:
            found = []
            for directory, subdirectories, files in os.walk(self._root / "torch_npu", followlinks=False):
                subdirectories.sort()
                for name in sorted(files):
                    path = Path(directory) / name
                    if name.endswith(".py") and stat.S_ISREG(os.lstat(path).st_mode):
                        found.append(path.relative_to(self._root).as_posix())
                if len(found) > MAX_MEMBERS:
                    break
        if len(found) > MAX_MEMBERS:
            raise LegacySourceError(f"{printable(str(self.path))}: more than {MAX_MEMBERS:,} Python files")
        yield from found

    def version(self) -> str:
        """From the distribution's METADATA, else ``torch_npu/version.py`` (read as data, never run)."""
        for name in self._names():
            if name.startswith("torch_npu-") and name.endswith(".dist-info/METADATA"):
                metadata = email.parser.Parser().parsestr(self.read(name) or "")
                if metadata.get("Name", "").replace("-", "_") == "torch_npu" and metadata.get("Version"):
                    return printable(metadata["Version"])
        text = self.read("torch_npu/version.py")
        if text is not None:
            for node in parse(text, "torch_npu/version.py").body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
                    value = node.value
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        return printable(value.value)
        return "unknown"

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def _check_size(member: str, size: int) -> None:
    if size > MAX_MEMBER_BYTES:
        raise LegacySourceError(
            f"{printable(member)}: larger than {MAX_MEMBER_BYTES >> 20} MiB, not a torch_npu source"
        )


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (its directories' links followed) to a place inside ``root``."""
    try:
        directory, top = os.path.realpath(path.parent), os.path.realpath(root)
        return directory == top or directory.startswith(top + os.sep)
    except (OSError, ValueError):
        return False


def _decoded(data: bytes, member: str) -> str:
    """The text of a file: UTF-8, or the encoding its first two lines declare (PEP 263), with or without a BOM."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding).removeprefix("\ufeff")
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise LegacySourceError(f"{printable(member)}: not text in UTF-8 or a declared encoding ({exc})") from None


def parse(text: str, member: str) -> ast.Module | None:
    """``text`` parsed (never run), or None where this Python cannot parse it (a template, a file for another
    version). Raises LegacySourceError where it nests deeper than MAX_SYNTAX_DEPTH (every reader of the tree
    recurses)."""
    try:
        with warnings.catch_warnings():  # (old files have invalid escapes in code we never run)
            warnings.simplefilter("ignore")
            tree = ast.parse(text, filename=member)
    except (SyntaxError, ValueError):
        return None
    except (RecursionError, MemoryError):
        tree = None
    if tree is None or _depth(tree) > MAX_SYNTAX_DEPTH:
        raise LegacySourceError(f"{printable(member)}: nested deeper than {MAX_SYNTAX_DEPTH} levels, not read")
    return tree


def _depth(tree: ast.AST) -> int:
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_SYNTAX_DEPTH:
            stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _parse(text: str, member: str) -> ast.Module:
    tree = parse(text, member)
    if tree is None:
        raise LegacySourceError(f"{printable(member)}: this Python cannot parse it")
    return tree
