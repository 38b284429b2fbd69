"""One vocabulary, defined once: outcomes and their sets in the core, metric names in the exporters' contract."""

import os
import re

from shadow.core.model import contract
from shadow.core.model.observation import COMPARED_OUTCOMES, DIVERGENT_OUTCOMES, OUTCOMES, Observation, Outcome

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NAMES = sorted({m.prometheus_name for m in (*contract.ALL, contract.BUILD_INFO)}, key=len, reverse=True)
METRIC_NAME = re.compile(r"(?<!\w)(" + "|".join(_NAMES) + r")(_total|_bucket|_count|_sum)?(?!\w)")


def test_outcome_sets_derive_from_the_enum():
    assert tuple(o.value for o in Outcome) == OUTCOMES
    assert set(COMPARED_OUTCOMES) == set(OUTCOMES) - {"skipped"}
    assert set(DIVERGENT_OUTCOMES) == {"mismatch", "error"} <= set(COMPARED_OUTCOMES)


def test_observations_hold_plain_strings_whatever_they_were_given():
    observation = Observation("op", Outcome.MATCH)
    assert type(observation.outcome) is str and observation.outcome == "match"
    assert f"{Outcome.CLOSE}" == "close"


def test_metric_names_are_spelled_only_in_the_contract():
    """Rules, dashboard, verdict sources, exporters and reports name metrics through shadow/core/model/contract.py
    (rule test inputs, which are data about series, may spell them)."""
    spelled = []
    for package in ("shadow", "exporters", "dashboards", "shadow_pytest"):
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                path = os.path.join(directory, name)
                if not name.endswith(".py") or path.endswith(
                    ("shadow/core/model/contract.py", "dashboards/rule_cases.py")
                ):
                    continue
                with open(path, encoding="utf-8") as file:
                    for number, line in enumerate(file, 1):
                        code = line.split("#", 1)[0]
                        if METRIC_NAME.search(code) and '"""' not in code and "``" not in code:
                            spelled.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert spelled == []
    assert {m.series for m in contract.ALL} >= {"npu_shadow_comparisons_total", "npu_shadow_export_errors_total"}
