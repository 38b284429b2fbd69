"""The patch board: a release's patches ranked by the calls a fleet's jobs made of them, each with what gives
evidence about deleting it (the census's ``covered_by``) and the decision that evidence reaches, every run of the
source pooled. ``npu-shadow census RELEASE --journal ...`` and ``--prometheus URL`` print it; the dashboard's
"Patch board" panel shows its first two columns from the store."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shadow.analysis import census
from shadow.analysis.evidence import TargetCounts

#: The decision column of a patch whose covering target compared nothing in the source.
NO_EVIDENCE = "no evidence"
#: The decision column of a patch nothing can give evidence about call by call (an addition, a constructor, ...).
NOTHING_TO_DECIDE = "-"


@dataclasses.dataclass(frozen=True)
class BoardRow:
    """One patch of the release: the jobs' calls of it, what covers it, and that evidence's decision."""

    patch: census.Patch
    calls: int
    covered_by: str
    decision: str

    def as_dict(self) -> dict:
        return {**self.patch.as_dict(), "calls": self.calls, "covered_by": self.covered_by, "decision": self.decision}


def board(taken: census.Census, calls: Mapping[str, float], decisions: Mapping[str, str]) -> list[BoardRow]:
    """Every patch of ``taken`` with the jobs' ``calls`` of it and the decision of the target covering it
    (``decisions``: target -> decision, from the same source), the most called first (then by name)."""
    rows = []
    for patch, called, covered in census.by_calls(taken, dict(calls)):
        target = census.covering_target(covered)
        decision = NOTHING_TO_DECIDE if target is None else decisions.get(target, NO_EVIDENCE)
        rows.append(BoardRow(patch, called, covered, decision))
    return rows


def decisions_of(counts: Mapping[str, TargetCounts], max_rate: float) -> dict[str, str]:
    """Each target's decision on ``counts`` (every run pooled) at ``max_rate``, with the built-in risky signatures
    and the verdict's defaults; a target that compared nothing has no evidence, never a decision."""
    from shadow.analysis import decisions, verdict
    from shadow.core.model.observation import BUILTIN_RISKY

    compared = {target: entry for target, entry in counts.items() if entry.compared > 0}
    decided = verdict.decide_all(compared, max_rate, BUILTIN_RISKY, decisions.DEFAULT_MIN_PER_SIGNATURE)
    return {d.target: d.decision for d in decided}
