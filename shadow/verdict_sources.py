"""Where the verdict's counts come from: a Prometheus server, a saved exposition, or journals."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from shadow.verdict import TargetCounts

COMPARISONS = "npu_shadow_comparisons_total"
MISMATCHES = "npu_shadow_mismatches_total"
SHARED = "npu_shadow_shared_divergences_total"


class SourceError(Exception):
    """A source could not be read; the message says which and why."""


def from_exposition(text: str) -> dict[str, TargetCounts]:
    """Counts from a Prometheus text exposition (a saved scrape, a textfile-collector file)."""
    counts: dict[str, TargetCounts] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:
        raise SourceError(f"not a Prometheus text exposition: {exc}") from exc
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if sample.name == COMPARISONS:
                target = counts.setdefault(labels.get("target", ""), TargetCounts())
                target.add_outcome(labels.get("signature", ""), labels.get("outcome", ""), sample.value)
            elif sample.name == MISMATCHES:
                target = counts.setdefault(labels.get("target", ""), TargetCounts())
                target.add_reason(labels.get("reason", ""), sample.value)
            elif sample.name == SHARED:
                target = counts.setdefault(labels.get("target", ""), TargetCounts())
                target.add_shared(labels.get("reason", ""), sample.value)
    return counts


def _query(url: str, promql: str, timeout: float) -> list[dict]:
    address = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(address, timeout=timeout) as response:
            body = json.load(response)
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot query {url}: {exc}") from exc
    if body.get("status") != "success":
        raise SourceError(f"{url} answered {body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def from_prometheus(
    url: str, window: str | None = None, selector: str = "", timeout: float = 30
) -> dict[str, TargetCounts]:
    """Counts from a Prometheus server: increases over ``window`` (e.g. '6h'), or the counters' current
    values when no window is given; ``selector`` narrows the series, e.g. 'job="train"'."""

    def series(metric: str) -> str:
        selected = f"{metric}{{{selector}}}"
        return f"increase({selected}[{window}])" if window else selected

    counts: dict[str, TargetCounts] = {}
    for item in _query(url, f"sum by (target, signature, outcome) ({series(COMPARISONS)})", timeout):
        labels, value = item["metric"], float(item["value"][1])
        counts.setdefault(labels.get("target", ""), TargetCounts()).add_outcome(
            labels.get("signature", ""), labels.get("outcome", ""), value
        )
    for item in _query(url, f"sum by (target, reason) ({series(MISMATCHES)})", timeout):
        labels, value = item["metric"], float(item["value"][1])
        counts.setdefault(labels.get("target", ""), TargetCounts()).add_reason(labels.get("reason", ""), value)
    for item in _query(url, f"sum by (target, reason) ({series(SHARED)})", timeout):
        labels, value = item["metric"], float(item["value"][1])
        counts.setdefault(labels.get("target", ""), TargetCounts()).add_shared(labels.get("reason", ""), value)
    return counts


def from_journal(paths: Iterable[str]) -> dict[str, TargetCounts]:
    """Counts from JSONL journals. Journals hold matches only when written with ``all_outcomes=True``."""
    counts: dict[str, TargetCounts] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        target = counts.setdefault(record["target"], TargetCounts())
                        target.add_outcome(record.get("signature", ""), record["outcome"], 1)
                        if record["outcome"] != "skipped":
                            for reason in record.get("reasons", []):
                                target.add_reason(reason, 1)
                        if record.get("shared_divergence"):
                            target.add_shared(record["shared_divergence"], 1)
                    except (ValueError, KeyError, TypeError) as exc:
                        raise SourceError(f"{path}:{number}: not a journal line ({exc})") from exc
        except OSError as exc:
            raise SourceError(f"cannot read {path}: {exc}") from exc
    return counts
