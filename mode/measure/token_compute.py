"""Per-token compute of one LM forward pass: which blocks each token went through, and its FLOPs.

Shape legend: L layers, B batch, S sequence (original positions), C routed slots per sequence.

Definitions (see docs/reports.md)
    attn_LBS  1 where the token went through layer i's attention: always for dense, MoE and integrated
              layers; for MoD and staged layers only when the MoD router routed it
    mlp_LBS   MLP computations the token received in layer i: 1 for a dense MLP (and a routed MoD block),
              the number of real-expert assignments that were computed (after capacity drops; no-op
              choices count 0) for MoE, integrated and staged layers
    flops_BS  forward FLOPs spent on the token, from ``mode.measure.flops``'s per-token costs:
                  attention   attention_flops(n, d) / n per traversed layer, n the tokens attending
                              together (S, or the routed count of that sequence in a MoD layer)
                  MLP         mlp_flops_per_token(d, hidden) per assignment, and the shared experts
                              (shared_flops_per_token) for every token that reaches an MoE layer
                  routers     a router's per-token cost for every token it scores (a staged layer's
                              MoE router scores only the routed tokens)
                  head        2 * d * vocab
              so that, with top-C routing, ``flops_BS.sum()`` equals ``B *`` the realized
              ``forward_flops(cfg, S, aux)`` total.

A staged layer's inner MoE routes the C routed slots, not the sequence. Its ``compute_T`` is mapped back
to original positions with the MoD plan: the routed slots of sequence b are the positions where the MoD
router's ``compute_T == 1``, in increasing order (``slots_to_positions``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mode.measure.flops import attention_flops, forward_flops_per_token, mlp_flops_per_token, shared_flops_per_token
from mode.model.config import LMConfig
from mode.model.kinds import get_layer_kind
from mode.routing.keys import MOD, MOE, router_key
from mode.routing.plan import Aux


@dataclass
class TokenCompute:
    kinds: tuple[str, ...]
    attn_LBS: Tensor  # float 0/1
    mlp_LBS: Tensor  # float, assignments
    flops_BS: Tensor  # float64
    dense_flops_per_token: float  # the same-shape all-dense model, for "relative to dense"

    @property
    def blocks_BS(self) -> Tensor:
        """Layers whose attention the token went through."""
        return self.attn_LBS.sum(0)

    @property
    def mlp_BS(self) -> Tensor:
        """MLP / expert assignments the token received, over all layers."""
        return self.mlp_LBS.sum(0)

    @property
    def routed_LBS(self) -> Tensor:
        """1 where the token took layer i's routed path: the block of a MoD/staged layer, at least one real
        expert of a MoE/integrated layer, always for a dense layer (the heatmap's quantity)."""
        rows = []
        for i, name in enumerate(self.kinds):
            kind = get_layer_kind(name, "kinds")
            if kind.mod is not None:
                rows.append(self.attn_LBS[i])
            elif kind.experts:
                rows.append((self.mlp_LBS[i] > 0).to(self.attn_LBS.dtype))
            else:
                rows.append(torch.ones_like(self.attn_LBS[i]))
        return torch.stack(rows)


def max_mlp_per_layer(cfg: LMConfig, kind: str) -> int:
    """Most MLP assignments one token can get in one layer (histogram bounds)."""
    k = get_layer_kind(kind, "kind")
    return cfg.router_config(k).max_assignments_per_token if k.experts else 1


def slots_to_positions(slots_BC: Tensor, routed_BS: Tensor) -> Tensor:
    """Map per-slot values of a MoD-routed block back to the sequence: slot j of row b holds the j-th
    routed position of row b (increasing order); slots past a row's routed count are dropped."""
    B, S = routed_BS.shape
    C = slots_BC.shape[1]
    assert C <= S, (C, S)
    pos_S = torch.arange(S, device=routed_BS.device)
    key_BS = (~routed_BS).long() * S + pos_S  # routed positions first, each group in position order
    pos_BC = key_BS.argsort(dim=1)[:, :C]
    n_B = routed_BS.sum(1)
    keep_BC = torch.arange(C, device=routed_BS.device)[None, :] < n_B[:, None]
    out_BS = torch.zeros(B, S, dtype=slots_BC.dtype, device=slots_BC.device)
    return out_BS.scatter(1, pos_BC, slots_BC * keep_BC.to(slots_BC.dtype))


def token_compute(cfg: LMConfig, aux: Aux, batch_shape: tuple[int, int]) -> TokenCompute:
    """Per-token compute of the LM forward pass whose output aux is ``aux`` (stats "layers.{i}.*")."""
    B, S = batch_shape
    d = cfg.d_model
    stats = aux.stats
    some = next(iter(stats.values()), None)
    dev = some.compute_T.device if some is not None else torch.device("cpu")
    attn_rows, mlp_rows = [], []
    flops_BS = torch.full((B, S), 2.0 * d * cfg.vocab_size, dtype=torch.float64, device=dev)  # the head
    full_attn = float(attention_flops(S, d)) / S
    mlp_tok = mlp_flops_per_token(d, cfg.d_hidden, cfg.activation)
    exp_tok = mlp_flops_per_token(d, cfg.expert_hidden or cfg.d_hidden, cfg.activation)
    shared_tok = shared_flops_per_token(cfg)  # every token that reaches an MoE layer
    for i, kind in enumerate(cfg.kinds):
        ones_BS = torch.ones(B, S, dtype=torch.float64, device=dev)
        if kind.mod is not None:  # attention (and the MLP's router) only for the tokens MoD routed
            routed_BS = _compute_BS(stats, router_key(i, MOD), (B, S)) > 0
            attn_BS = routed_BS.double()
            n_B = attn_BS.sum(1, keepdim=True)
            attn_tok_B1 = attention_flops(n_B, d) / n_B.clamp_min(1)  # 8d^2 + 4nd for n routed tokens
            flops_BS = flops_BS + cfg.mod_config(kind.mod).router_flops(S) / S + attn_BS * attn_tok_B1
        else:
            routed_BS, attn_BS = None, ones_BS
            flops_BS = flops_BS + full_attn
        if not kind.experts:
            mlp_BS = attn_BS  # one dense MLP per token that went through the block
            flops_BS = flops_BS + mlp_BS * mlp_tok
        else:
            moe_router_tok = cfg.router_config(kind).router_flops(S) / S
            name = router_key(i, MOE)
            if routed_BS is not None:  # the MoE routed the MoD-routed slots: map them back to positions
                st = stats.get(name)  # absent when causal routing sent no token of the batch
                if st is None:
                    mlp_BS = torch.zeros(B, S, dtype=torch.float64, device=dev)
                else:
                    slots_BC = st.compute_T.view(st.batch_shape).double()
                    mlp_BS = slots_to_positions(slots_BC, routed_BS)
            else:
                mlp_BS = _compute_BS(stats, name, (B, S)).double()
            flops_BS = flops_BS + attn_BS * (moe_router_tok + shared_tok) + mlp_BS * exp_tok
        attn_rows.append(attn_BS)
        mlp_rows.append(mlp_BS)
    dense = replace(cfg, layers=("dense",) * cfg.n_layers)
    return TokenCompute(
        tuple(cfg.layers), torch.stack(attn_rows), torch.stack(mlp_rows), flops_BS, forward_flops_per_token(dense, S)
    )


def _compute_BS(stats: dict, name: str, batch_shape: tuple[int, int]) -> Tensor:
    st = stats.get(name)
    if st is None:
        raise ValueError(
            f"aux.stats has no {name!r}: token_compute needs the aux of a full LM forward "
            f"(stats named {router_key(0, MOD)!r}, {router_key(0, MOE)!r}, ...)"
        )
    if tuple(st.batch_shape) != tuple(batch_shape):
        raise ValueError(f"{name}: batch_shape={tuple(st.batch_shape)}: must equal the input's {tuple(batch_shape)}")
    return st.compute_T.view(batch_shape)
