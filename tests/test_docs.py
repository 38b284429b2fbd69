"""The documentation: a README a newcomer can hold, the reference in docs/ by topic, every link and anchor real,
every documented command one the project really accepts, and no paragraph in two places."""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from shadow.launcher import cli
from shadow_pytest import VALUE_OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PAGES = [os.path.join(ROOT, "README.md"), *DOCS]
LINK = re.compile(r"\]\(([^)#\s]+\.md)(#[^)\s]+)?\)")
FENCE = re.compile(r"```(?:bash|sh)?\n(.*?)```", re.S)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_is_one_screen_with_the_two_commands_and_a_way_to_every_page():
    readme = read(os.path.join(ROOT, "README.md"))
    assert len(readme.encode()) < 8_000, "the README is the first screen; the reference lives in docs/"
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
    assert "chromium" in readme and "prometheus" in readme  # what the test command installs, said
    linked = {os.path.normpath(os.path.join(ROOT, target)) for target, _ in LINK.findall(readme)}
    assert linked == {os.path.normpath(page) for page in DOCS}


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_every_link_and_anchor_exists(page):
    text = read(page)
    for target, anchor in LINK.findall(text):
        path = os.path.normpath(os.path.join(os.path.dirname(page), target))
        assert os.path.exists(path), f"{os.path.basename(page)} links to {target}, which does not exist"
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", read(path), re.M)}
            assert anchor[1:] in headings, f"{os.path.basename(page)}: no heading {anchor} in {target}"


def _commands(text: str):
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():  # (continued lines joined)
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                yield re.sub(r"^(\w+=\S+ )+", "", line)  # (without the variables set for the command)


def _pytest_options() -> set[str]:
    import shadow_pytest

    options: set[str] = set()

    class Group:
        def addoption(self, *names, **kwargs):
            options.update(names)

    class Parser:
        def getgroup(self, *args, **kwargs):
            return Group()

    shadow_pytest.pytest_addoption(Parser())
    return options


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_every_documented_command_is_one_the_project_accepts(page):
    """``npu-shadow ...`` lines parse with the real command line; pytest lines use the plugin's real options;
    scripts, benchmarks and modules named exist."""
    parser, plugin_options = cli.build_parser(), _pytest_options()
    for line in _commands(read(page)):
        words = shlex.split(line.replace("...", "x"))
        if words[:1] == ["npu-shadow"] or words[:3] == ["python", "-m", "shadow"]:
            arguments = words[1:] if words[0] == "npu-shadow" else words[3:]
            try:
                parser.parse_args(arguments)
            except SystemExit as exc:
                raise AssertionError(f"{os.path.basename(page)}: `{line}` is not a valid command") from exc
        if words[:1] == ["pytest"] or words[:2] == ["npu-shadow", "ab"]:
            # (a value apart from its option is taken for a test path when pytest chooses its rootdir)
            apart = [word for word in words if word in VALUE_OPTIONS]
            assert not apart, f"{os.path.basename(page)}: `{line}` gives {apart} a value apart: write --option=value"
        if words[:1] == ["pytest"]:
            for word in words[1:]:
                if word.startswith("--npu-shadow"):
                    assert word.split("=")[0] in plugin_options, f"{os.path.basename(page)}: {word} in `{line}`"
        elif words[:1] == ["bash"] or (words[:1] == ["python"] and words[1].endswith(".py")):
            assert os.path.exists(os.path.join(ROOT, words[1])), f"{os.path.basename(page)}: `{line}`"
        elif words[:2] == ["python", "-m"]:
            module = words[2].replace(".", "/")
            assert os.path.exists(os.path.join(ROOT, module + ".py")) or os.path.isdir(os.path.join(ROOT, module))


def _paragraphs(text: str):
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        if len(flat) >= 200 and not flat.startswith(("```", "|")):
            yield flat


def test_no_paragraph_is_in_two_places():
    seen: dict[str, str] = {}
    for page in PAGES:
        for paragraph in _paragraphs(read(page)):
            assert paragraph not in seen, f"in {os.path.basename(page)} and {seen[paragraph]}: {paragraph[:80]}"
            seen[paragraph] = os.path.basename(page)


def test_every_test_the_docs_name_exists():
    """A test named in the docs (exactly, or as a prefix ending in ``*`` or ``...``) is one the suite has (or,
    said so just before it, one of PyTorch's or torch_npu's own)."""
    import fnmatch

    defined: set[str] = set()
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", read(path), re.M))
    named = 0
    for page in PAGES:
        text = read(page)
        for found in re.finditer(r"`(test_\w+(?:\*|\.\.\.)?)`", text):
            if re.search(r"(PyTorch|torch_npu)'s own [^`]*$", text[max(0, found.start() - 60) : found.start()]):
                continue
            name = found.group(1)
            named += 1
            pattern = name.removesuffix("...") + ("*" if name.endswith("...") else "")
            assert fnmatch.filter(defined, pattern), f"{os.path.basename(page)} names {name}, which no test is"
    assert named > 20


def test_the_layout_is_drawn_from_the_tree_and_names_only_modules_that_exist():
    """docs/layout.md's tree is the tree's (every module of the product named, the call path's among them, none that
    is gone), and every dotted module path the page names resolves to a module of the repository (or a name in
    one)."""
    import re
    import runpy

    draw = runpy.run_path(os.path.join(ROOT, "scripts", "draw_layout.py"))
    with open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8") as file:
        text = file.read()
    tree = draw["tree"]()
    assert draw["current"]() == tree, "docs/layout.md's tree is stale: python scripts/draw_layout.py"
    calls = [m for m in draw["modules"]() if m.startswith(os.path.join("shadow", "core", "calls"))]
    named = [
        os.path.basename(os.path.dirname(m)) + "/" if m.endswith("__init__.py") else os.path.basename(m) for m in calls
    ]
    assert len(calls) > 15 and all(f" {name} " in tree for name in named)

    def exists(dotted: str) -> bool:
        parts = dotted.split(".")
        for end in (len(parts), len(parts) - 1):  # (a module, or a name in one)
            path = os.path.join(ROOT, *parts[:end])
            if os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py")):
                return True
        return False

    dotted = set(re.findall(r"`((?:shadow|exporters)(?:\.[A-Za-z_]+)+)`", text))
    assert dotted and not [name for name in sorted(dotted) if not exists(name)]
