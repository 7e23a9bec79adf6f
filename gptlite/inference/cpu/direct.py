"""The modules of the CPU decode view called as plain functions: each module the view makes (a linear kernel, a one-call
wrapper) or copies from the model is an instance of a subclass of its class whose `__call__` is its `forward`
(nn.Module's call looks for hooks to run first), with its submodules and parameters as plain attributes of it
(nn.Module finds them in Python, through `__getattr__`, at every access). A decode step makes a few hundred such calls
and accesses, and the first after each matrix runs with the caches full of weights: together a few per cent of a GPT-2
step on the Intel Xeon (docs/generation.md).

The view is built so from the start (`made`, `copied`): no module ever changes its class, and the model's own modules
are never touched. Buffers stay nn.Module's (a module may replace one, as a position table grows, which the view would
not see), and a module with hooks, its own or every module's, keeps nn.Module's call, so that they run (the view is made
again when hooks are added or removed: `hook_state`).
"""

from __future__ import annotations

from functools import cache

import torch.nn as nn
from torch.nn.modules import module as torch_module


def made(cls: type[nn.Module], *args: object) -> nn.Module:
    """`cls(*args)`, one of the view's own modules, called directly unless hooks registered for every module must run
    around it."""
    if global_hook_count():
        return cls(*args)
    return with_plain_attributes(direct_class(cls)(*args))


def copied(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A copy of the model's `module` for the view: the same parameters, buffers, settings and hooks (its attributes,
    shared as copy.copy shares them), `children` as its submodules, called directly unless a hook waits on it, its
    own or every module's."""
    direct = not (hook_count(module) or global_hook_count())
    cls = direct_class(type(module)) if direct else type(module)
    copy = cls.__new__(cls)
    copy.__dict__.update(module.__dict__)
    copy._modules = children
    return with_plain_attributes(copy) if direct else copy


def with_plain_attributes(module: nn.Module) -> nn.Module:
    """`module` with its submodules and parameters also in its own __dict__, where Python finds them first."""
    module.__dict__.update(module._modules)
    module.__dict__.update(module._parameters)
    return module


def hook_count(module: nn.Module) -> int:
    """The hooks nn.Module's call runs around `module`'s forward (a copy shares the model's module's)."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    return sum(len(table) for table in hooks)


def global_hook_count() -> int:
    """The hooks registered to run around every module's forward (torch.nn.modules.module's)."""
    return len(torch_module._global_forward_hooks) + len(torch_module._global_forward_pre_hooks)


def hook_state(model: nn.Module) -> tuple[int, ...]:
    """Where hooks are registered, for the kept view to be made again when that changes."""
    return (global_hook_count(), *(hook_count(m) for m in model.modules()))


@cache
def direct_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` under its own name, called straight through to its forward."""
    return type(cls.__name__, (cls,), {"__call__": cls.forward, "__module__": cls.__module__})
