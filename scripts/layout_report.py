"""How readable the layout is, in figures: README lines, the longest functions, the largest gptlite modules, the
gptlite modules in import cycles (imports inside functions included, `if TYPE_CHECKING:` left out), the files that
import a command-line parser library, the modules directly in gptlite/, the imports that run from a lower layer up
to a higher one (LAYERS), the modules that name the compiled kernels' `torch.ops.gptlite`, the `__class__ =`
assignments in the package, what the network's file imports from gptlite, the test files named after no module,
and the test count.

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
# gptlite's layers, lowest first, each a list of module prefixes; a module sits on the layer of the longest prefix
# that names it or a package above it. An import from a lower layer to a higher one runs against the architecture.
# Below the commands, the layers follow the packages' own imports: the scores of gptlite.evaluate (bits per byte,
# HellaSwag, CORE, spans, lm-eval's model class) build on the network and generation and are what training's
# validation reports; LoRA (gptlite.train) is what interop's PEFT adapters export; the public GPT composes the network
# with generation, interop and quantization; checkpoints rebuild that GPT and hold the training state. A command's
# module (a package's __main__, gptlite.evaluate.command, which `python -m gptlite.evaluate` runs, and
# gptlite.train.run_config, train.py's command line resolved against checkpoints and scaling's --budget recipe, which
# only train.py and the scaling sweep, a command, import) runs its package from outside, so it sits on top with the
# packages that are commands.
LAYERS = [
    ["gptlite.files", "gptlite.extras", "gptlite.device", "gptlite.cli", "gptlite.config"],
    ["gptlite.tokenizer", "gptlite.data"],
    ["gptlite.model"],
    ["gptlite.inference"],
    ["gptlite.evaluate"],
    ["gptlite.train", "gptlite.hf"],
    ["gptlite.gpt"],
    ["gptlite.checkpoint"],
    [
        "gptlite.scaling",
        "gptlite.serve",
        "gptlite.plot",
        "gptlite.evaluate.command",
        "gptlite.train.run_config",
        "__main__",
    ],
]
TOP_LEVEL_TARGET = 12
NETWORK = "gptlite.model.network"
# what the network's file may not import, lazily or not: its consumers (generation and the kernels, interop, the
# public class, training)
NETWORK_CONSUMERS = ["gptlite.inference", "gptlite.hf", "gptlite.gpt", "gptlite.train"]


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


def top_level_modules(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """The modules directly in gptlite/ (besides __init__.py) and its packages, by file and folder name."""
    package = root / "gptlite"
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    return modules, packages


def layer_of(module: str) -> int:
    """The index in LAYERS of the module's layer: its longest prefix's (a command's __main__ on the top layer)."""
    if module.endswith(".__main__"):
        return len(LAYERS) - 1
    best, found = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise ValueError(f"{module} is on no layer of scripts/layout_report.py's LAYERS: add its package there")
    return found


def direct_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without the packages a module reaches only because it imports one of their submodules (`from
    gptlite.inference.cpu import native` names gptlite.inference.cpu.native, not also gptlite.inference)."""
    return {
        name: {t for t in targets if not any(other.startswith(t + ".") for other in targets)}
        for name, targets in graph.items()
    }


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for each import from a lower layer to a higher one, lazy imports included."""
    direct = direct_imports(graph)
    return sorted((a, b) for a, targets in direct.items() for b in targets if layer_of(a) < layer_of(b))


def modules_naming(package: dict[str, Path], text: str) -> list[str]:
    """The modules whose source holds `text` (comments and strings included: a name is a name)."""
    return sorted(name for name, path in package.items() if text in path.read_text())


def class_assignments(package: dict[str, Path]) -> list[str]:
    """`module:line` of every assignment to an object's __class__ in the package."""
    found = []
    for name, path in package.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets
            ):
                found.append(f"{name}:{node.lineno}")
    return sorted(found)


def network_imports(graph: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """What the network's file imports from gptlite (lazy imports included), and which of them are its consumers."""
    imported = sorted(direct_imports(graph).get(NETWORK, set()))
    consumers = [m for m in imported if any(m == c or m.startswith(c + ".") for c in NETWORK_CONSUMERS)]
    return imported, consumers


def test_subject(test: Path, root: Path = ROOT) -> Path | None:
    """What tests/DIRS/test_NAME.py is named after, or None. tests/DIRS mirrors gptlite/DIRS (and DIRS in the
    repository, for its scripts and documents); NAME is a module NAME.py there, a package NAME/ (its tests as a
    whole), `main` for a package's __main__.py, or another file NAME.* there (README.md, chat.html, .gitignore), or
    such a file followed by _ASPECT (test_train_speedrun.py: train.py's speedrun options). A package takes no aspect:
    its modules' tests go in its own folder."""
    relative = test.relative_to(root / "tests")
    folders = relative.parent.parts
    if not relative.name.startswith("test_"):
        return None
    name = relative.stem.removeprefix("test_")
    for base in (root / "gptlite" / Path(*folders), root / Path(*folders)):
        if not base.is_dir():
            continue
        if (base / name / "__init__.py").is_file():
            return base / name
        files = {f.name.lstrip(".").split(".")[0].lower(): f for f in sorted(base.iterdir()) if f.is_file()}
        files.setdefault("main", base / "__main__.py")
        words = name.split("_")
        for end in range(len(words), 0, -1):
            subject = files.get("_".join(words[:end]))
            if subject is not None and subject.exists() and subject.name != "__init__.py":
                return subject
    return None


def test_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "tests").rglob("test_*.py"))


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
    modules, packages = top_level_modules()
    print(f"modules directly in gptlite/: {len(modules)} (target <= {TOP_LEVEL_TARGET}): {', '.join(modules)}")
    print(f"  packages: {', '.join(packages)}")
    graph = import_graph({k: v for k, v in package.items() if k != "gptlite"})
    print("layers, lowest first:" + "".join(f"\n  {i}: {', '.join(prefixes)}" for i, prefixes in enumerate(LAYERS)))
    upward = upward_imports(graph)
    print(
        f"imports from a lower layer up to a higher one: {len(upward)} (target <= 3)"
        + "".join(f"\n  {a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in upward)
    )
    ops = modules_naming({k: v for k, v in package.items() if k != "gptlite"}, "torch.ops.gptlite")
    print(f"modules naming torch.ops.gptlite: {len(ops)} (target 1): {', '.join(ops) or 'none'}")
    assignments = class_assignments(package)
    print(f"__class__ assignments in gptlite: {len(assignments)} (target 0): {', '.join(assignments) or 'none'}")
    imported, consumers = network_imports(graph)
    print(f"{NETWORK} imports from gptlite: {', '.join(imported) or 'nothing'}")
    print(f"  of them its consumers ({', '.join(NETWORK_CONSUMERS)}; target none): {', '.join(consumers) or 'none'}")
    unnamed = [str(p.relative_to(ROOT)) for p in test_files() if test_subject(p) is None]
    print(
        f"test files named after no module: {len(unnamed)} of {len(test_files())} (target 0)"
        + "".join(f"\n  {p}" for p in unnamed)
    )
    if "--no-tests" not in argv:
        print(f"tests: {test_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
