"""Plain (non-tensor, non-module) attributes set on an ``nn.Module``.

``nn.Module.__setattr__`` is typed for a ``Tensor | Module`` value, so the type checker flags every
``module.flag = True`` or ``model.mode_conversion = {...}``, though torch accepts any value there (a plain one
lands in the instance ``__dict__``, after the same checks against ``_parameters``, ``_modules`` and
``_buffers``). :func:`set_module_attr` is that same assignment, through ``setattr``: the module's own
``__setattr__`` runs, so the behaviour is the statement's, only untyped for the checker.
"""

from __future__ import annotations

from torch import nn


def set_module_attr(module: nn.Module, name: str, value: object) -> None:
    """``module.<name> = value``, exactly (``module.__setattr__`` runs), for a value ``nn.Module.__setattr__``'s
    annotation leaves out: a bool, an int, a dict, a hook handle, a callable."""
    setattr(module, name, value)
