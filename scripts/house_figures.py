"""The house's figures, measured on the tree as it is: product lines and modules (the largest, and any over 700
lines), the verdict's sources, the exporter protocol's hooks, one sampled call's path on the caller's thread
(``benchmarks/call_path.py``), and with ``--suite`` the whole suite's and the fast tier's times on this machine.

Run: ``python scripts/house_figures.py [--suite]`` (docs/layout.md reports what it printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The product's code: what ships (tests, benchmarks and scripts aside).
PRODUCT = ("shadow", "exporters", "shadow_pytest", "dashboards")
#: The reference legacy copy is torch_npu's code as we read it, not ours to split.
NOT_OURS = (os.path.join("shadow", "npu", "reference.py"),)
MODULE_LIMIT = 700


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def product_modules() -> dict[str, int]:
    """Every product module's lines, by path from the root."""
    found = {}
    for top in PRODUCT:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    found[os.path.relpath(path, ROOT)] = _lines(path)
    return found


def suite_seconds(*marks: str) -> float:
    """Wall seconds of ``pytest -q -n 2`` (with ``-m`` marks where given) on this machine."""
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *marks]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="store_true", help="also time the whole suite and the fast tier")
    suite = parser.parse_args().suite
    modules = product_modules()
    ours = {path: lines for path, lines in modules.items() if path not in NOT_OURS}
    largest = sorted(ours.items(), key=lambda item: -item[1])[:5]
    over = [path for path, lines in ours.items() if lines > MODULE_LIMIT]
    print(f"product: {sum(modules.values()):,} lines in {len(modules)} modules")
    print("largest modules: " + ", ".join(f"{path} {lines}" for path, lines in largest))
    print(f"modules over {MODULE_LIMIT} lines (the reference legacy copy aside): {len(over)} {sorted(over)}")
    sources = {p: n for p, n in modules.items() if p.startswith(os.path.join("shadow", "analysis", "sources"))}
    print(f"the verdict's sources: {sum(sources.values()):,} lines in {len(sources)} modules")
    sys.path.insert(0, ROOT)
    from shadow.core.calls.record.exporting import HOOKS

    print(f"exporter protocol: {len(HOOKS)} hooks ({', '.join(HOOKS)})")
    path = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "call_path.py")], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    print(path.stdout, end="")
    if suite:
        print(f"the fast tier (-m 'not slow'): {suite_seconds('-m', 'not slow'):.0f} s")
        print(f"the whole suite: {suite_seconds():.0f} s")


if __name__ == "__main__":
    main()
