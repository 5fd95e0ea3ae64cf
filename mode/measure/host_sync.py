"""Count the operations that would block the host on a GPU, by running the code on any device (CPU too);
and, on a GPU, the synchronisations that really happen.

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

**What HostSyncCounter counts are would-be syncs, not measurements.** It matches operator names at the
Python dispatch level, on any device, so it is the CPU-side budget check, and it can be wrong both ways:
    * it misses syncs made inside an operator: ``torch._grouped_mm``'s CUDA fallback (every dtype but
      bfloat16, and GPUs other than sm90/sm100) copies the offsets to the host; ``torch.equal`` on CUDA
      reads its result with ``.item()`` inside the op;
    * it misses blocking copies (``aten._to_copy``/``copy_`` are not in its list): ``.cpu()``, and a
      ``.to("cuda")`` of pageable host memory without ``non_blocking=True`` (a ``cudaStreamSynchronize``);
    * it counts ``.tolist()`` and scalar reads of CPU tensors, which cost nothing.

``CudaSyncCounter`` is the ground truth on a GPU: it turns on CUDA's own sync debug mode
(``torch.cuda.set_sync_debug_mode``), in which every synchronising CUDA call that torch makes (stream and
device synchronisation, blocking copies, scalar reads, ``nonzero``, inside operators too) reports itself::

    with CudaSyncCounter() as syncs:          # needs a CUDA device
        decode_step(model, tokens_B, positions_B, caches)
    assert syncs.count == 0, syncs.events     # [(where, message), ...]

torch calls the debug mode a prototype that "does not yet detect all synchronizing operations" (e.g. a
sync in a third-party extension's own CUDA code); it does see every path torch itself syncs on.
"""

from __future__ import annotations

import warnings
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
    """Context manager: ``count`` would-be host synchronisations (module doc: what it sees and misses),
    ``events`` one ``(op, reason)`` per sync, ``by_reason`` a ``Counter`` of reasons. On a GPU,
    ``CudaSyncCounter`` counts the real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._tolist = None
        self._in_tolist = False

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
            # Under a TorchFunctionMode (torch.set_default_device installs one) the C method hands the call to
            # the mode, which calls Tensor.tolist, this patch, again: count the outer call only.
            if counter._in_tolist:
                return original(t)
            counter.events.append(("Tensor.tolist", "list read"))
            counter._in_tolist = True
            try:
                return original(t)
            finally:
                counter._in_tolist = False

        torch.Tensor.tolist = tolist  # pyright: ignore[reportAttributeAccessIssue] - patched on purpose, restored below
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # pyright: ignore[reportAttributeAccessIssue] - restores the original
        return super().__exit__(*exc)


SYNC_MESSAGE = "synchronizing cuda operation"  # c10: "called a synchronizing CUDA operation" (compared lower-cased)
_PROTOTYPE_NOTICE = "synchronization debug mode is a prototype"  # set_sync_debug_mode's own one-time warning


class CudaSyncCounter:
    """Context manager (CUDA only): the synchronising CUDA operations that really run inside it, as CUDA's
    sync debug mode reports them (module doc). ``count``; ``events``, one ``(where, message)`` per sync,
    ``where`` the Python ``file:line`` that made it. ``error=True`` raises ``RuntimeError`` at the first sync
    instead (its traceback names the call). Syncs in the backward count too: autograd replays the warnings of
    its device threads on the calling thread. The previous debug mode is restored on exit, and warnings
    other than the sync reports are re-issued."""

    def __init__(self, error: bool = False):
        if not isinstance(error, bool):
            raise TypeError(f"error={error!r}: must be a bool")
        self.mode = "error" if error else "warn"
        self.events: list[tuple[str, str]] = []
        self._catch = None
        self._previous = None

    @property
    def count(self) -> int:
        return len(self.events)

    def __enter__(self) -> CudaSyncCounter:
        if not torch.cuda.is_available():
            raise ValueError(
                "CudaSyncCounter: torch.cuda.is_available() is False here; it counts the syncs CUDA "
                "reports, so it needs a CUDA device (on the CPU, HostSyncCounter counts would-be syncs)"
            )
        self.events = []
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")  # every sync, even many from one line
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def __exit__(self, *exc) -> None:
        assert self._catch is not None and self._previous is not None, "CudaSyncCounter: __exit__ follows __enter__"
        torch.cuda.set_sync_debug_mode(self._previous)
        records = list(self._records)
        self._catch.__exit__(*exc)
        for w in records:
            text = str(w.message)
            if SYNC_MESSAGE in text.lower():
                self.events.append((f"{w.filename}:{w.lineno}", text))
            elif _PROTOTYPE_NOTICE not in text.lower():
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
