"""Count the operators a piece of code launches: the CPU-side proxy for GPU kernel launches.

On a GPU a small layer is host-bound when the host spends longer queueing kernels than the device spends
running them; what the host queues is, to first order, one kernel per top-level operator. ``OpCounter`` is a
``TorchDispatchMode``: it sees every operator that reaches the dispatcher's Python key (below autograd and
autocast, so a backward's operators and autocast's casts are seen too, and composite operators are seen as
the operators they decompose into), on any device, the CPU included.

What is counted, and what is not:
    * views (``func.is_view``: view, reshape of a contiguous tensor, transpose, slice, expand, detach, ...) and
      ``_unsafe_view``: metadata only, no kernel;
    * allocations (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``, ``new_empty_strided``): no
      kernel on a GPU (``zeros`` is an allocation and a fill: counted);
    * a custom operator (``mode::grouped_mm``, ...) counts once: the operators inside it run with the mode off
      (a custom op is opaque to ``torch.compile`` too, and a fused kernel would be one launch);
    * everything else counts once per call.

Usage::

    with OpCounter() as ops:
        y, aux = layer(x)
        torch.autograd.backward([y, aux.total()], [dy, one])
    print(ops.count, ops.by_name.most_common(10))

The count is a proxy, not a measurement: one operator may launch several kernels on a GPU (a ``sort`` of
many elements, a ``_grouped_mm`` fallback loop) or none (an operator on a CPU scalar), and a
``torch.compile``-d region runs as fused kernels, which this mode does not see.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

NOT_LAUNCHES = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten._unsafe_view.default,
    }
)


def launches(func) -> bool:
    """Whether ``func`` (an ``OpOverload``) counts as a launch: not a view, not a bare allocation."""
    return not func.is_view and func not in NOT_LAUNCHES


class OpCounter(TorchDispatchMode):
    """Counts the operators that run under it (see the module docstring); ``count`` is the total, ``by_name``
    a ``collections.Counter`` of operator names (``aten.mm.default``, ``mode.grouped_mm.default``), and
    ``events`` the names in the order they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.events: list[str] = []

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def packets(self) -> list[str]:
        """``events`` without the overload (``mode_kernels.router``), in the order they ran."""
        return [e.rsplit(".", 1)[0] for e in self.events]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches(func):
            name = str(func)
            self.by_name[name] += 1
            self.events.append(name)
        return func(*args, **(kwargs or {}))
