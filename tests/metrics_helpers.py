"""Reading Prometheus expositions in tests: real scrapes, parsed by prometheus-client's own parser."""

import os
import re
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def samples(text: str, runs: bool = False) -> dict[tuple, float]:
    """{(sample name, sorted label items): value}; without ``runs`` the ``run`` label every series carries is left
    out (series of several runs summed)."""
    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels if runs else {k: v for k, v in sample.labels.items() if k != "run"}
            key = (sample.name, tuple(sorted(labels.items())))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def without_run(text: str) -> str:
    """An exposition with the ``run`` label left out of every series (for tests that read it as text)."""
    text = re.sub(r'run="(?:[^"\\]|\\.)*",?', "", text)
    return text.replace(",}", "}").replace("{}", "")


def total(parsed: dict[tuple, float], name: str, **labels: str) -> float:
    """Sum of a sample over every series whose labels include ``labels``."""
    return sum(
        value for (sample, items), value in parsed.items() if sample == name and set(labels.items()) <= set(items)
    )


def promtool() -> str:
    """Path of promtool; skips the test where it is missing, except in CI where .ci/run installs it."""
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: .ci/run should have installed Debian's prometheus package")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
