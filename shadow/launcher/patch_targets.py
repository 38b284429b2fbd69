"""A generic target for any function patch of a release, by its dotted name (``--shadow-patch NAME``).

The census (:mod:`shadow.analysis.census`) knows where a release installs each patch; :func:`refusal` tells, from its
cached list, whether a generic target may shadow it (never one the census says cannot run twice: the network, shared
memory, a capsule consumed once, compile-time internals; never one a built-in target shadows; never one that changes
its receiver in place, since a generic target compares what calls return). :func:`patch_target` makes the target:
legacy is the function the release installs there, loaded from its source (:func:`shadow.npu.torch_npu_source
.installed_function`), upstream is torch's own function at that place, and calls are compared as any target's are
(isolated, within the dtype's tolerance).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from shadow.npu.catalog import resolve
from shadow.npu.patching import LEGACY_ORIGIN_ATTRIBUTE, upstream_of


class PatchRefused(ValueError):
    """The named patch cannot have a generic target; the message says why."""


def _listing(release: str) -> dict[str, Any]:
    from shadow.analysis import census_cache

    return json.loads(census_cache.patch_list(release).read_text(encoding="utf-8"))


def _place(release: str, name: str) -> tuple[str, int, str]:
    """(file, line, version) of the function patch ``name`` of ``release``; PatchRefused where it cannot be shadowed."""
    listing = _listing(release)
    version = listing.get("version", release)
    place = listing.get("places", {}).get(name)
    if place is None:
        raise PatchRefused(
            f"{name!r} is no function patch of torch_npu {version} (`npu-shadow census {release}` lists them)"
        )
    from shadow.analysis import census

    why = census.listed_refusal(name, place)
    if why:
        raise PatchRefused(f"{name}: not shadowed: {why}")
    return place[0], int(place[1]), version


def refusal(release: str, name: str) -> str | None:
    """Why ``name`` of ``release`` cannot be shadowed by a generic target, told at start-up (the census's list, torch's
    function at the place, then the release's definition, loaded with none of its functions called), or None."""
    from shadow.analysis import census
    from shadow.npu import torch_npu_source

    try:
        file, line, _ = _place(release, name)
        owner, attribute = _owner_and_attribute(name)
        _torchs_own(owner, attribute, name)
        torch_npu_source.check_installed(census.locate(release), file, line)
    except PatchRefused as exc:
        return str(exc)
    except torch_npu_source.LegacySourceError as exc:
        return f"{name}: {exc}"
    return None


def _owner_and_attribute(name: str) -> tuple[Any, str]:
    owner_path, _, attribute = name.rpartition(".")
    try:
        return resolve(owner_path), attribute
    except (ImportError, AttributeError) as exc:
        raise PatchRefused(f"{name}: its place cannot be found in this torch ({exc})") from None


def _torchs_own(owner: Any, attribute: str, name: str) -> Any:
    """torch's own function at the place: what a legacy patch replaced there, else what is there now where it is
    torch's (PatchRefused where it is not: torch_npu imported first, or a place torch has no function at)."""
    found = upstream_of(owner, attribute)
    if found is not None:
        return found
    raw = inspect.getattr_static(owner, attribute, None)
    if isinstance(raw, type):
        raise PatchRefused(
            f"{name}: torch has a class there (a constructor: what it builds cannot be built twice unseen)"
        )
    if isinstance(raw, (classmethod, property)) or raw is None:
        raise PatchRefused(f"{name}: torch has no plain function there to compare with")
    function = raw.__func__ if isinstance(raw, staticmethod) else raw
    module = getattr(function, "__module__", "") or ""
    if getattr(function, LEGACY_ORIGIN_ATTRIBUTE, None) is not None or not module.startswith("torch"):
        raise PatchRefused(f"{name}: torch's own function there is unknown (torch_npu's patch was installed first)")
    return raw


def patch_target(release: str, name: str) -> Any:
    """A :class:`~shadow.core.model.target.Target` for the function patch ``name`` (a dotted name, as ``npu-shadow
    census`` spells it) of torch_npu ``release`` (a wheel, a cached version, a directory, ``installed``): legacy from
    the release's source, upstream torch's function at that place, compared as any target's calls are.

    Raises:
        PatchRefused: where the census says it cannot run twice, a built-in target shadows it, it changes its
            receiver in place, or its definition cannot be loaded on its own (the message says which).
    """
    from shadow.analysis import census
    from shadow.core.model.target import Target
    from shadow.npu import torch_npu_source

    file, line, _ = _place(release, name)
    owner, attribute = _owner_and_attribute(name)
    upstream = _torchs_own(owner, attribute, name)
    try:
        legacy = torch_npu_source.installed_function(census.locate(release), file, line)
    except torch_npu_source.LegacySourceError as exc:
        raise PatchRefused(f"{name}: {exc}") from None
    if isinstance(upstream, staticmethod):
        upstream, legacy = upstream.__func__, staticmethod(legacy)
    return Target(name=name, owner=owner, attribute=attribute, upstream=upstream, legacy=legacy)
