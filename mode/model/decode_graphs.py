"""Static-cache decode steps replayed from CUDA graphs (``generate(..., cuda_graphs=True)``).

Shape legend: B batch (sequences), V vocabulary.

A static decode step (``mode.layers.kv_cache``, static caches) makes no host sync and has shapes fixed by
each layer's attended width, which changes only every ``width_bucket`` tokens. So one step can be captured
once per width (``torch.cuda.CUDAGraph``) and replayed: a replay launches the whole step, every layer, as one
graph, where the eager step launches each kernel from Python.

What a replay does not do is run Python: the host half of a static step (each cache's ``advance_static``:
the room check and the ``bound`` count) is run here before every replay, exactly as the eager step runs it
inside ``decode_all``. The capture itself runs the step's Python once (that host half included) and records
its kernels without executing them, so the captured step is then replayed for its own token.

Per width key (the tuple of every cache's ``static_step_width()``) the first step runs eagerly (warm-up:
lazy initialisation in cuBLAS and the attention kernels happens outside the capture), the second is
captured and replayed, and every later step of that width is a replay. When a width grows, the old graph
is dropped (widths only grow) and its memory returns to the allocator.

Inputs and output live at fixed addresses: the tokens and positions are copied into the graph's input
buffers before each replay, and the logits returned are the graph's output buffer, overwritten by the next
replay (``generate`` samples from them before the next step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from mode.layers.kv_cache import KVCache


def check_cuda_graphs(device: torch.device, what: str) -> None:
    """CUDA graphs need a CUDA device: a ValueError that says so everywhere else."""
    if device.type != "cuda":
        raise ValueError(
            f"{what}=True needs CUDA: the model is on {device}, and CUDA graphs capture CUDA kernels "
            f"(torch.cuda.CUDAGraph); leave {what} False on this device"
        )


class GraphedDecode:
    """``decode_step(model, tokens_B, positions_B, caches)`` for static caches, replayed from CUDA graphs.

    ``step``: the eager step, ``step(tokens_B, positions_B) -> logits_BV`` (``generate`` passes its
    ``decode_step`` under its autocast). Call it like the step; the caches must be static and on CUDA."""

    def __init__(self, step: Callable[[Tensor, Tensor], Tensor], caches: list[KVCache], warmup: int = 1):
        if not caches or not all(isinstance(c, KVCache) and c.static for c in caches):
            raise ValueError(
                "GraphedDecode: needs static KV caches (generate(static_cache=True)): a dynamic "
                "cache reads routing decisions on the host, which a CUDA graph cannot replay"
            )
        check_cuda_graphs(caches[0].len_B.device, "cuda_graphs")
        self.step, self.caches, self.warmup = step, caches, warmup
        self.key: tuple[int, ...] | None = None  # the widths the current graph was captured at
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_left = warmup
        self.tokens_B: Tensor | None = None  # the graph's input buffers (allocated once, outside any graph)
        self.positions_B: Tensor | None = None
        self.logits_BV: Tensor | None = None  # the graph's output buffer
        self.captures = 0  # graphs captured (one per width key reached)
        self.replays = 0

    def __call__(self, tokens_B: Tensor, positions_B: Tensor) -> Tensor:
        key = tuple(c.static_step_width() for c in self.caches)
        if key != self.key:  # a new width: warm up, then capture anew
            self.key, self.graph, self.logits_BV, self.eager_left = key, None, None, self.warmup
        if self.graph is None and self.eager_left > 0:
            self.eager_left -= 1
            return self.step(tokens_B, positions_B)
        if self.tokens_B is None or self.positions_B is None:
            self.tokens_B, self.positions_B = tokens_B.clone(), positions_B.clone()
        self.tokens_B.copy_(tokens_B)
        self.positions_B.copy_(positions_B)
        if self.graph is None:
            self._capture()  # runs the step's host half once, records its kernels (not run yet)
        else:
            for c in self.caches:
                c.advance_static()  # the host half the replay does not run
        assert self.graph is not None and self.logits_BV is not None, "GraphedDecode: set by _capture"
        self.graph.replay()
        self.replays += 1
        return self.logits_BV

    def _capture(self) -> None:
        self.graph = None  # the previous width's graph and its pool go first
        torch.cuda.synchronize()  # the warm-up's (and a previous replay's) work is done before capture begins
        graph = torch.cuda.CUDAGraph()
        assert self.tokens_B is not None and self.positions_B is not None, "allocated by __call__ before a capture"
        with torch.cuda.graph(graph):
            self.logits_BV = self.step(self.tokens_B, self.positions_B)
        self.graph = graph
        self.captures += 1


def autocast_step(
    model, caches: list[KVCache], autocast: Callable[[], contextlib.AbstractContextManager], decode_step: Callable
) -> Callable[[Tensor, Tensor], Tensor]:
    """The eager decode step ``GraphedDecode`` captures: ``decode_step`` under ``autocast``."""

    def step(tokens_B: Tensor, positions_B: Tensor) -> Tensor:
        with autocast():
            return decode_step(model, tokens_B, positions_B, caches)

    return step
