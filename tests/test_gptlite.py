"""Imports go one way: the graph of gptlite's modules, read from their source with `ast`, has no circle.

Every import counts wherever it stands (at the top, under TYPE_CHECKING, inside a function). The file that defines the
network imports none of the model's consumers: GPT's conveniences (from_pretrained, generate, quantize) live in
gptlite.gpt, above them all.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gptlite"
NETWORK = PACKAGE / "model" / "network.py"
# what the network's file may not import: the model's consumers (generation and the CPU kernels, interop,
# quantization) and the class that composes them onto the network
CONSUMERS = ("gptlite.inference", "gptlite.hf", "gptlite.gpt")


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
    """Each module of the package -> the package's modules it imports anywhere in its source."""
    files = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(imported(node, name, path.name == "__init__.py", set(files)))
        graph[name] = {target for target in edges if target != name}
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


def test_the_graph_holds_every_import_of_the_package():
    graph = import_graph()
    assert "gptlite.config" in graph["gptlite.model.network"]
    assert "gptlite.model.network" in graph["gptlite.inference.generate"]
    assert {"gptlite.hf", "gptlite.inference.generate", "gptlite.inference.quantize"} <= graph["gptlite.gpt"]
    assert "gptlite.evaluate.lm_harness" in graph["gptlite.evaluate.command"]  # inside a function


def imported_names(path: Path) -> set[str]:
    """Every module name an import statement of the file names, wherever it stands (at the top, under
    TYPE_CHECKING, inside a function or method): `import a.b` names a.b, `from a.b import c` names a.b and a.b.c."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def consumers_imported(path: Path) -> set[str]:
    """The modules among CONSUMERS (or inside them) that the file imports."""
    return {name for name in imported_names(path) if any(name == c or name.startswith(c + ".") for c in CONSUMERS)}


def test_the_network_knows_no_consumer():
    """gptlite/model/network.py imports nothing from generation, interop, quantization, the kernels or gptlite.gpt,
    not even inside a method; the public class keeps its conveniences."""
    from gptlite import GPT
    from gptlite.model.network import Transformer

    imported = consumers_imported(NETWORK)
    assert imported == set(), imported
    assert issubclass(GPT, Transformer) and GPT.__module__ == "gptlite.gpt"
    assert all(callable(getattr(GPT, name)) for name in ("from_pretrained", "generate", "quantize"))
    assert not any(hasattr(Transformer, name) for name in ("from_pretrained", "generate", "quantize"))


def test_consumers_imported_sees_every_kind_of_import(tmp_path):
    """The check above reads an import inside a method, under TYPE_CHECKING and of a package's module by name."""
    network = tmp_path / "network.py"
    network.write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from gptlite.config import GPTConfig\n"
        "if TYPE_CHECKING:\n"
        "    from gptlite.gpt import GPT\n"
        "class Net:\n"
        "    def generate(self):\n"
        "        from gptlite.inference.generate import generate\n"
        "    def load(self):\n"
        "        import gptlite.hf.pretrained\n"
        "    def kernels(self):\n"
        "        from gptlite.inference.cpu import native\n"
    )
    assert consumers_imported(network) == {
        "gptlite.gpt",
        "gptlite.gpt.GPT",
        "gptlite.inference.generate",
        "gptlite.inference.generate.generate",
        "gptlite.hf.pretrained",
        "gptlite.inference.cpu",
        "gptlite.inference.cpu.native",
    }


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
