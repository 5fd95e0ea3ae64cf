"""Activation checkpointing per block: a block keeps only its input for backward, and is computed again
when backward reaches it (``torch.utils.checkpoint``, non-reentrant). No ``torch.distributed`` here.

Shape legend: B batch, S sequence, D hidden.

``checkpoint_blocks(model)`` replaces each block's ``forward`` on the instance, so parameter names, the
``state_dict`` and checkpoints do not change, and hooks on the block's ``__call__`` stay outside the
checkpoint: FSDP2 gathers the block's weights around the first pass, and the recompute runs inside the
backward of the block, for which FSDP has gathered them again. The blocks are those of
``mode.model.blocks`` (the LM's layers).

A recompute must compute what the first pass computed, and leave no second trace:
    routing      MoD top-C, token choice and expert choice are functions of the block's input and weights:
                 the recompute routes the same tokens to the same experts (a forward that is deterministic
                 is assumed, as for every recompute). The random MoD selection (``mod_random``) draws from the
                 global torch RNG: ``preserve_rng_state=True`` saves the CPU RNG and the RNG of the input's
                 CUDA device before the block and replays them during the recompute (no router keeps a
                 ``torch.Generator`` of its own; tests/train/test_train_features.py checks the draws match).
    state        a forward that writes module state would write it twice: the token-choice router's
                 bias-balance load (``load_X``, counted in training forwards with autograd on, which a
                 recompute is) and the threshold of ``causal="threshold"`` MoD routers (an EMA). Every
                 buffer of the block is copied before its recompute and put back after it
                 (``preserved_buffers``; a block's buffers are a few vectors).
    statistics   routing statistics travel in the ``Aux`` the first pass returns (the trainer records
                 those); torch drops the recompute's outputs.
    collectives  an expert-parallel block repeats its all-to-alls (and a "global" balance loss its count
                 all-reduce) when recomputed. Every rank runs the same backward graph in the same order,
                 so every rank recomputes the same blocks in the same order and the collectives pair up
                 (tested on a (2, 2) gloo mesh).

Only training forwards are checkpointed: under ``torch.no_grad`` (evaluation) and with a KV cache
(generation) a block runs as it is. ``torch.compile`` of the same blocks is not supported with it yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mode.model.blocks import resolve_blocks


@contextlib.contextmanager
def preserved_buffers(module: nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` as it was on entry, again on exit (whatever ran in between, an exception
    included): the buffer objects keep their identity, a buffer replaced by another object is put back."""
    saved = []
    for name, buf in module.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        saved.append((owner, attr, buf, buf.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, attr, buf, value in saved:
                buf.copy_(value)
                if owner._buffers.get(attr) is not buf:
                    owner._buffers[attr] = buf


class CheckpointedForward:
    """A block's ``forward`` under ``torch.utils.checkpoint`` (what ``checkpoint_blocks`` installs)."""

    def __init__(self, block: nn.Module, forward):
        self.block = block
        self.inner = forward  # the block's own forward (a bound method)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or kwargs.get("cache") is not None:
            return self.inner(*args, **kwargs)  # evaluation and generation keep nothing for backward anyway
        return checkpoint(
            self.inner, *args, use_reentrant=False, preserve_rng_state=True, context_fn=self._contexts, **kwargs
        )

    def _contexts(self):
        # (around the first pass, around the recompute): the recompute leaves the block's buffers as it found them
        return contextlib.nullcontext(), preserved_buffers(self.block)


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), CheckpointedForward)


def checkpoint_blocks(model: nn.Module, blocks: Iterable[nn.Module] | None = None) -> list[nn.Module]:
    """Checkpoint the activations of each block of ``model`` (default: ``mode.model.blocks``'s rule, the LM's
    layers), in place; returns the blocks. Calling it again changes nothing."""
    blocks = resolve_blocks(model, blocks)
    if not blocks:
        raise ValueError(
            f"model={type(model).__name__}: has no blocks to checkpoint (no nn.ModuleList or "
            "nn.ModuleDict of modules with parameters); pass blocks="
        )
    for block in blocks:
        if not is_checkpointed(block):
            block.forward = CheckpointedForward(block, block.forward)
    return blocks
