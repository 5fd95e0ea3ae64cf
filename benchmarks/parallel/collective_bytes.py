"""Count what a process sends through ``torch.distributed`` collectives, by kind and training phase.

    with CollectiveBytes(phase="forward") as counter:
        loss = model(x); counter.phase = "backward"; loss.backward(); counter.phase = "optimizer"; opt.step()
    counter.table()   # {(phase, kind): {"calls": n, "bytes": sent}}

Two ways collectives happen, both counted:
    * eager calls (``dist.all_to_all_single``, ``dist.all_gather_single`` / ``_into_tensor``,
      ``dist.reduce_scatter_single`` / ``_tensor``, ``dist.all_reduce``, ``dist.broadcast``, ``dist.all_gather``,
      ``dist.reduce_scatter``): FSDP2, our
      expert-parallel dispatch, process-group helpers. The module's attributes are wrapped while inside.
    * functional collectives (``torch.ops._c10d_functional.*``: DTensor redistributions, tensor parallelism):
      a ``TorchDispatchMode`` sees each op with its tensors.
Bytes are what *this* rank sends on the wire under the standard algorithms, W = the group's size:
    all_reduce      2 (W-1)/W x nbytes (ring)          all_gather      (W-1)/W x output nbytes
    reduce_scatter  (W-1)/W x input nbytes              all_to_all      the input rows bound for other ranks
    broadcast       nbytes x (W-1) on the root (flat), 0 elsewhere
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

_EAGER = (
    "all_to_all_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_gather_single",
    "reduce_scatter_single",
)


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _a2a_bytes(inp, in_splits, W: int, me: int) -> int:
    n = inp.shape[0] if inp.dim() else 0
    row = _nbytes(inp) // max(n, 1) if n else 0
    if not in_splits:
        return _nbytes(inp) * (W - 1) // W
    return (sum(in_splits) - in_splits[me]) * row


class CollectiveBytes(TorchDispatchMode):
    def __init__(self, phase: str = "forward"):
        super().__init__()
        self.phase = phase
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.shapes: dict[tuple[str, str], set] = defaultdict(set)
        self._saved: dict[str, object] = {}

    def _add(self, kind: str, nbytes: int, shape=None) -> None:
        key = (self.phase, kind)
        self.calls[key] += 1
        self.bytes[key] += int(nbytes)
        if shape is not None and len(self.shapes[key]) < 8:
            self.shapes[key].add(tuple(shape))

    # -- eager ---------------------------------------------------------------------------------------------
    def _wrap(self, name: str, fn):
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            a = sig.bind(*args, **kwargs).arguments
            group = a.get("group")
            W = _size(group)
            if name == "all_to_all_single":
                inp = a["input"]
                self._add("all_to_all", _a2a_bytes(inp, a.get("input_split_sizes"), W, _rank(group)), inp.shape)
            elif name in ("all_gather_into_tensor", "all_gather_single"):  # FSDP2 calls the latter
                out = a["output_tensor"]
                self._add("all_gather", _nbytes(out) * (W - 1) // W, out.shape)
            elif name in ("reduce_scatter_tensor", "reduce_scatter_single"):
                inp = a["input"]
                self._add("reduce_scatter", _nbytes(inp) * (W - 1) // W, inp.shape)
            elif name == "all_reduce":
                t = a["tensor"]
                self._add("all_reduce", 2 * _nbytes(t) * (W - 1) // W, t.shape)
            elif name == "broadcast":
                t = a["tensor"]
                self._add("broadcast", _nbytes(t) * (W - 1) if dist.get_rank() == a.get("src", 0) else 0, t.shape)
            elif name == "all_gather":
                t = a["tensor"]
                self._add("all_gather", _nbytes(t) * (W - 1), t.shape)
            elif name == "reduce_scatter":
                self._add("reduce_scatter", sum(_nbytes(t) for t in a["input_list"]) * (W - 1) // W)
            return fn(*args, **kwargs)

        return counted

    # -- functional (dispatcher ops) -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional":
            op, x = func._schema.name.split("::")[1], args[0]
            group = _resolve_process_group(args[-1]) if isinstance(args[-1], str) else None
            W = group.size() if group is not None else dist.get_world_size()
            if op == "all_reduce":
                self._add("all_reduce", 2 * _nbytes(x) * (W - 1) // W, x.shape)
            elif op == "all_gather_into_tensor":
                self._add("all_gather", _nbytes(x) * (W - 1), x.shape)
            elif op == "reduce_scatter_tensor":
                self._add("reduce_scatter", _nbytes(x) * (W - 1) // W, x.shape)
            elif op == "all_to_all_single":
                me = group.rank() if group is not None else dist.get_rank()
                self._add("all_to_all", _a2a_bytes(x, args[2], W, me), x.shape)
            elif op == "broadcast":
                self._add("broadcast", _nbytes(x) * (W - 1) if dist.get_rank() == args[1] else 0, x.shape)
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _EAGER:
            fn = getattr(dist, name)
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return super().__exit__(*exc)

    def table(self) -> dict:
        return {
            f"{phase}/{kind}": {
                "calls": self.calls[(phase, kind)],
                "bytes": self.bytes[(phase, kind)],
                "shapes": sorted(self.shapes[(phase, kind)]),
            }
            for phase, kind in sorted(self.calls)
        }

    def total(self, phase: str | None = None, kind: str | None = None) -> int:
        return sum(
            v for (p, k), v in self.bytes.items() if (phase is None or p == phase) and (kind is None or k == kind)
        )
