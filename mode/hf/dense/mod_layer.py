"""A transformers decoder layer turned into a Mixture-of-Depths layer, in place.

Shape legend: B batch, S tokens of this call, D hidden, C routed slots per row, H head dim of cos/sin,
P tokens seen before this call (the dense cache length), L keys a row's MoD cache stored before this call.

The layer's class becomes ``MoD<Original>``, a subclass with ``MoDLayerMixin`` in front, and the layer gets
one new submodule, ``mod_router`` (mode's ``MoDRouter``). Nothing else moves: the state-dict keys stay the
original ones plus ``...mod_router.*``, and transformers' hooks that match decoder layers by class
(``output_hidden_states``) still match and record the full ``(B, S, D)`` output.

A call: the router picks the routed tokens (top-C of each row when training, or the causal decision when
sampling, see ``mode.hf.routing``); pads never route. What a token the router does not pick skips is
``mod_part``:
    "layer"      the whole layer (Raposo et al.): routed tokens go through the original layer's forward
    "attention"  only the attention half (Router-Tuning / MindSkip, arXiv 2410.13184); every token then goes
                 through the MLP half
    "mlp"        only the MLP half; every token goes through the attention half first (the model's own dense
                 cache), and the router reads the attention's output
For "layer" and "attention" the routed tokens are gathered together with the model's own cos/sin at their
true positions and the model's own mask restricted to them (``mode.hf.dense.mask``), so the attention sees only
routed keys; the layer's cache becomes a ``MoDCacheLayer``, which stores only routed tokens
(``mode.hf.dense.cache``). Each routed token gets ``x + g * (part(x) - x)`` (the gate ``g`` from the router,
exactly 1 for ``gate="ste"`` and ``"one"``) and is scattered back; the other tokens are copied through
unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from mode import _checks
from mode.hf._compat import check_attention
from mode.hf.dense import mask as hf_mask
from mode.hf.dense.cache import MoDCacheLayer, mod_cache_layer
from mode.hf.dense.routed_queries import routed_query_attention
from mode.hf.dense.skip_update import SkipUpdate
from mode.layers.mod import DecodeStats
from mode.routing.mod_topk import MoDRouter
from mode.routing.plan import Aux

ROUTING = ("auto", "topk", "causal", "dense")  # "dense": the original layer, no routing (a teacher)
PARTS = ("layer", "attention", "mlp")  # what a token the router does not pick skips
KV = ("routed", "all")  # whose K/V a "layer" / "attention" MoD layer keeps: routed tokens only, or every token

# To the type checker the mixin is the nn.Module it is put in front of (training, super().forward); at run time
# it is a plain class, so that the decoder-layer class alone decides the module's behaviour.
if TYPE_CHECKING:
    from transformers import PretrainedConfig

    _DecoderLayer = nn.Module

    class _Attention(nn.Module):
        """A transformers attention module, as the mixin uses it: its index in the model's cache."""

        layer_idx: int
else:
    _DecoderLayer = object


