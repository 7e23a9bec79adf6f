"""The optional extras of pyproject.toml (`pip install -e ".[X]"`): a package of one imported where a command needs
it, or, where it is missing, one line naming the extra that installs it (an ImportError: every command prints it
as its one-line error and exits 2, gptlite.cli)."""

from __future__ import annotations

import importlib
from types import ModuleType

# the modules gptlite imports from each extra's packages (pyproject.toml lists the packages and their versions)
EXTRAS = {
    "data": ("pyarrow", "datasets", "huggingface_hub"),
    "serve": ("fastapi", "uvicorn", "llguidance"),
    "eval": ("lm_eval",),
    "gguf": ("gguf",),
    "plot": ("matplotlib",),
    "tensorboard": ("tensorboard",),
}


def missing_extra(extra: str, package: str, what: str) -> ImportError:
    """The one-line error for `what` (a command or a kind of input) without `package`, of the extra `extra`."""
    return ImportError(f'{what} needs the {package} package: pip install -e ".[{extra}]" (or pip install {package})')


def need(module: str, extra: str, what: str) -> ModuleType:
    """`module` (a package of the extra `extra`, or one of its submodules) imported; missing, missing_extra's error.
    A package present whose own import fails for want of another (datasets without pyarrow) names that one."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = (e.name or module).split(".")[0]
        raise missing_extra(extra, package, what) from None


def need_extra(extra: str, what: str) -> None:
    """Every module of the extra imported, so that a command needing all of them (the server) fails at its start,
    in one line, and not at its first request."""
    for module in EXTRAS[extra]:
        need(module, extra, what)
