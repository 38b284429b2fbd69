"""The README's verdict excerpt is the demo's own output: this writes it from a demo run.

    bash scripts/demo.sh > demo.log && .venv/bin/python scripts/readme_excerpt.py demo.log

replaces the fenced block under the README's marker with the run's verdict, a line per target (its "why" cut to
the width of a screen), the bounds line and the overall line. ``tests/test_demo.py`` runs the demo and fails where
the README's targets, decisions, counts or bounds are not the run's.
"""

from __future__ import annotations

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- the demo's verdict, written by scripts/readme_excerpt.py from a demo run -->"
WIDTH = 150
#: A target's line of the verdict table: name, decision, compared, divergent, bounds.
ROW = re.compile(r"^(\w+) +(promote|rollback|inconclusive|not exercised) +(\d+) +(\d+) +(\[[^\]]*\]|-)", re.M)


def verdict_section(text: str) -> str:
    """The verdict's table in a demo's output (from its header to the overall line)."""
    start = text.index("== verdict\n") + len("== verdict\n")
    end = text.index("\n", text.index("overall: ", start))
    return text[start:end]


def rows(text: str) -> list[tuple[str, ...]]:
    """Each target's name, decision, compared, divergent and bounds, in the order shown."""
    return [match.groups() for match in ROW.finditer(text)]


def excerpt(demo_output: str) -> str:
    """The lines the README shows: the header, a line per target, the bounds and the overall line."""
    lines = verdict_section(demo_output).splitlines()
    kept = [lines[0], *(line for line in lines if ROW.match(line))]
    kept += [line for line in lines if line.startswith(("bounds: ", "overall: "))]
    return "\n".join(line if len(line) <= WIDTH else line[: WIDTH - 4].rstrip() + " ..." for line in kept)


def readme_excerpt(readme: str) -> str:
    """The fenced block under the marker."""
    block = readme[readme.index(MARKER) :]
    return block.split("```\n")[1]


def rewrite(readme: str, demo_output: str) -> str:
    """The README with its excerpt replaced by the demo's."""
    return readme.replace(readme_excerpt(readme), excerpt(demo_output) + "\n", 1)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    demo_output = pathlib.Path(argv[0]).read_text(encoding="utf-8")
    README.write_text(rewrite(README.read_text(encoding="utf-8"), demo_output), encoding="utf-8")
    print(f"README.md: the verdict of {len(rows(demo_output))} targets, from {argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
