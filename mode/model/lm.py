"""A small decoder-only language model whose layers are dense, MoD, MoE, staged or integrated MoDE.

Shape legend: B batch, S sequence, D hidden, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.layers.kv_cache import KVCache
from mode.model.config import LMConfig
from mode.routing.keys import layer_prefix
from mode.routing.plan import Aux


@dataclass
class LMOutput:
    logits_BSV: Tensor
    loss: Tensor | None  # mean next-token cross-entropy (without aux losses)
    aux: Aux  # every routed layer's losses and stats, names prefixed "layers.{i}."


class LM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(kind.build(cfg) for kind in cfg.kinds)
        self.routed = [kind.mod is not None for kind in cfg.kinds]  # MoD-routed layers (causal routing applies)
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-6)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)  # GPT-2: residual writes shrink with depth
        for name, p in self.named_parameters():
            if p.dim() < 2 or ".router." in name:
                continue  # norms keep 1; routers keep their own init
            last = name.rsplit(".", 1)[-1]
            is_out = last in ("w_out_HD", "w_out_EHD") or name.endswith("attn.out.weight")
            nn.init.normal_(p, std=out_std if is_out else std)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n

    def forward(
        self,
        idx_BS: Tensor,
        targets_BS: Tensor | None = None,
        *,
        mask_BS: Tensor | None = None,
        positions_BS: Tensor | None = None,
        caches: list[KVCache] | None = None,
        causal_routing: bool = False,
    ) -> LMOutput:
        """Logits for ``idx_BS``; ``targets_BS`` adds the mean cross-entropy (positions where
        ``mask_BS`` is False are ignored).

        ``causal_routing``: MoD layers route each token by its causal decision instead of the top-C of the
        sequence (sampling, and evaluating what sampling sees). ``caches``/``positions_BS``: continue from
        the state in ``caches`` (one ``KVCache`` per layer; see ``mode.model.generate``).
        """
        if not isinstance(idx_BS, Tensor) or idx_BS.dtype != torch.long or idx_BS.dim() != 2:
            raise TypeError(
                f"idx: must be a (B, S) torch.long tensor of token ids, got "
                f"{getattr(idx_BS, 'dtype', type(idx_BS).__name__)} {tuple(getattr(idx_BS, 'shape', ()))}"
            )
        if caches is None and idx_BS.shape[1] > self.cfg.seq_len:
            raise ValueError(f"idx.shape[1]={idx_BS.shape[1]}: must be <= seq_len={self.cfg.seq_len}")
        _checks.check_device("idx", idx_BS, self.embed.weight.device)
        V = self.cfg.vocab_size
        _checks.assert_on_device(((idx_BS >= 0) & (idx_BS < V)).all(), f"idx: token ids must be in [0, {V})")
        if targets_BS is not None and (not isinstance(targets_BS, Tensor) or targets_BS.shape != idx_BS.shape):
            raise ValueError(
                f"targets.shape={tuple(getattr(targets_BS, 'shape', ()))}: must equal idx.shape={tuple(idx_BS.shape)}"
            )
        B, S = idx_BS.shape
        if positions_BS is None:
            positions_BS = torch.arange(S, device=idx_BS.device).expand(B, S)
        x_BSD = self.embed(idx_BS)
        aux = Aux()
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            x_BSD, layer_aux = layer(
                x_BSD, mask_BS=mask_BS, positions_BS=positions_BS, cache=cache, causal=causal_routing
            )
            aux.merge(layer_aux, layer_prefix(i))
        logits_BSV = self.head(self.norm(x_BSD))
        loss = None
        if targets_BS is not None:
            targets = targets_BS if mask_BS is None else targets_BS.masked_fill(~mask_BS, -100)
            loss = F.cross_entropy(
                _checks.at_least_float32(logits_BSV).reshape(-1, logits_BSV.shape[-1]), targets.reshape(-1)
            )
        return LMOutput(logits_BSV, loss, aux)

    def new_caches(
        self, batch: int, capacity: int, static: bool = False, dtype: torch.dtype | None = None
    ) -> list[KVCache]:
        """One empty KV cache per layer for ``batch`` sequences of up to ``capacity`` tokens. ``static``
        picks the decode path (see ``mode.model.generate``): True never makes the host wait for the device
        within a step, False lets MoD layers skip their work for skipped tokens. ``dtype``: the keys' and
        values' dtype (default: the weights'; bfloat16 when decoding under bfloat16 autocast)."""
        p = self.embed.weight
        return [
            KVCache(
                batch,
                self.cfg.n_heads,
                capacity,
                self.cfg.d_model // self.cfg.n_heads,
                p.dtype if dtype is None else dtype,
                p.device,
                static=static,
            )
            for _ in self.layers
        ]