class MoDLayerMixin(_DecoderLayer):
    """Put in front of a decoder-layer class by ``to_mod``; expects ``self.mod_router``, ``self.mod_routing``
    (one of ``ROUTING``) and ``self.mod_part`` (one of ``PARTS``), and leaves the last call's routing result
    in ``self.mod_aux``."""

    mod_router: MoDRouter
    mod_routing: str = "auto"
    mod_part: str = "layer"
    mod_kv: str = "routed"
    mod_skip: SkipUpdate | None  # the estimated update a skipped token gets (None: nothing); set by
    # to_mod on the instance (a class-level default would shadow the registered submodule)
    mod_aux: Aux | None = None
    mod_fast_path: bool = True  # the original forward for calls that route every token (_every_row_path), ...
    mod_dense_decode_rows: int = 16  # ... and for decode steps of at most this many rows when any routes
    # the decoder layer's own submodules that the mixin calls (Llama, Qwen2 and Mistral name them so)
    self_attn: _Attention
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def mod_causal(self) -> bool:  # not called in "dense" mode
        """Route by the causal decision (sampling) rather than top-C (training)? ``auto``: causal in eval mode
        when the router has a causal method, top-C otherwise."""
        if self.mod_routing == "auto":
            return not self.training and self.mod_router.cfg.causal != "none"
        return self.mod_routing == "causal"

    # The two halves of the decoder layer (Llama, Qwen2 and Mistral write it exactly so; a test checks that
    # attention-then-MLP through these equals the layer's own forward).
    def attention_sublayer(self, x_BSD: Tensor, **attn_kwargs) -> Tensor:
        """The attention half with its residual: ``h_BSD = x + self_attn(input_layernorm(x))``."""
        return x_BSD + self.self_attn(hidden_states=self.input_layernorm(x_BSD), **attn_kwargs)[0]

    def mlp_sublayer(self, h_BSD: Tensor) -> Tensor:
        """The MLP half with its residual: ``h + mlp(post_attention_layernorm(h))``."""
        return h_BSD + self.mlp(self.post_attention_layernorm(h_BSD))

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> Tensor:
        """The decoder layer with routing: the original forward in "dense" mode; otherwise the router's picks go through
        ``mod_part`` and the other tokens skip it (the module's docstring), and ``mod_aux`` holds the router's ``Aux``.
        Returns the (B, S, D) hidden states, as the original layer does."""
        x_BSD = hidden_states
        attn = self.self_attn
        if self.mod_routing == "dense":
            self.mod_aux = None
            if past_key_values is not None and isinstance(
                _cache_layer_at(past_key_values, attn.layer_idx), MoDCacheLayer
            ):
                raise ValueError(
                    "mod routing='dense' with a cache a MoD layer already made sparse; start from a new cache"
                )
            return self._original_forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        check_attention(attn.config)
        if self.mod_part == "mlp":  # attention over every token (the model's own cache), then route the MLP
            P = 0 if past_key_values is None else past_key_values.get_seq_length(attn.layer_idx)
            real_BS, causal = self._routing_inputs(x_BSD, attention_mask, P)
            h_BSD = self.attention_sublayer(
                x_BSD,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            plan, slot_BC, valid_BC = self._route(h_BSD, real_BS, causal)
            if plan.seq_capacity == 0:
                return self._skipped(h_BSD)
            h_BCD = hf_mask.gather_rows(h_BSD, slot_BC)
            return self._combine(h_BSD, h_BCD, self.mlp_sublayer(h_BCD), plan, slot_BC, valid_BC)

        if position_embeddings is None:
            raise ValueError(
                "position_embeddings=None: a MoD layer gathers the model's own cos/sin at the routed "
                "tokens' positions; call it through the model"
            )
        cache = (
            None
            if past_key_values is None or self.mod_kv == "all"
            else mod_cache_layer(past_key_values, attn.layer_idx)
        )
        P = 0 if cache is None else cache.get_seq_length()
        S = x_BSD.shape[1]
        # Qwen2 keeps the window on the attention (None for its full layers), Mistral only in the config.
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        if cache is not None:
            _check_window(window, P, S)
        if self.mod_kv == "all":
            return self._forward_every_kv(
                x_BSD, attention_mask, position_ids, past_key_values, use_cache, position_embeddings, window, **kwargs
            )
        real_BS, causal = self._routing_inputs(x_BSD, attention_mask, P)
        plan, slot_BC, valid_BC = self._route(x_BSD, real_BS, causal)
        if plan.seq_capacity == 0:  # nothing routed (causal decode, most steps): no attention, nothing stored
            if cache is not None:
                cache.skip(S)
            return self._skipped(x_BSD) if self.mod_part == "layer" else self.mlp_sublayer(self._skipped(x_BSD))

        x_BCD = hf_mask.gather_rows(x_BSD, slot_BC)
        sublayer = super().forward if self.mod_part == "layer" else self.attention_sublayer
        y_BCD = self._sparse_attention_call(
            sublayer,
            x_BCD,
            slot_BC,
            valid_BC,
            cache,
            P,
            S,
            attention_mask,
            position_ids,
            past_key_values,
            use_cache,
            position_embeddings,
            **kwargs,
        )
        out_BSD = self._combine(x_BSD, x_BCD, y_BCD, plan, slot_BC, valid_BC)
        return out_BSD if self.mod_part == "layer" else self.mlp_sublayer(out_BSD)

    def _forward_every_kv(
        self,
        x_BSD: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        past_key_values,
        use_cache: bool | None,
        position_embeddings,
        window: int | None,
        **kwargs,
    ) -> Tensor:
        """``kv="all"``: every token writes its K/V to the model's own dense cache, only routed tokens ask a
        query (``mode.hf.dense.routed_queries``); then the MLP for routed tokens ("layer") or for all ("attention").
        In inference, a call in which every token is routed (a decode step whose token the router takes, at
        batch 1) runs the original forward, and a small decode step in which some rows routed computes every row
        (``_every_row_path``)."""
        attn = self.self_attn
        P = 0
        if past_key_values is not None:
            if isinstance(_cache_layer_at(past_key_values, attn.layer_idx), MoDCacheLayer):
                raise ValueError(
                    "mod kv='all' with a cache a kv='routed' MoD layer already made sparse; start from a new cache"
                )
            P = past_key_values.get_seq_length(attn.layer_idx)
            _check_window(window, P, x_BSD.shape[1])
        real_BS, causal = self._routing_inputs(x_BSD, attention_mask, P)
        plan, slot_BC, valid_BC = self._route(x_BSD, real_BS, causal)
        every = self._every_row_path(plan, valid_BC, x_BSD.shape[1])
        if every is not None:
            return self._forward_every_row(
                x_BSD,
                every,
                valid_BC,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        rows_R = self._asking_rows(plan, valid_BC)
        a_BCD = routed_query_attention(
            attn,
            self.input_layernorm(x_BSD),
            slot_BC,
            valid_BC,
            position_embeddings,
            attention_mask,
            past_key_values,
            P,
            window,
            rows_R,
            **kwargs,
        )
        if plan.seq_capacity == 0:  # nothing routed: the K/V are written, no query asked
            return self._skipped(x_BSD) if self.mod_part == "layer" else self.mlp_sublayer(self._skipped(x_BSD))
        x_BCD = hf_mask.gather_rows(x_BSD, slot_BC)
        x_RCD = x_BCD if rows_R is None else x_BCD.index_select(0, rows_R)
        y_RCD = x_RCD + a_BCD  # (R, C, D): the asking rows only when rows_R is set
        if self.mod_part == "layer":
            y_RCD = self.mlp_sublayer(y_RCD)
        y_BCD = y_RCD if rows_R is None else x_BCD.index_copy(0, rows_R, y_RCD)  # other rows: no update
        out_BSD = self._combine(x_BSD, x_BCD, y_BCD, plan, slot_BC, valid_BC)
        return out_BSD if self.mod_part == "layer" else self.mlp_sublayer(out_BSD)

    def _forward_every_row(self, x_BSD: Tensor, every: str, valid_BC: Tensor, **layer_kwargs) -> Tensor:
        """The ``kv="all"`` layer computed on every row (``_every_row_path``; ``layer_kwargs``: the layer's own
        keyword arguments): ``every`` "all", every token is routed and this is the original layer's forward;
        "rows", a decode step (one token per row) in which some rows routed: the original attention half (every
        row writes its K/V, as ``kv="all"`` does) and, for part "layer", the MLP half run on every row, and the
        rows that did not route keep their input (plus the estimate)."""
        if every == "all":
            return self._original_forward(x_BSD, **layer_kwargs)
        keep_B11 = valid_BC[:, :, None]  # (B, 1, 1): the rows that routed their token
        if self.mod_part == "layer":
            return torch.where(keep_B11, self._original_forward(x_BSD, **layer_kwargs), self._skipped(x_BSD))
        h_BSD = torch.where(keep_B11, self.attention_sublayer(x_BSD, **layer_kwargs), self._skipped(x_BSD))
        return self.mlp_sublayer(h_BSD)

    def _every_row_path(self, plan, valid_BC: Tensor, S: int) -> str | None:
        """May this ``kv="all"`` call compute the layer on every row instead of the routed path, and how?
        Only in inference (no gradient: the router's gradient needs the gate) with a gate whose value is
        exactly 1 ("ste", "one"), on the fast path (``mod_fast_path = False`` keeps the routed path, the
        reference). "all": every token of every row is routed (``C == S``, every slot valid): the routed path
        computes the original layer on every token, which the original forward does in fewer operators (most
        of a batch-1 decode step's cost on a CPU). "rows": a decode step of at most ``mod_dense_decode_rows``
        rows in which some but not all rows routed: computing every row reads the same weights as computing
        the routed rows (a small batch is bound by reading the weights), without gathering rows and their
        K/V cache. None: the routed path."""
        if (
            not self.mod_fast_path
            or S == 0
            or torch.is_grad_enabled()
            or self.mod_router.cfg.gate not in ("ste", "one")
        ):
            return None
        if isinstance(plan, _DecodeStepPlan):
            B = valid_BC.shape[0]
            if len(plan.rows) == B:
                return "all"
            return "rows" if plan.rows and B <= self.mod_dense_decode_rows else None
        return "all" if plan.seq_capacity == S and bool(valid_BC.all()) else None

    def _original_forward(self, x_BSD: Tensor, **layer_kwargs) -> Tensor:
        """The original decoder layer's forward on every token (transformers' own, no routing)."""
        return super().forward(x_BSD, **layer_kwargs)

    def _asking_rows(self, plan, valid_BC: Tensor) -> Tensor | None:
        """The rows with a routed token in a ``kv="all"`` inference call where some rows have none (a decode
        step at batch B: the rows whose token the router took), or None (every row, the reference path, or a
        call that records gradients). Only those rows then compute the query half and the MLP."""
        if not self.mod_fast_path or plan.seq_capacity == 0 or torch.is_grad_enabled():
            return None
        if isinstance(plan, _DecodeStepPlan):  # the rows were read on the host with the scores
            rows = plan.rows
            return None if len(rows) == valid_BC.shape[0] else torch.tensor(rows, device=valid_BC.device)
        any_B = valid_BC.any(1)
        if bool(any_B.all()):
            return None
        return any_B.nonzero().squeeze(1)

    def _routing_inputs(self, x_BSD: Tensor, attention_mask: Tensor | None, P: int) -> tuple[Tensor | None, bool]:
        """``(real_BS, causal)``: which tokens are real (pads never route) and how this call routes."""
        B, S, _ = x_BSD.shape
        hf_mask.check_mask(attention_mask, B, S, P)
        causal = self.mod_causal()
        if not causal and P > 0:
            raise ValueError(
                "mod routing='topk' with a cache that already holds tokens: top-C routing looks at "
                "the whole sequence and cannot decode token by token; use causal routing "
                "(model.eval(), or mode.hf.routing(model, 'causal'))"
            )
        return hf_mask.real_tokens(attention_mask, B, S, P), causal

    def _route(self, x_BSD: Tensor, real_BS: Tensor | None, causal: bool):
        """The router's plan for ``x_BSD`` and its slots: ``slot_BC`` (positions in the call), ``valid_BC``."""
        B, S, _ = x_BSD.shape
        if causal and S == 1 and self.mod_fast_path and not torch.is_grad_enabled():
            return self._route_decode_step(x_BSD, real_BS)
        plan = self.mod_router(x_BSD, real_BS, causal=causal)
        object.__setattr__(self, "mod_aux", plan.aux)  # a plain attribute (nn.Module.__setattr__ is slow)
        C = plan.seq_capacity
        dev = x_BSD.device
        slot_BC = plan.token_idx_A.view(B, C) - torch.arange(B, device=dev)[:, None] * S
        valid_BC = torch.ones(B, C, dtype=torch.bool, device=dev) if plan.valid_A is None else plan.valid_A.view(B, C)
        return plan, slot_BC, valid_BC

    def _route_decode_step(self, x_B1D: Tensor, real_B1: Tensor | None):
        """``_route`` for one token per row with causal routing and no gradient (a decode step), in a handful
        of operators instead of the router's ~100 (``MoDRouter.forward``, the reference: ``mod_fast_path =
        False``): the scores, the decision logits, and one host read of both (and of the pad mask) from which
        the finiteness checks and the routed rows are decided in Python. Its plan has what the layer reads
        (``seq_capacity``, ``weight_A``, ``aux`` with stats built when first read, ``rows``)."""
        router = self.mod_router
        _checks.check_hidden("x", x_B1D, router.cfg.d_model, device=router.weight.device)
        r_B1 = router.scores(x_B1D)
        logit_B1 = router.decision_logits(x_B1D, r_B1, check_threshold=False)
        read = [r_B1, logit_B1] if real_B1 is None else [r_B1, logit_B1, real_B1.to(r_B1.dtype)]
        host = torch.stack(read).view(len(read), -1).tolist()  # the one host read of the step
        scores, logits = host[0], host[1]
        if router.cfg.check_finite and not all(map(math.isfinite, scores)):
            n_bad = sum(not math.isfinite(v) for v in scores)
            raise ValueError(f"MoDRouter: {n_bad} router scores are not finite (NaN or infinite hidden states?)")
        if any(map(math.isnan, logits)):
            router.check_calibrated()  # a threshold never set says so; else the predictor gave NaN
            raise ValueError("MoDRouter: causal decision logits are NaN (the predictor's output)")
        real = [True] * len(logits) if real_B1 is None else [v > 0.5 for v in host[2]]
        rows = [b for b, (v, ok) in enumerate(zip(logits, real, strict=True)) if v > 0 and ok]
        if real_B1 is not None and not all(real):  # pads never route: their logits read -inf in the stats
            logit_B1 = logit_B1.masked_fill(~real_B1, float("-inf"))
        gate = router.cfg.gate
        weight_B1 = r_B1 if gate == "raw" else r_B1.sigmoid() if gate == "sigmoid" else None  # "ste", "one": 1
        aux = Aux()
        aux.stats["router"] = DecodeStats(logit_B1)
        plan = _DecodeStepPlan(1 if rows else 0, None if weight_B1 is None else weight_B1.reshape(-1), aux, rows)
        object.__setattr__(self, "mod_aux", aux)  # a plain attribute: nn.Module.__setattr__ costs a decode step
        B = len(logits)
        if not rows:  # C = 0: no slot at all, as the router's own plan has
            return plan, x_B1D.new_empty((B, 0), dtype=torch.long), x_B1D.new_empty((B, 0), dtype=torch.bool)
        slot_B1 = x_B1D.new_zeros((B, 1), dtype=torch.long)
        if len(rows) == B:
            return plan, slot_B1, x_B1D.new_ones((B, 1), dtype=torch.bool)
        routed = set(rows)
        return plan, slot_B1, torch.tensor([[b in routed] for b in range(B)], device=x_B1D.device)

    def _sparse_attention_call(
        self,
        sublayer,
        x_BCD: Tensor,
        slot_BC: Tensor,
        valid_BC: Tensor,
        cache,
        P: int,
        S: int,
        attention_mask,
        position_ids,
        past_key_values,
        use_cache,
        position_embeddings,
        **kwargs,
    ) -> Tensor:
        """``sublayer`` (the whole layer, or its attention half) on the routed tokens: the model's cos/sin at
        their true positions, its mask restricted to them, the sparse cache holding only routed keys."""
        B, C = slot_BC.shape
        dev = x_BCD.device
        cos, sin = (hf_mask.gather_rows(t, slot_BC) for t in position_embeddings)  # RoPE at the true positions
        pos_BC = None if position_ids is None else hf_mask.gather_rows(position_ids, slot_BC)
        # Key columns, in the order the attention will see them: this row's stored keys, then the C new ones.
        query_col_BC = P + slot_BC
        stored_slot_BL, stored_len_B = (None, None) if cache is None else cache.stored()
        if stored_slot_BL is None:
            cols_BJ, col_ok_BJ, own_col_BC = query_col_BC, valid_BC, torch.arange(C, device=dev).expand(B, C)
        else:
            assert stored_len_B is not None, "MoDCacheLayer.stored: both or neither"
            L = stored_slot_BL.shape[1]
            cols_BJ = torch.cat([stored_slot_BL, query_col_BC], 1)
            col_ok_BJ = torch.cat([torch.arange(L, device=dev) < stored_len_B[:, None], valid_BC], 1)
            own_col_BC = L + torch.arange(C, device=dev).expand(B, C)
        config = cast("PretrainedConfig", self.self_attn.config)  # transformers' attention module keeps its config
        fmt = torch.bool if config._attn_implementation == "sdpa" else x_BCD.dtype
        sub_mask = hf_mask.restrict(
            attention_mask, slot_BC, query_col_BC, cols_BJ, col_ok_BJ, valid_BC, own_col_BC, fmt
        )
        if cache is not None:
            cache.stage(valid_BC, query_col_BC, S)
        try:
            y_BCD = sublayer(
                x_BCD,
                attention_mask=sub_mask,
                position_ids=pos_BC,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=(cos, sin),
                **kwargs,
            )
        except BaseException:
            if cache is not None:
                cache.unstage()  # the cache stays as it was before this call
            raise
        if isinstance(y_BCD, tuple):  # transformers 5.x layers return a bare tensor; older ones a tuple
            y_BCD = y_BCD[0]
        assert cache is None or cache.committed(), "the layer's attention did not write to the MoD cache layer"
        return y_BCD

    def _combine(self, x_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, plan, slot_BC: Tensor, valid_BC: Tensor) -> Tensor:
        """Each routed token gets ``x + g * (y - x)`` and is scattered back; the others pass unchanged."""
        B, C, D = x_BCD.shape
        gate = self.mod_router.cfg.gate
        if gate != "one" and plan.weight_A is not None:  # None: a decode step's gate of value 1 ("ste")
            w_BC1 = plan.weight_A.view(B, C, 1).to(x_BCD.dtype)
            if gate == "ste":  # value exactly 1: y + 0 * (y - x) keeps the layer's output bit for bit
                y_BCD = y_BCD + (w_BC1 - 1) * (y_BCD - x_BCD)
            else:
                y_BCD = x_BCD + w_BC1 * (y_BCD - x_BCD)
        y_BCD = torch.where(valid_BC[..., None], y_BCD, x_BCD)  # unrouted / padding slots make no update
        if self.mod_skip is not None:  # unrouted slots and tokens get the estimate instead
            skip_BSD = self._skipped(x_BSD)
            y_BCD = torch.where(valid_BC[..., None], y_BCD, hf_mask.gather_rows(skip_BSD, slot_BC))
            x_BSD = skip_BSD
        return x_BSD.scatter(1, slot_BC[..., None].expand(B, C, D), y_BCD)

    def _skipped(self, x_BSD: Tensor) -> Tensor:
        """What tokens that skip the part become: unchanged, or plus the estimated update (``mod_skip``)."""
        return x_BSD if self.mod_skip is None else x_BSD + self.mod_skip(x_BSD)


@dataclass
class _DecodeStepPlan:
    """What a MoD layer reads of a decode step's routing (``_route_decode_step``): ``seq_capacity`` (1 when
    a row routed its token, else 0), ``weight_A`` (the gates, None when their value is 1), ``aux``, and
    ``rows`` (the rows that routed their token, read on the host with the scores)."""

    seq_capacity: int
    weight_A: Tensor | None
    aux: Aux
    rows: list[int]


def _check_window(window: int | None, P: int, S: int) -> None:
    if window is not None and P + S > window:
        raise ValueError(
            f"sliding_window={window}: this cached call reaches {P + S} tokens; a MoD layer's "
            "cache needs the whole sequence within the window (the mask switches to window "
            "coordinates once it fills); raise the window or convert full-attention layers only"
        )


def _cache_layer_at(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    return layers[layer_idx] if layers is not None and layer_idx < len(layers) else None


_CLASSES: dict[type, type] = {}


def mod_class(cls: type) -> type:
    """``MoD<cls>``: the converted class of a decoder-layer class (one per original class)."""
    if issubclass(cls, MoDLayerMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"MoD{cls.__name__}", (MoDLayerMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def original_class(cls: type) -> type:
    return (
        next(c for c in cls.__mro__[1:] if not issubclass(c, MoDLayerMixin)) if issubclass(cls, MoDLayerMixin) else cls
    )
