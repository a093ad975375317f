"""The folders show the architecture: the measuring tools (dgrad.measure) may import the
engine and the training command, and neither imports them; no module of the engine
imports another that imports it back."""

import ast
import pathlib

from helpers import ROOT

PACKAGE = ROOT / "dgrad"


def imported_by(path: pathlib.Path) -> set[str]:
    """The dgrad modules `path` imports anywhere in it (functions and TYPE_CHECKING too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "dgrad" or name.startswith("dgrad.")}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    return {module_name(p): imported_by(p) for p in PACKAGE.rglob("*.py")}


def test_neither_the_engine_nor_the_training_command_imports_the_measuring_tools():
    found = {
        name: sorted(i for i in imports if i.startswith("dgrad.measure"))
        for name, imports in modules().items()
        if not name.startswith("dgrad.measure")
    }
    assert {name: tools for name, tools in found.items() if tools} == {}


def mutual(graph: dict[str, set[str]], names: set[str]) -> set[tuple[str, str]]:
    """The pairs of `names` that import each other in `graph`."""
    return {
        tuple(sorted((a, b)))
        for a in names
        for b in graph[a] & names
        if a != b and a in graph.get(b, ())
    }


def test_no_two_engine_modules_import_each_other():
    graph = modules()
    engine = {name for name in graph if name.count(".") == 1 and name != "dgrad.measure"}
    assert mutual(graph, engine) == set()


def test_the_checks_can_fail(tmp_path):
    """Control: a module importing a tool inside a function, and two modules importing each
    other (one only for typing), are found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from dgrad.measure import timing\n")
    assert "dgrad.measure" in imported_by(module)
    graph = {
        "dgrad.pipeline": {"dgrad.probe", "dgrad.schedule"},
        "dgrad.probe": {"dgrad.pipeline"},
        "dgrad.schedule": set(),
    }
    assert mutual(graph, set(graph)) == {("dgrad.pipeline", "dgrad.probe")}
