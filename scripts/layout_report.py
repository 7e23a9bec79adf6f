"""How readable the layout is, in figures: README lines, the longest functions, the largest gptlite modules, the
gptlite modules in import cycles (imports inside functions included, `if TYPE_CHECKING:` left out), the files that
import a command-line parser library, and the test count.

    python scripts/layout_report.py [--no-tests]      # from the repository root
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARSER_LIBRARIES = {"argparse", "optparse", "click", "typer", "docopt", "fire"}
SKIP = {".venv", ".git", "build", "wandb"}


def python_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def function_lengths(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(lines, name, first line) of every function and method, nested ones included."""
    return [
        (node.end_lineno - node.lineno + 1, node.name, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every module an import statement anywhere in the tree names, outside `if TYPE_CHECKING:` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """gptlite module -> the gptlite modules it imports, with the packages they sit in (importing a submodule runs
    its package's __init__ first). `gptlite` itself, whose names load lazily, is left out."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            parts = imported.split(".")
            for i in range(2, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in modules and candidate != name and not name.startswith(candidate + "."):
                    targets.add(candidate)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            connect(v)
    return out


def test_count() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT, capture_output=True, text=True
    )
    lines = [line for line in out.stdout.splitlines() if "tests collected" in line or "test collected" in line]
    return lines[-1].split(" in ")[0] if lines else "unknown (pytest --collect-only failed)"


def main(argv: list[str]) -> int:
    files = python_files()
    trees = {p: ast.parse(p.read_text()) for p in files}
    print(f"README.md: {len((ROOT / 'README.md').read_text().splitlines())} lines")
    longest = sorted(
        (
            (n, f"{p.relative_to(ROOT)}:{line} {name}")
            for p, t in trees.items()
            for n, name, line in function_lengths(t)
        ),
        reverse=True,
    )
    print(f"functions over 80 lines: {sum(n > 80 for n, _ in longest)}; the longest:")
    for n, where in longest[:5]:
        print(f"  {n:4d}  {where}")
    package = {module_name(p): p for p in files if p.relative_to(ROOT).parts[0] == "gptlite"}
    sizes = sorted(((len(p.read_text().splitlines()), name) for name, p in package.items()), reverse=True)
    print(f"gptlite modules over 500 lines: {sum(n > 500 for n, _ in sizes)}; the largest:")
    for n, name in sizes[:5]:
        print(f"  {n:4d}  {name}")
    found = cycles(import_graph({k: v for k, v in package.items() if k != "gptlite"}))
    print(
        f"gptlite modules in import cycles: {sum(map(len, found))}" + "".join(f"\n  {' <-> '.join(c)}" for c in found)
    )
    parsers = [
        str(p.relative_to(ROOT))
        for p, t in trees.items()
        if {m.split(".")[0] for m in imported_modules(t, module_name(p), p.name == "__init__.py")} & PARSER_LIBRARIES
    ]
    print(f"files importing a command-line parser library: {len(parsers)} ({', '.join(parsers) or 'none'})")
    if "--no-tests" not in argv:
        print(f"tests: {test_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
