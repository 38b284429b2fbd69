"""Draw docs/layout.md's module tree from the tree itself: every module of the product, by package, with the first
sentence of its docstring. ``python scripts/draw_layout.py`` rewrites the block between the markers;
``tests/test_docs.py`` checks the block is the tree's."""

from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("shadow", "exporters", "shadow_pytest", "dashboards")
LAYOUT = os.path.join(ROOT, "docs", "layout.md")
START, END = "<!-- the tree: scripts/draw_layout.py -->", "<!-- end of the tree -->"


def _summary(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        doc = ast.get_docstring(ast.parse(file.read())) or ""
    text = " ".join(doc.split())
    found = re.search(r"(?<=[a-z)`\]])\.(\s|$)", text)  # (the first sentence)
    sentence = text[: found.start() + 1] if found else text
    return sentence if len(sentence) <= 90 else sentence[:87].rsplit(" ", 1)[0] + " ..."


def modules() -> list[str]:
    """Every module of the product, as a path from the repository's root."""
    found = []
    for package in PACKAGES:
        for directory, subdirectories, files in os.walk(os.path.join(ROOT, package)):
            subdirectories[:] = sorted(d for d in subdirectories if not d.startswith(("__", ".")) and d != "csrc")
            found += [os.path.relpath(os.path.join(directory, f), ROOT) for f in sorted(files) if f.endswith(".py")]
    return found


def tree() -> str:
    """The block: one line per module, indented by its package's depth, with its summary."""
    lines = [START, "```text"]
    for path in modules():
        depth = path.count(os.sep)
        name = os.path.basename(path)
        shown = os.path.basename(os.path.dirname(path)) + "/" if name == "__init__.py" else name
        if name == "__init__.py":
            depth -= 1
        lines.append(f"{'  ' * depth}{shown:<{max(1, 26 - 2 * depth)}} {_summary(os.path.join(ROOT, path))}".rstrip())
    return "\n".join([*lines, "```", END])


def current() -> str:
    """The block as docs/layout.md has it now."""
    with open(LAYOUT, encoding="utf-8") as file:
        text = file.read()
    return text[text.index(START) : text.index(END) + len(END)]


if __name__ == "__main__":
    drawn, now = tree(), current()
    with open(LAYOUT, encoding="utf-8") as file:
        text = file.read()
    with open(LAYOUT, "w", encoding="utf-8") as file:
        file.write(text.replace(now, drawn))
    sys.stdout.write(f"wrote {LAYOUT}\n")
