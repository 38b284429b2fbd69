"""The release's patches a job called that no evidence speaks for: the verdict decides the targets it has evidence
of, and says which called patches that leaves out, with what could give evidence about each (the census's
``covered_by``), so that an overall promote reads as what it is."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shadow.analysis.evidence import TargetCounts


@dataclasses.dataclass(frozen=True)
class Unspoken:
    """A called patch no comparison in the sources speaks for: its calls, and what could give evidence."""

    patch: str
    calls: int
    covered_by: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return f"{self.patch}: called {self.calls:,} times, no evidence here; {self.covered_by}"


def unspoken(calls: Mapping[str, float], counts: Mapping[str, TargetCounts]) -> list[Unspoken]:
    """The patches with calls (``calls``: the sources' ``npu_shadow_patch_calls_total``) whose covering target, if
    any, compared none of its calls in ``counts``; the most called first."""
    from shadow.analysis import census

    found = []
    for patch, called in calls.items():
        if called <= 0 or not patch:  # (a series without its patch's name names none)
            continue
        covered = census.covered_by(patch)
        target = census.covering_target(covered) or patch
        entry = counts.get(target)
        if entry is not None and entry.compared > 0:
            continue
        found.append(Unspoken(patch, round(called), covered))
    return sorted(found, key=lambda u: (-u.calls, u.patch))
