"""Build on the meta device, shard, then materialize only this rank's shards: no rank ever holds the full model.

    model = build_on_meta(lambda: LM(cfg), seed=0)    # every rank: no memory, the construction recorded
    model = parallelize(model, mesh)                  # experts over ep, FSDP2 shards (still on meta)
    materialize(model, device)                        # to_empty, then each rank writes its own shards

``build_on_meta`` (``mode.model.deferred_init``) records what the construction does; ``materialize`` puts the
model on ``device`` with ``nn.Module.to_empty`` and then, with ``init="replay"`` (the default), replays the
recording on the CPU one tensor at a time: each parameter and buffer gets exactly the value the eager
construction with the same seed would have given it (the same draws from the same generator states), and a
sharded parameter (a DTensor: FSDP2's ``Shard(0)`` over the flat mesh, an expert bank's ``Shard(0)`` over ep
and ``_StridedShard`` over dp) keeps only this rank's piece, cut from the full value with
``distribute_tensor(full, mesh, placements, src_data_rank=None)`` (local slicing, no communication). The
peak is this rank's shards plus one full tensor (plus what the construction itself keeps alive at once:
nothing more for the LM). So ``build_on_meta`` + ``parallelize`` + ``materialize`` starts a run bit for bit
where the eager ``torch.manual_seed(seed); parallelize(build().to(device), mesh)`` starts it, on any mesh,
and the global generator is left where the eager build leaves it (tests/parallel/test_meta_init.py).

``init`` may instead be a callable ``init(model)``, run under ``torch.no_grad()`` after ``to_empty``: your own
initialization of the sharded parameters, or a checkpoint read shard by shard; the buffers get their built
values first (replayed: no draw unless a buffer is random), since checkpoints leave non-persistent ones out
(``lambda m: mode.parallel.model_state.load_state(folder, m)``: DCP reads only this rank's pieces). That is
the way to start a converted transformers model from pretrained weights (docs/distributed.md).

Works for models parallelized with ``mode.parallel.parallelize`` (DTensor parameters) and for plain ones
(one process: the full values). Not for ``mode.parallel.ep_model.shard_model`` (plain-tensor expert
shards do not say which rows they hold): ``MetaInitError`` names the parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp split of the ep-sharded experts

from mode.model.deferred_init import MetaInitError, build_on_meta, is_meta_built, meta_record, replay

__all__ = ["MetaInitError", "build_on_meta", "is_meta_built", "materialize"]


def _resolve_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: must be a torch.device or a name such as 'cpu' or 'cuda'") from None
    if dev.type == "meta":
        raise ValueError("device='meta': materialize moves the model off meta; give the device to train on")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """id(tensor) -> every (module, attribute, is_parameter) that holds it: tied weights have several."""
    owners: dict[int, list] = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, attr, True))
        for attr, b in m._buffers.items():
            if b is not None:
                owners.setdefault(id(b), []).append((m, attr, False))
    return owners


def _retie(groups: list[list[tuple[nn.Module, str, bool]]]) -> None:
    """``to_empty`` gives each module its own new tensor: make the tied ones one tensor again."""
    for group in groups:
        first_m, first_attr, is_param = group[0]
        t = _store(first_m, is_param)[first_attr]
        for m, attr, _ in group[1:]:
            _store(m, is_param)[attr] = t


def _store(m: nn.Module, is_param: bool) -> dict[str, Tensor | None]:
    """``m``'s parameters or buffers (a tied group is of one kind: a parameter goes to parameters only)."""
    return cast(dict[str, Tensor | None], m._parameters if is_param else m._buffers)


def _local_piece(full: Tensor, target: Tensor, name: str) -> Tensor:
    """This rank's piece of the full value: what ``distribute_tensor(full, mesh, placements)`` holds here.
    Placements that split dim 0 only (FSDP2's and the experts'): the rows, found by distributing their indices,
    sliced as a view when contiguous (no copy of the full tensor); others: ``distribute_tensor`` itself."""
    if not isinstance(target, DTensor):
        return full
    mesh, placements = target.device_mesh, target.placements
    if all(isinstance(pl, Replicate) or (isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0) for pl in placements):
        # host indices: distribute_tensor moves them to the mesh's device (CUDA under NCCL), ``full`` is the CPU
        # replay's value; whatever the default device is
        rows = (
            distribute_tensor(torch.arange(full.shape[0], device="cpu"), mesh, placements, src_data_rank=None)
            .to_local()
            .cpu()
        )
        contiguous = rows.numel() == 0 or torch.equal(
            rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel(), device="cpu")
        )
        piece = (
            full.narrow(0, int(rows[0]), rows.numel()) if contiguous and rows.numel() else full.index_select(0, rows)
        )
    else:
        piece = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    local = target.to_local()
    if piece.shape != local.shape:
        raise MetaInitError(
            f"{name}: this rank holds {tuple(local.shape)} of {tuple(target.shape)}, but "
            f"{list(placements)} cut {tuple(piece.shape)}"
        )
    return piece


