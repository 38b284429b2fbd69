"""What the rules and the dashboard query: series named by the metric contract, and label selectors built from
the core's vocabulary. Nothing here spells a metric name."""

from __future__ import annotations

from shadow.core.model import contract

CALLS = contract.CALLS.series
ROLLBACKS = contract.ROLLBACKS.series
RESETS = contract.RESETS.series
COMPARISONS = contract.COMPARISONS.series
CLUSTERS = contract.CLUSTERS.series
MISMATCHES = contract.MISMATCHES.series
SKIPPED = contract.SKIPPED.series
EXPORT_ERRORS = contract.EXPORT_ERRORS.series
SHARED = contract.SHARED_DIVERGENCES.series
ABS_ERROR = contract.ABS_ERROR.series
REL_ERROR = contract.REL_ERROR.series
PRIMARY_TIME = contract.PRIMARY_TIME.series
#: The primary's time as series written before it was named by role carry it (read beside PRIMARY_TIME).
LEGACY_TIME = contract.LEGACY_TIME_SERIES
SHADOW_TIME = contract.SHADOW.series
SAMPLE_RATE = contract.SAMPLE_RATE.prometheus_name
PRIMARY = contract.PRIMARY.prometheus_name
DRILL_ACTIVE = contract.DRILL_ACTIVE.prometheus_name
NOISE_FLOOR = contract.NOISE_FLOOR.prometheus_name
AA_RUNS = contract.AA_RUNS.series
NOISE_CHECKS = contract.NOISE_CHECKS.series
BACKWARD_RUNS = contract.BACKWARD_RUNS.series
TRUTH_RUNS = contract.TRUTH_RUNS.series
PATCH_CALLS = contract.PATCH_CALLS.series
ARM_ITERATORS = contract.ARM_ITERATORS.series
ARM_FIRST_BATCH = contract.ARM_FIRST_BATCH.series
ARM_FIRST_BATCHES = contract.ARM_FIRST_BATCHES.series

HARD_REASONS = contract.VOCABULARY["hard_reasons"]
COMPARED = f'outcome=~"{"|".join(contract.VOCABULARY["compared_outcomes"])}"'
DIVERGENT = f'outcome=~"{"|".join(contract.VOCABULARY["divergent_outcomes"])}"'
