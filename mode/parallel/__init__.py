"""Scaling out on PyTorch's own engine (docs/distributed.md).

    mesh         ``ParallelDims(dp, ep)`` and ``build_mesh``: the ``(dp, ep)`` DeviceMesh
    apply        ``parallelize(model, mesh)``: expert parallelism (experts as DTensors on the ep dim, our
                 token dispatcher) and FSDP2 for everything, applied from outside to any model
    runtime      what ``mode.train.Trainer`` needs from a mesh (rows, sums, the gradient norm, checkpoints)
    checkpoint   sharded checkpoints through DCP: save on any layout, load on any other, one-file export
    blocks       the FSDP / compile units of a model (no torch.distributed)
    ep_model     the plain-tensor expert sharding of one layer (``shard_layer``, ``shard_model``)
    command      ``mode train``: the torchrun-ready training command

Importing ``mode.parallel`` imports nothing from ``torch.distributed``; the names below load on first use.
"""

from __future__ import annotations

_LAZY = {"ParallelDims": "mode.parallel.mesh", "build_mesh": "mode.parallel.mesh",
         "parallelize": "mode.parallel.apply", "MeshRuntime": "mode.parallel.runtime",
         "clip_grad_norm_": "mode.parallel.runtime"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mode.parallel' has no attribute {name!r}")
