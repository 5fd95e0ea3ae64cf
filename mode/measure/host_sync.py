"""Count the operations that would block the host on a GPU, by running the code on any device (CPU too).

A CUDA program stays fast while the host only *queues* kernels. These operations make the host wait for
the device (or copy host data to it inside the step) and so stall the queue:

    scalar read         ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``  (``aten._local_scalar_dense``)
    list read           ``t.tolist()``  (a device-to-host copy; invisible to the dispatcher on CPU, so it is
                        counted by patching ``Tensor.tolist`` while the counter is active)
    data-dependent shape ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
                        ``repeat_interleave`` without ``output_size``
    host data           ``torch.tensor(host_values)``, ``t[idx] = 1.0``  (``aten.lift_fresh``: a blocking
                        host-to-device copy on a GPU)

Usage::

    with HostSyncCounter() as syncs:
        loss = layer(x)[0].sum(); loss.backward()
    assert syncs.count == 0, syncs.events

The counter sees what runs under it (forward and backward, including autograd's own ops); it does not
see work inside ``torch.compile``-d graphs, which is traced rather than run op by op.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ALWAYS = {
    aten._local_scalar_dense.default: "scalar read",
    aten.nonzero.default: "data-dependent shape (nonzero)",
    aten.nonzero_static.default: None,  # static size: no sync (listed so it is never mistaken for one)
    aten.masked_select.default: "data-dependent shape (masked_select)",
    aten.lift_fresh.default: "host data copied to the device",
    aten._unique2.default: "data-dependent shape (unique)",
    aten.unique_consecutive.default: "data-dependent shape (unique)",
    aten.unique_dim.default: "data-dependent shape (unique)",
}


def _reason(func, args, kwargs) -> str | None:
    if func in _ALWAYS:
        return _ALWAYS[func]
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "data-dependent shape (boolean-mask indexing)"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and len(args) < 2:
        return "data-dependent shape (repeat_interleave without output_size)"
    if func is aten.repeat_interleave.self_Tensor and kwargs.get("output_size") is None:
        return "data-dependent shape (repeat_interleave without output_size)"
    return None


class HostSyncCounter(TorchDispatchMode):
    """Context manager: ``count`` host synchronisations, ``events`` one ``(op, reason)`` per sync,
    ``by_reason`` a ``Counter`` of reasons."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._tolist = None

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def by_reason(self) -> Counter:
        return Counter(reason for _, reason in self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None:
            self.events.append((str(func), reason))
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self
        self._tolist = original = torch.Tensor.tolist

        def tolist(t):
            counter.events.append(("Tensor.tolist", "list read"))
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
