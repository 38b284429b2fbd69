"""The project's shell scripts, read as text: hazards that fail a newcomer's command only now and then."""

from __future__ import annotations

import pathlib
import re

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parent.parent / "scripts").glob("*.sh"))

#: A reader that stops before its writer has written everything: the writer then dies of SIGPIPE (exit 141), which
#: ``pipefail`` makes the pipeline's status. Whether it happens depends on how the writer's output was buffered.
EARLY_READER = re.compile(r"\|\s*(head\s+(-n\s*\+?|-)\d|head\s+-c|head\s*$|grep\s+(-\w*q|--quiet))")


def test_no_pipeline_under_pipefail_ends_in_a_reader_that_stops_early():
    """`bash scripts/demo.sh --canary-drill` exited 141 in CI: `... | sort | head -n 6` under ``set -o pipefail``,
    where sort wrote more rollbacks than head read."""
    found = []
    for script in SCRIPTS:
        text = script.read_text()
        if "pipefail" not in text:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.lstrip().startswith("#") and EARLY_READER.search(line):
                found.append(f"{script.name}:{number}: {line.strip()}")
    assert SCRIPTS and not found, found


def test_the_early_reader_pattern_finds_what_it_is_for():
    for hazard in ("x | sort | head -n 6", "x | head -1", "x | head", "x | grep -q y", "x | grep --quiet y"):
        assert EARLY_READER.search(hazard), hazard
    for fine in ("x | head -n -1", "x | tail -1", "x | grep y", "x || true"):
        assert not EARLY_READER.search(fine), fine
