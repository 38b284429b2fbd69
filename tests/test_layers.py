"""The house is one-way: every import (module level or inside a function) points to the same layer or a lower one,
no file takes part in an import cycle, and a layer uses only the public names of the layers beneath it. The core's
sub-packages are layers of their own (support < model < runs < judging < calls), and so are the call path's families
(gate < record < sampled < canary), each with a one-line docstring."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("shadow", "exporters", "shadow_pytest", "dashboards")

#: Lowest first. The ``shadow`` package itself (its __init__, the public API) sits on top of everything.
LAYERS = (
    ("shadow.npu",),
    ("shadow.core.support",),
    ("shadow.core.model",),
    ("shadow.core.runs",),
    ("shadow.core.judging",),
    ("shadow.core.calls.gate",),
    ("shadow.core.calls.record",),
    ("shadow.core.calls.sampled",),
    ("shadow.core.calls.canary",),
    ("shadow.core.calls",),
    ("shadow.core",),
    ("exporters",),
    ("shadow.analysis",),
    ("shadow.launcher", "shadow_pytest", "dashboards"),
    ("shadow", "shadow.__main__"),
)


def modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    dotted = os.path.relpath(os.path.join(directory, name), ROOT)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = os.path.join(directory, name)
    return found


def layer(module: str) -> int:
    if module in LAYERS[-1]:
        return len(LAYERS) - 1
    for rank, prefixes in enumerate(LAYERS[:-1]):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def imports(known: dict[str, str]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, imported name or '')}, relative imports resolved; ``from pkg import sub``
    is an import of pkg.sub when sub is a module (the parent package's __init__ runs first in any case)."""

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[tuple[str, str]]] = {}
    for module, path in known.items():
        found: set[tuple[str, str]] = set()
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {(owner(alias.name), "") for alias in node.names if owner(alias.name)}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in known:
                        found.add((full, ""))
                    elif owner(base):
                        found.add((owner(base), alias.name))
        edges[module] = {(target, name) for target, name in found if target != module}
    return edges


def cycles(edges: dict[str, set[tuple[str, str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph = {module: {target for target, _ in targets} for module, targets in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle():
    assert cycles(imports(modules())) == []


def test_imports_point_down_and_use_public_names_only():
    problems = []
    for module, targets in sorted(imports(modules()).items()):
        for target, name in sorted(targets):
            if layer(target) > layer(module):
                problems.append(f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
            private = [p for p in [*target.split("."), name] if p.startswith("_") and not p.startswith("__")]
            if layer(target) < layer(module) and private:
                problems.append(f"{module} imports {target} {name}: private to a lower layer")
    assert problems == []


def test_the_walk_sees_imports_inside_functions_and_finds_a_cycle(tmp_path):
    """The checker itself: a cycle through an import inside a function, and an upward import, are found."""
    (tmp_path / "shadow" / "core").mkdir(parents=True)
    (tmp_path / "shadow" / "launcher").mkdir()
    for package in ("shadow", "shadow/core", "shadow/launcher"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "shadow" / "core" / "engine.py").write_text("def f():\n    from shadow.launcher import cli\n")
    (tmp_path / "shadow" / "launcher" / "cli.py").write_text("from shadow.core import engine\n")
    known = {
        "shadow.core.engine": str(tmp_path / "shadow/core/engine.py"),
        "shadow.launcher.cli": str(tmp_path / "shadow/launcher/cli.py"),
    }
    edges = imports(known)
    assert edges["shadow.core.engine"] == {("shadow.launcher.cli", "")}
    assert cycles(edges) == [["shadow.core.engine", "shadow.launcher.cli"]]
    assert layer("shadow.core.engine") < layer("shadow.launcher.cli")


def test_the_core_is_its_sub_packages_each_saying_in_one_line_what_it_holds():
    core = os.path.join(ROOT, "shadow", "core")
    loose = sorted(n for n in os.listdir(core) if n.endswith(".py") and n != "__init__.py")
    assert loose == [], f"modules outside the core's sub-packages: {loose}"
    packages = sorted(n for n in os.listdir(core) if os.path.isfile(os.path.join(core, n, "__init__.py")))
    assert packages == sorted(
        p[0].rpartition(".")[2] for p in LAYERS if p[0].startswith("shadow.core.") and p[0].count(".") == 2
    )
    calls = os.path.join(core, "calls")
    families = sorted(n for n in os.listdir(calls) if os.path.isfile(os.path.join(calls, n, "__init__.py")))
    assert families == sorted(p[0].rpartition(".")[2] for p in LAYERS if p[0].startswith("shadow.core.calls."))
    for package in [*packages, *(f"calls/{family}" for family in families)]:
        with open(os.path.join(core, package, "__init__.py"), encoding="utf-8") as file:
            doc = ast.get_docstring(ast.parse(file.read()))
        assert doc and "\n" not in doc, f"shadow.core.{package} needs a one-line docstring"


def test_no_class_is_over_250_lines_and_at_most_five_functions_over_60():
    """Rooms a next engineer can live in: no class in the product (shadow/, exporters/, the pytest plugin, the
    dashboards) over 250 lines, at most five functions in shadow/ over 60 (the reference copy of torch_npu's code
    aside), counted on the syntax tree."""
    classes, functions = [], []
    for directory, _, files in (walk for package in PACKAGES for walk in os.walk(os.path.join(ROOT, package))):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as file:
                tree = ast.parse(file.read(), path)
            for node in ast.walk(tree):
                size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                where = f"{os.path.relpath(path, ROOT)}:{getattr(node, 'name', '')} ({size} lines)"
                if isinstance(node, ast.ClassDef) and size > 250:
                    classes.append(where)
                elif (
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and size > 60
                    and os.path.relpath(path, ROOT).startswith("shadow" + os.sep)
                    and not path.endswith(os.path.join("npu", "reference.py"))
                ):
                    functions.append(where)
    assert classes == []
    assert len(functions) <= 5, functions


def test_one_sampled_call_stays_in_few_files():
    """The path of one sampled ``x.type(torch.float16)`` on the caller's thread, followed as the design review
    followed it (benchmarks/call_path.py: every call into the project's files): at most 20 files, and at most 30
    moves back to a file already left (it was 28 files and 62 such moves before the call path's families)."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import call_path

    path = call_path.tensor_type()
    assert len(path.files) <= 20 and path.returns <= 30, path.line("sampled .type()")
    assert "shadow/core/calls/sampled/call.py" in path.files  # (the walk saw the sampled call)