def _transformers_model(model: nn.Module) -> str | None:
    """The class name of a transformers ``PreTrainedModel`` inside ``model`` (no transformers import)."""
    for m in model.modules():
        if type(m).__module__.startswith("transformers.") and hasattr(m, "initialize_weights"):
            return type(m).__name__
    return None


def materialize(
    model: nn.Module, device: str | torch.device = "cpu", *, init: str | Callable[[nn.Module], None] = "replay"
) -> nn.Module:
    """Give a model built by ``build_on_meta`` (then ``parallelize``d, or not) real tensors on ``device``, in
    place; returns it. ``init="replay"``: the values eager construction gives (only this rank's shards are
    ever written); a callable: ``init(model)`` under ``torch.no_grad()`` instead (your own init, or a
    checkpoint). Every rank of the mesh calls it; no collective runs (``init`` may run some)."""
    record = meta_record(model)
    if record is None:
        raise MetaInitError(
            f"{type(model).__name__}: was not built by build_on_meta; materialize is for models "
            "built on the meta device (mode.parallel.build_on_meta)"
        )
    if record.materialized:
        raise MetaInitError(f"{type(model).__name__}: is already materialized (materialize runs once per build)")
    if init != "replay" and not callable(init):
        raise ValueError(f"init={init!r}: must be 'replay' or a callable init(model)")
    hf = _transformers_model(model) if init == "replay" else None
    if hf is not None:
        raise MetaInitError(
            f"{hf}: a transformers model skips its own weight init when built on meta "
            "(PreTrainedModel.init_weights), so a replay would not give the eager values; "
            "materialize it from a checkpoint: init=lambda m: mode.parallel.model_state."
            "load_state(folder, m) (docs/distributed.md)"
        )
    device = _resolve_device(device)
    targets = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        ref = record.names.get(name)
        if ref is None:
            raise MetaInitError(
                f"{name!r}: is not a tensor the model was built with (was a module added after "
                "build_on_meta? build it inside fn)"
            )
        if tuple(t.shape) != ref.shape:
            raise MetaInitError(
                f"{name!r}: has global shape {tuple(t.shape)}, built as {ref.shape}; materialize "
                "supports models sharded by mode.parallel.parallelize (DTensors of the full shape), "
                "not plain-tensor shards (mode.parallel.ep_model.shard_model)"
            )
        if not t.is_meta and not (isinstance(t, DTensor) and t.to_local().is_meta):
            raise MetaInitError(
                f"{name!r}: is on {t.device}, no longer on meta (was the model moved with "
                "to_empty or .to?); materialize a model straight from build_on_meta / parallelize"
            )
    groups = [g for g in _owners(model).values() if len(g) > 1]
    model.to_empty(device=device)
    _retie(groups)
    for hook in record.hooks:
        hook.remove()
    record.hooks.clear()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        targets[name] = t
    written: set[int] = set()

    def emit(name: str, full: Tensor) -> None:
        t = targets.get(name)
        if t is None or id(t) in written:
            return
        piece = _local_piece(full, t, name)
        (t.to_local() if isinstance(t, DTensor) else t).copy_(piece)
        written.add(id(t))

    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    with torch.no_grad():
        # init: every value replayed. A callable: the buffers first (RoPE tables and other values that
        # checkpoints leave out; no draw unless a buffer is random), then init(model)
        replay(model, emit, names=None if init == "replay" else buffers)
        missing = [n for n, t in targets.items() if id(t) not in written and (init == "replay" or n in buffers)]
        assert not missing, f"replay wrote no value into {missing}"
        if init != "replay":
            init(model)
    record.materialized = True
    return model
