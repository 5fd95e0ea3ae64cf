"""Sharded checkpoints of any model, ``parallelize``d or not, with PyTorch's own state-dict API and DCP.

    save_state("ckpt", model, optimizer, extra={"step": 3})   # every rank of the mesh calls it
    extra = load_state("ckpt", model, optimizer)               # on any layout, or in one process

``mode.train.Trainer`` has its own checkpoints (``mode.parallel.checkpoint``: the LM's config and training
state with them); these are for a model of your own or a converted transformers model in your own loop.

What is written. ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` names every
tensor by its parameter's name (FSDP and DTensor shards at their *global* shapes: expert weights with all E
rows), and ``dcp.save`` writes each rank's shards. Only tensors go into DCP: the model's state and the
optimizer's per-parameter state (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``); the optimizer's
hyper-parameters are those of the optimizer you load into, and ``extra`` (JSON) is written beside it as
``extra.json``. So a checkpoint saved on a (2, 2) mesh loads on (1, 2), on (1, 3), or into a plain model
with no process group, each rank reading only the chunks of its own shards.

Safe, checked and atomic. Reads go through ``mode.parallel.dcp_safe.SafeReader`` (no code from the folder
runs; every file it reads is first checked against ``SHA256SUMS``: a changed byte is a
``mode.train.checkpoint.ChecksumError`` naming the file). A save goes to a temporary folder beside ``path``:
each rank hashes the files it wrote, and rank 0 writes ``extra.json`` and ``SHA256SUMS`` there and renames
the folder onto ``path`` once every rank's shards are complete: ``path`` holds the previous checkpoint or the
new one, never a mix.
"""

from __future__ import annotations

import json
import os
import secrets
import warnings
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mode.parallel import dcp_safe
from mode.parallel.dcp_safe import ChecksumWriter, SafeReader
from mode.train import checkpoint

EXTRA = "extra.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, list | None]:
    """The tensors to save or load into, and the optimizer's parameter groups (hyper-parameters)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}, None
    model_sd, optim_sd = get_state_dict(model, optimizer)  # creates the optimizer's state if it has none yet
    return {"model": model_sd, "optimizer": optim_sd["state"]}, cast(list, optim_sd["param_groups"])


def save_state(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None
) -> Path:
    """Write ``model`` (and ``optimizer``) to the folder ``path``; every rank of the model's process group calls
    it (in one process without a group, this process writes alone). ``extra``: JSON-serialisable."""
    path = Path(path)
    text = json.dumps(extra or {})  # not JSON: the error comes before anything is written
    distributed = _distributed()
    rank = dist.get_rank() if distributed else 0
    token = [f".{path.name}.tmp-{secrets.token_hex(4)}" if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(token, src=0)
    assert token[0] is not None, "save: rank 0 names the temporary folder (broadcast to every rank)"
    tmp = path.parent / token[0]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
    writer = ChecksumWriter(tmp)  # hashes the files this rank writes
    with warnings.catch_warnings():  # without a group DCP warns that it saves in one process: intended
        warnings.simplefilter("ignore" if not distributed else "default")
        dcp.save(_tensor_state(model, optimizer)[0], storage_writer=writer, no_dist=not distributed)
    sums = dcp_safe.gather_sums(writer.sums, None, distributed)
    if rank == 0:
        checkpoint.atomic_write_text(tmp / EXTRA, text)
        dcp_safe.write_manifest(tmp, sums, extra_files=(EXTRA,))
        checkpoint.replace_dir(tmp, path)
    if distributed:
        dist.barrier()  # nobody reads ``path`` before rank 0 has renamed it
    return path


def load_state(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a ``save_state`` folder into ``model`` (and ``optimizer``, whose hyper-parameters stay its own);
    returns ``extra``. Every rank of the model's process group calls it; a plain model in a process without
    a group loads alone."""
    path = Path(path)
    where = f"checkpoint {str(path)!r}"
    if not (path / EXTRA).is_file():
        raise checkpoint.CheckpointError(f"{where}: no {EXTRA} in it; not a save_state folder")
    reader = SafeReader(path, where)  # reads SHA256SUMS (an old folder without one: a warning)
    reader.verify(EXTRA)
    try:
        extra = json.loads((path / EXTRA).read_text())
    except (OSError, ValueError) as e:
        raise checkpoint.CheckpointError(
            f"{where}: {EXTRA} is not readable JSON ({e}); not a save_state folder"
        ) from None
    reader.read_metadata()  # checked and unpickled safely on every rank, before any collective
    state, param_groups = _tensor_state(model, optimizer)
    dcp_safe.load(state, reader, no_dist=not _distributed())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            # param_groups: a list wherever there is an optimizer
            optim_state_dict={"state": state["optimizer"], "param_groups": cast(list, param_groups)},
        )
    return extra
