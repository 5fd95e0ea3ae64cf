"""Autoregressive sampling with causal routing and per-layer KV caches.

Shape legend: B batch (prompts), P longest prompt, V vocabulary.

Prefill runs the right-padded prompts once; then each step feeds one token per sequence at its true
position. At a MoD layer a token goes through the block only when its causal decision says so, and only
then does it attend to (and extend) that layer's cache, so each layer's cache holds exactly the tokens
routed through it and sequences in a batch fill their caches at different rates.

Two decode paths, chosen once when the caches are made (``static``; ``generate(static_cache=None)`` picks
static on CUDA and dynamic elsewhere). Both produce the same tokens and the same caches.
    static   no host sync inside a decode step and shapes that change only every ``width_bucket`` tokens:
             caches written in place by scatter, attention over a bucketed width with a per-row length mask
             built on the device, MoD layers deciding on the device and running their block on every row
             (masked: compute is not saved, cache writes are). ``generate`` then makes one host sync per
             step, reading the sampled tokens (and checking EOS). For GPUs, where a sync stalls the queue.
    dynamic  MoD layers read their routing decision on the host (one sync per MoD layer) and run the
             block only on the routed rows, or not at all; caches are written and read through slices of
             each row (no copy, no mask when the rows' lengths are equal). For CPUs, where skipping work
             is what saves time and a sync costs nothing.

Precision (``generate(bf16=...)``): by default the model decodes in its own dtype. ``bf16=True`` runs prefill
and every step under ``torch.autocast(device, bfloat16)`` with bfloat16 KV caches (weights untouched). On CUDA
that is what the static path needs to stay sync-free in a float32 model with experts: torch's grouped GEMM
has its fast kernel in bfloat16 only, and in float32 falls back to a loop that reads the expert offsets on
the host (two host syncs per MoE layer and step; the expert bank warns once, ``SlowPathWarning``). A model
already in bfloat16 needs no autocast. The logits are then bfloat16 (sampling with a temperature draws
from their float32 softmax).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from mode import _checks
from mode.model.config import LMConfig
from mode.model.decode_graphs import GraphedDecode, autocast_step, check_cuda_graphs
from mode.model.lm import LM


def causal_problem(cfg: LMConfig) -> str | None:
    """Why a model of ``cfg`` cannot decode token by token (its routing reads later tokens), or None."""
    for kind in dict.fromkeys(cfg.kinds):  # each kind once, in layer order
        problem = cfg.router_config(kind).causal_problem() if kind.experts else None
        if problem is None and kind.mod is not None:
            problem = cfg.mod_config(kind.mod).causal_problem()
        if problem is not None:
            return problem
    return None


def _check_generatable(model: LM) -> bool:
    """Returns whether MoD layers need causal routing; raises for layers that cannot sample causally."""
    problem = causal_problem(model.cfg)
    if problem is not None:
        raise ValueError(problem)
    return model.cfg.uses_mod


def check_prompts(prompts, vocab_size: int) -> None:
    """A non-empty list of non-empty lists of token ids in ``[0, vocab_size)``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r:.60}: must be a non-empty list of non-empty token-id lists")
    for b, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0:
            raise ValueError(f"prompts[{b}]={p!r:.60}: must be a non-empty list of token ids")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompts[{b}]: token id {t!r} must be an int in [0, {vocab_size})")


