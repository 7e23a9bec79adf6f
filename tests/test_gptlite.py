"""Imports go one way: the graph of gptlite's modules, read from their source with `ast`, has no circle.

Every import counts wherever it stands (at the top, under TYPE_CHECKING, inside a function), except the model's lazy
convenience methods (GPT.from_pretrained, GPT.generate, GPT.quantize), which import generation, Hugging Face and
quantization on first use as Hugging Face's own model classes do.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gptlite"
# (module, imported module): the model's lazy convenience imports, the one circle allowed
LAZY = {
    ("gptlite.model.network", "gptlite.inference.generate"),
    ("gptlite.model.network", "gptlite.hf"),
    ("gptlite.model.network", "gptlite.inference.quantize"),
}


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: set[str]) -> list[str]:
    """The gptlite modules an import statement of module `name` names: `from pkg import sub` names pkg.sub where
    that is a module, else pkg."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:  # a relative import, from the module's own package up
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    targets = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    if len(targets) < len(node.names) and base in modules:
        targets.append(base)
    return targets


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports anywhere in its source, the allowed lazy ones
    left out."""
    files = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(imported(node, name, path.name == "__init__.py", set(files)))
        graph[name] = {target for target in edges if target != name and (name, target) not in LAZY}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None (a depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the search's path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "an import circle: " + " -> ".join(cycle)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The graph reads imports at the top, under TYPE_CHECKING, inside functions and relative ones."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "d", "sub/__init__", "sub/e"):
        (package / f"{name}.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import pkg.b\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.c import C\n"
        "def f():\n"
        "    from pkg import d\n"
        "from .sub import e\n"
    )
    (package / "sub" / "e.py").write_text("from .. import b\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b", "pkg.c", "pkg.d", "pkg.sub.e"}
    assert graph["pkg.sub.e"] == {"pkg.b"}
    assert find_cycle(graph) is None
    (package / "c.py").write_text("def g():\n    import pkg.a\n")
    assert find_cycle(import_graph(package)) == ["pkg.a", "pkg.c", "pkg.a"]


def test_only_the_models_lazy_imports_are_left_out():
    graph = import_graph()
    assert "gptlite.config" in graph["gptlite.model.network"]
    assert "gptlite.inference.generate" not in graph["gptlite.model.network"]  # GPT.generate's lazy import, allowed
    assert "gptlite.model.network" in graph["gptlite.inference.generate"]
    assert "gptlite.evaluate.lm_harness" in graph["gptlite.evaluate.command"]  # inside a function


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
