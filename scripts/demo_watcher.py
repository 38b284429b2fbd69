"""The canary demo's watcher: stands in for Prometheus, Alertmanager and `npu-shadow receiver` (the end-to-end
rollback test runs the real ones). It reads the job's metrics while it trains and, at the first hard mismatch,
throws the job's rollback switch (a file). Usage: python scripts/demo_watcher.py METRICS_URL SWITCH [SECONDS]."""

from __future__ import annotations

import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HARD = ("dtype", "device", "exception")


def hard_mismatch(exposition: str) -> tuple[str, str] | None:
    """(reason, target) of the first hard mismatch counted in an exposition, whatever its other labels."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "npu_shadow_mismatches_total" and sample.labels.get("reason") in HARD and sample.value:
                return sample.labels["reason"], sample.labels.get("target", "?")
    return None


def main(url: str, switch: str, seconds: float = 300.0) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            time.sleep(0.2)
            continue
        found = hard_mismatch(text)
        if found:
            with open(switch, "w") as handle:
                handle.write(f"demo watcher: hard mismatch {found[0]} in {found[1]}\n")
            print(f"watcher: hard mismatch ({found[0]} in {found[1]}): rollback switch thrown", flush=True)
            return 0
        time.sleep(0.2)
    print("watcher: no hard mismatch before the deadline", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], *map(float, sys.argv[3:4])))