def sample_next(logits_BV: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    if temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV.float() / temperature
    if top_k is not None:
        kth = logits_BV.topk(min(top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    return torch.multinomial(logits_BV.softmax(-1), 1, generator=generator).squeeze(1)


@torch.no_grad()
def prefill(
    model: LM,
    prompts: Sequence[Sequence[int]],
    capacity: int,
    static: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> tuple[Tensor, list, Tensor]:
    """Run the prompts; returns (last-token logits_BV, caches, next positions_B). ``static`` picks the decode
    path of the returned caches (see the module doc); ``cache_dtype`` their dtype (default: the weights')."""
    causal = _check_generatable(model)
    check_prompts(prompts, model.cfg.vocab_size)
    B = len(prompts)
    # host data, built on the CPU whatever the default device (then moved once)
    lens_B = torch.tensor([len(p) for p in prompts], device="cpu")
    P = int(lens_B.max())
    idx_BP = torch.zeros(B, P, dtype=torch.long, device="cpu")
    for b, p in enumerate(prompts):
        idx_BP[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device="cpu")
    mask_BP = torch.arange(P, device="cpu")[None, :] < lens_B[:, None]
    device = model.embed.weight.device
    caches = model.new_caches(B, capacity, static=_checks.check_bool("static", static), dtype=cache_dtype)
    out = model(
        idx_BP.to(device),
        mask_BS=mask_BP.to(device) if int(lens_B.min()) < P else None,
        caches=caches,
        causal_routing=causal,
    )
    logits_BV = out.logits_BSV[torch.arange(B, device=device), (lens_B - 1).to(device)]
    return logits_BV, caches, lens_B.to(device)


@torch.no_grad()
def decode_step(model: LM, tokens_B: Tensor, positions_B: Tensor, caches: list) -> Tensor:
    """Feed one token per sequence at ``positions_B``; returns next-token logits_BV. With static caches this
    never makes the host wait for the device; with dynamic ones, once per MoD layer."""
    out = model(tokens_B[:, None], positions_BS=positions_B[:, None], caches=caches, causal_routing=model.cfg.uses_mod)
    return out.logits_BSV[:, -1]


@torch.no_grad()
def generate(
    model: LM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    static_cache: bool | None = None,
    bf16: bool = False,
    cuda_graphs: bool = False,
) -> list[list[int]]:
    """Sample continuations (token ids, prompt excluded) for a batch of prompts.

    ``static_cache``: the decode path (module doc); None picks static on CUDA, dynamic elsewhere. Each step
    reads the sampled tokens on the host once (the step's one host sync), which also checks ``eos_id``.
    ``bf16``: decode under ``torch.autocast(bfloat16)`` with bfloat16 KV caches (module doc, "Precision"); on
    CUDA a float32 model with experts needs it for the fast, sync-free grouped GEMM.
    ``cuda_graphs``: replay each decode step from a CUDA graph (``mode.model.decode_graphs``: one capture per
    attended width, the same tokens as without); CUDA and the static path only (ValueError elsewhere).
    """
    _checks.check_int("max_new_tokens", max_new_tokens)
    _checks.check_non_negative("temperature", temperature)
    if top_k is not None:
        _checks.check_int("top_k", top_k)
    _checks.check_bool("bf16", bf16)
    _checks.check_bool("cuda_graphs", cuda_graphs)
    device = model.embed.weight.device
    static = device.type == "cuda" if static_cache is None else _checks.check_bool("static_cache", static_cache)
    if cuda_graphs:
        check_cuda_graphs(device, "cuda_graphs")
        if not static:
            raise ValueError(
                "cuda_graphs=True with static_cache=False: CUDA graphs replay the static decode path "
                "only (the dynamic one reads each MoD layer's decision on the host); pass "
                "static_cache=True or leave it None"
            )
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    check_prompts(prompts, model.cfg.vocab_size)
    capacity = max(len(p) for p in prompts) + max_new_tokens
    with autocast():
        logits_BV, caches, pos_B = prefill(
            model, prompts, capacity, static=static, cache_dtype=torch.bfloat16 if bf16 else None
        )
    decode = autocast_step(model, caches, autocast, decode_step)
    if cuda_graphs:
        decode = GraphedDecode(decode, caches)
    B = len(prompts)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        next_B = sample_next(logits_BV, temperature, top_k, generator)
        for b, token in enumerate(next_B.tolist()):  # the step's one host sync
            if not done[b]:
                out[b].append(token)
                done[b] = token == eos_id
        if all(done) or step == max_new_tokens - 1:
            break
        logits_BV = decode(next_B, pos_B)
        pos_B = pos_B + 1
    model.train(was_training)
    return out
