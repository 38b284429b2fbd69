"""A release's census kept on disk, beside the wheel cache: taken once per wheel (its digest), torch version and
census code, and read back as data only (a regular file of this user's in a private folder, naming the wheel it was
taken from); the function patches of a release kept the same way for the launcher's counters and
``--shadow-patch``."""

from __future__ import annotations

from pathlib import Path

from shadow.analysis.census import FUNCTION, IN_PLACE_KIND, Census, Patch, function_patches, locate, take
from shadow.npu.release_files import LegacySourceError

#: The files whose code decides a census (a kept census is taken again when one of them changes).
_CENSUS_CODE = (
    "shadow/analysis/census.py", "shadow/analysis/census_cache.py", "shadow/npu/catalog.py",
    "shadow/npu/torch_npu_source.py", "shadow/core/calls/patch_calls.py",
)  # fmt: skip


class UnsafeCache(LegacySourceError):
    """The cache the census keeps its lists in is not private: others could plant what a job counts or loads."""


def _census_folder() -> Path:
    """The folder the kept censuses and patch lists live in (beside the wheel cache), created private; raises
    UnsafeCache naming it where another user owns it or others can write it."""
    from shadow.core.support.safe_paths import directory_problem
    from shadow.npu.wheels import wheel_cache

    folder = wheel_cache().parent / PATCH_LISTS
    problem = directory_problem(str(folder))
    if problem is not None:
        raise UnsafeCache(f"{folder}: the census cache is {problem}: not used (make it private, or remove it)")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = directory_problem(str(folder))
    if problem is not None:
        raise UnsafeCache(f"{folder}: the census cache is {problem}: not used (make it private, or remove it)")
    return folder


def wheel_digest(path: Path) -> str:
    """The sha256 of a release's wheel (a kept census and patch list name the wheel they were taken from)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as wheel:
        for block in iter(lambda: wheel.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_kept(place: Path, digest: str) -> dict | None:
    """A kept JSON file of the census cache, read as data: only a regular file of this user's that no one else can
    write (never through a link, never waiting on a FIFO), taken from the wheel whose digest it names. None where it
    is not so (it is then taken again and replaced)."""
    import json
    import os

    from shadow.core.support.safe_paths import open_own_file

    try:
        fd = open_own_file(str(place), os.O_RDONLY)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            found = json.loads(handle.read(64 << 20))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("wheel_sha256") == digest else None


def _keep(place: Path, content: dict) -> None:
    """Write a kept JSON file whole (a new file renamed over the old, never through what is there)."""
    import json

    from shadow.core.support.safe_paths import replace_regular_file

    try:
        replace_regular_file(str(place), json.dumps(content).encode())
    except OSError:
        place.unlink(missing_ok=True)  # (a FIFO, a link or a folder planted there: gone, taken again next time)
        replace_regular_file(str(place), json.dumps(content).encode())


def _census_code() -> str:
    """A digest of the code that decides a census (:data:`_CENSUS_CODE`): what it keeps is taken again when that
    code changes."""
    import hashlib

    root = Path(__file__).resolve().parents[2]
    return hashlib.sha256(b"".join((root / name).read_bytes() for name in _CENSUS_CODE)).hexdigest()[:16]


def kept(source_path: str) -> Census:
    """The census of a release (as :func:`take`), taken once per wheel, torch version and census code, and kept in
    the cache beside the wheels: a later census of the same wheel reads it (a census reads the whole release, about
    20 s of CPU). A directory or an installed torch_npu, whose files can change, is taken every time, as is a kept
    census that cannot be read back as data (:func:`read_kept`). Raises UnsafeCache where the cache is not
    private."""
    import importlib.metadata

    path = Path(locate(source_path))
    if not path.is_file():
        return take(str(path))
    folder = _census_folder()
    code = _census_code()
    digest = wheel_digest(path)
    torch_version = importlib.metadata.version("torch")  # (not imported: a kept census needs no torch)
    place = folder / f"{path.name}.{digest[:16]}.torch-{torch_version}.{code}.census.json"
    found = read_kept(place, digest)
    if found is not None:
        try:
            return Census(str(path), str(found["version"]), tuple(Patch(**patch) for patch in found["patches"]))
        except (KeyError, TypeError):
            pass  # (not readable as a census: taken again)
    census = take(str(path))
    _keep(place, {**census.as_dict(), "wheel_sha256": digest})
    return census


#: Where the function patches of each release are kept once a census found them (beside the wheel cache).
PATCH_LISTS = "census"


#: The patch lists' format (a cached list of an older one is taken again).
PATCH_LIST_FORMAT = "v3"


def patch_list(source_path: str) -> Path:
    """A JSON file naming the function patches of the release at ``source_path`` (``{"version", "patches",
    "total", "places", "wheel_sha256"}``, ``places``: each one's file, line and kind), taken once per wheel and kept
    in the cache (a census reads the whole release: seconds). A kept list is data: used only where it is a regular
    file of this user's that names the wheel's digest (:func:`read_kept`), else taken again. Raises
    LegacySourceError where ``source_path`` is no release, UnsafeCache (naming the folder) where the cache is not
    private."""
    path = Path(locate(source_path))
    try:
        digest = wheel_digest(path) if path.is_file() else None
    except OSError as exc:
        raise LegacySourceError(f"{path}: {exc.strerror or exc}") from exc
    folder = _census_folder()
    if digest is None:  # (a directory or an installed torch_npu: its files can change, listed every time)
        import hashlib

        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()
    listed = folder / f"{path.name}.{digest[:16]}.{_census_code()}.{PATCH_LIST_FORMAT}.json"
    if path.is_file() and read_kept(listed, digest) is not None:
        return listed
    census = kept(str(path))
    places = {p.name: [p.file, p.line, p.kind] for p in census.patches if p.kind in (FUNCTION, IN_PLACE_KIND)}
    content = {
        "version": census.version, "patches": function_patches(census), "total": len(census.patches), "places": places,
        "wheel_sha256": digest,
    }  # fmt: skip
    _keep(listed, content)  # (whole or absent: ranks that start together read one file)
    return listed
