"""Scaling out on PyTorch's own engine (docs/distributed.md).

    mesh           ``ParallelDims(dp, ep)`` and ``build_mesh``: the ``(dp, ep)`` DeviceMesh
    apply          ``parallelize(model, mesh)``: expert parallelism (experts as DTensors on the ep dim, our
                   token dispatcher) and FSDP2 for everything, applied from outside to any model
    meta_init      ``build_on_meta(fn, seed=)`` then ``materialize(model, device)``: build on the meta device,
                   parallelize, and write only this rank's shards, with the eager build's exact values
    runtime        ``MeshRuntime``: what ``mode.train.Trainer`` needs from a mesh (``mode.train.runtime.Runtime``)
    checkpoint     sharded checkpoints through DCP: save on any layout, load on any other, one-file export
    dcp_safe       DCP metadata read without running code from the folder
    ep_model       the plain-tensor expert sharding of one layer (``shard_layer``, ``shard_model``)
    process_group  ``init_distributed``, timeouts, ``CollectiveError`` and the guard around collectives
    elastic        torchrun restarts: each attempt's process groups meet under keys of their own
    stats_reduce   a ``RoutingAccumulator`` summed over the ranks of a group
    command        ``mode train``: the torchrun-ready training command

``mode.train`` never imports this package; it defines two extension points that ``register`` fills (the
package ``mode`` calls it as soon as ``mode.train`` is imported): the runtime behind ``Trainer(mesh=...)`` and
the reader of sharded checkpoint folders behind ``mode.train.checkpoint.load_checkpoint``. Importing
``mode.parallel`` imports no torch (``mode train --help`` builds its parser from ``command``); the names below
and both extension points load ``torch.distributed`` on first use.
"""

from __future__ import annotations

_LAZY = {
    "ParallelDims": "mode.parallel.mesh",
    "build_mesh": "mode.parallel.mesh",
    "parallelize": "mode.parallel.apply",
    "MeshRuntime": "mode.parallel.runtime",
    "clip_grad_norm_": "mode.parallel.runtime",
    "init_distributed": "mode.parallel.process_group",
    "collective_guard": "mode.parallel.process_group",
    "CollectiveError": "mode.parallel.process_group",
    "build_on_meta": "mode.parallel.meta_init",
    "materialize": "mode.parallel.meta_init",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mode.parallel' has no attribute {name!r}")


def _mesh_runtime(mesh, timeout_s: float | None):
    from mode.parallel.runtime import MeshRuntime  # torch.distributed only for a mesh

    return MeshRuntime(mesh, timeout_s)


def _read_sharded(path, training: bool = False) -> dict:
    from mode.parallel.checkpoint import read_sharded  # torch.distributed only for sharded folders

    return read_sharded(path, training=training)


def register() -> None:
    """Plug this package into ``mode.train``'s extension points (idempotent)."""
    from mode.train.checkpoint import register_folder_reader
    from mode.train.runtime import register_mesh_runtime

    register_mesh_runtime(_mesh_runtime)
    register_folder_reader(_read_sharded)
