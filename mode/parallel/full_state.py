"""A model's full state dict on one process, whether or not it is ``parallelize``d.

``full_state_dict(model)``: every tensor at its global shape (expert weights with all E rows), in the
model's own names. A parallelized model is gathered with PyTorch's ``get_model_state_dict`` (full tensors,
CPU-offloaded, so only rank 0 ends up holding them); every rank of its mesh must call it, and ranks other
than 0 get None. A plain model gives its ``state_dict()`` (detached) in this process.
``barrier(model)``: every rank of a parallelized model waits for the others (a no-op otherwise), so rank 0
can finish writing what it gathered before anyone reads it.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mode.parallel.apply import is_parallelized


def full_state_dict(model: nn.Module) -> dict[str, Tensor] | None:
    if not is_parallelized(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, Tensor], state) if dist.get_rank() == 0 else None  # full_state_dict: plain tensors


def barrier(model: nn.Module) -> None:
    if is_parallelized(model):
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        dist.barrier(device_ids=[device.index] if device is not None else None)
