"""What a newcomer reads in the first hour (issue 56's smaller findings): tables whose columns stay apart, lines that
say what happened, and nothing printed that is not the tool's to say."""

from __future__ import annotations

import re

from test_verdict import run_verdict

from shadow.core.model.observation import TargetStats
from shadow.launcher.launch import summary


def test_the_longest_target_name_keeps_its_column_apart(tmp_path) -> None:
    """``storage_deepcopynot exercised`` and ``storage_deepcopyinconclusive``: a 16-character name filled its column."""
    said = summary({"storage_deepcopy": TargetStats(), "tensor_type": TargetStats(calls=3, sampled=3, match=3)})
    assert "storage_deepcopy not exercised" in said
    header, row = [line for line in said.splitlines() if line.startswith(("npu-shadow  ", "tensor_type"))]
    assert header.index("calls") + len("calls") == re.search(r"\d+", row).end()  # numbers under their heading
    scrape = tmp_path / "scrape.prom"
    scrape.write_text(
        'npu_shadow_comparisons_total{target="storage_deepcopy",outcome="match",signature="s",primary="legacy"} 4\n'
    )
    table = run_verdict("--metrics-file", str(scrape)).stdout
    assert re.search(r"^storage_deepcopy +inconclusive +4 +0", table, flags=re.M), table
