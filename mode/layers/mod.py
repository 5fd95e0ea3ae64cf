"""Mixture-of-Depths wrapper: run any block on the top-C tokens of each sequence, skip the rest.

Shape legend: B batch, S tokens, D hidden, C routed slots per sequence, n rows with a routed token.

For routed tokens ``x <- x + r * (block(x_routed) - x)``: the router weight scales the block's delta,
never the residual. The block sees only the routed tokens (so attention is among routed tokens, causal
in their original order) together with their original positions (so RoPE sees true positions). Skipped
tokens are copied through bit for bit.

The block: any ``nn.Module`` whose ``forward`` takes the routed tokens ``x_BCD`` first and returns ``y_BCD``
(or a tuple whose first element is ``y_BCD``; an ``Aux`` in the tuple is merged). It gets the routed
tokens' original positions ``positions_BC``, the slot mask ``mask_BC`` (None, or True where a slot holds a
real routed token) and, when decoding, ``cache=`` (a ``RowView`` of a
``KVCache``) only where its ``forward`` takes them: ``mode.layers.block_call`` reads that from the signature
once, when the ``MoD`` is built. ``forward(x)``, ``forward(x, positions)``, ``forward(x, positions, mask)`` and
``TransformerBlock``'s ``forward(x, positions_BS=None, mask_BS=None, cache=None)`` all work. A block that takes no
mask treats the slots without a real routed token as tokens (there are some only when the input has padding,
``mask_BS``, or under causal routing, where they come after the real ones): their outputs are discarded, but
attention inside such a block also sees them. KV-cached decoding needs a block that takes the mask and the cache (a
``TypeError`` says so otherwise). ``C`` may be
0 (an empty sequence, or causal routing that routed nothing): by default the block is then skipped,
but ``skip_empty=False`` calls it on the empty ``(B, 0, D)`` input, which a block holding collectives
needs (every rank must enter an expert-parallel all-to-all, whatever its routing).

Decoding (a cache, causal routing, one token per row) has two paths, chosen when the caches are made
(``KVCache.static``; see ``mode.model.generate``):
    dynamic  the decision is read on the host (this layer's one sync); the block runs on the routed rows
             only (``(n, 1, D)``, attending through per-row views of the cache), or not at all
    static   no host sync and static shapes: the block runs on all ``B`` rows with the decision as its
             mask (skipped rows store nothing; compute is not saved), ``torch.where`` keeps skipped rows
In both, a skipped token writes nothing into this layer's cache and the outputs equal the general path's.
"""

from __future__ import annotations

import functools
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.kernels.routed_rows import combine_routed, gather_routed
from mode.layers.block import TransformerBlock
from mode.layers.block_call import block_call
from mode.layers.kv_cache import KVCache
from mode.layers.moe import MoELayer
from mode.routing.mod_topk import MoDRouter
from mode.routing.plan import Aux, RoutingStats, scalar


class MoD(nn.Module):
    """Mixture-of-Depths: the router picks the top ``C = capacity * S`` tokens of each sequence, only those go
    through ``block``, and the rest skip it unchanged (Raposo et al. 2024).

    Shape legend: B batch, S tokens, D hidden, C routed tokens per sequence.

    A routed token gets ``x + r * (block(x_routed) - x)`` with the router's raw weight ``r`` (its ``gate``:
    "raw", "sigmoid", "ste", or "one", which takes the block's output as is); the block sees only the routed
    tokens, in their original order, with their original positions.

    Args:
        block: the block to route around, any ``nn.Module`` called ``block(x_BCD) -> y_BCD``; it also gets the
            positions, the slot mask and the KV cache where its ``forward`` takes them (the module doc;
            ``mode.layers.block_call``), and may return ``(y_BCD, Aux)``.
        router: the ``MoDRouter`` that scores the tokens and holds the capacity and the causal method.
        skip_empty: skip the block when a call routes no token (the default); False calls it on the empty
            ``(B, 0, D)`` input (a block holding collectives every rank must enter).

    Example::

        class MyBlock(nn.Module):  # a block you wrote; it needs no positions, mask or cache
            def __init__(self, d):
                super().__init__()
                self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

            def forward(self, x):
                return x + self.mlp(x)

        mod = MoD(MyBlock(64), MoDRouter(MoDRouterConfig(d_model=64, capacity=0.125)))
        y_BSD, aux = mod(torch.randn(2, 128, 64))  # 16 tokens of each sequence go through MyBlock
    """

    def __init__(self, block: nn.Module, router: MoDRouter, skip_empty: bool = True):
        super().__init__()
        if not isinstance(router, MoDRouter):
            raise TypeError(f"router={type(router).__name__}: must be a MoDRouter")
        if not isinstance(block, nn.Module):
            raise TypeError(f"block={type(block).__name__}: must be an nn.Module")
        self.block = block
        self.router = router
        self.block_call = block_call(block)  # what the block takes (positions, mask, cache): decided here, once
        takes = self.block_call.takes
        self._decode_problem = (
            None
            if {"cache", "mask"} <= takes
            else (
                f"cache: KV-cached decoding passes the block its rows of the cache (cache=) and the mask of the slots "
                f"that hold routed tokens (skipped ones must store nothing), and {self.block_call.signature} takes no "
                f"{' and no '.join(n for n in ('mask', 'cache') if n not in takes)} parameter. A block that attends "
                "across tokens must read and extend the cache, as TransformerBlock does (forward(x, positions_BS=None, "
                "mask_BS=None, cache=None)); a block that works on each token alone can take cache=None and "
                "mask_BS=None and ignore them. Without a cache (training, a full forward, causal=True) any block works"
            )
        )
        self.scale_delta = router.cfg.gate != "one"  # gate "one": routed tokens take the block output as is
        # Skip the block when no token is routed (decoding: most steps), unless the block holds collectives;
        # mode.parallel turns this off for blocks it makes expert-parallel.
        self.skip_empty = _checks.check_bool("skip_empty", skip_empty)
        # Decoding fuses the router and the predictor's matmuls when the predictor has its built shape (kept
        # in a tuple, so its linears are not registered twice).
        pred = router.predictor
        bare = (
            pred is not None
            and len(pred) == 3
            and type(pred[0]) is nn.Linear
            and type(pred[1]) is nn.SiLU
            and type(pred[2]) is nn.Linear
            and pred[0].bias is not None
            and pred[2].bias is not None
            and pred[2].out_features == 1
        )
        self._bare_predictor: tuple[nn.Linear, nn.Linear] | None = (
            (cast(nn.Linear, pred[0]), cast(nn.Linear, pred[2]))
            if bare and pred is not None
            else None  # `bare`: checked
        )
        self._fused_key: tuple | None = None
        self._fused: tuple[Tensor, ...] | None = None

    def forward(
        self,
        x_BSD: Tensor,
        mask_BS: Tensor | None = None,
        *,
        positions_BS: Tensor | None = None,
        cache: KVCache | None = None,
        causal: bool = False,
    ) -> tuple[Tensor, Aux]:
        """Route ``x_BSD``, run the block on the routed tokens, and put its outputs back in their places.

        Args:
            x_BSD: the hidden states.
            mask_BS: None, or False at padding (never routed unless a row has fewer than C real tokens).
            positions_BS: the tokens' positions (default ``0 .. S-1``), passed on to the block for RoPE.
            cache: this layer's ``KVCache``: the routed tokens' keys and values are appended to it (skipped
                tokens write nothing); needs a block that takes ``cache`` and the mask.
            causal: route each token by the router's causal decision instead of the top-C of its sequence
                (sampling; the router needs a causal method, see ``MoDRouter``).

        Returns:
            ``(y_BSD, aux)``: the updated hidden states (skipped tokens bit for bit unchanged) and the router's
            losses and stats under "mod.", merged with the block's own ``Aux``.
        """
        if cache is not None and self._decode_problem is not None:
            raise TypeError(self._decode_problem)
        if cache is not None and causal and mask_BS is None and x_BSD.shape[1] == 1:
            return self._decode(x_BSD, positions_BS, cache)
        # a top-C call leaves the scores' finite check to the write back below, which reads every score anyway
        defer = not causal and self.router.cfg.check_finite
        plan = self.router(x_BSD, mask_BS, causal=causal, defer_check=defer)  # validates x
        aux = Aux().merge(plan.aux, "mod.")
        B, S, D = x_BSD.shape
        C = plan.seq_capacity
        r_BS = plan.scores_BS
        if C == 0 and self.skip_empty:  # an empty sequence, or causal routing sent no token through the block
            if defer and r_BS is not None:
                _checks.check_finite_via("MoDRouter", r_BS)
            return x_BSD, aux
        slot_BC = plan.seq_pos_BC
        if slot_BC is None:
            slot_BC = plan.token_idx_A.view(B, C) - torch.arange(B, device=x_BSD.device)[:, None] * S
        pos_BC = slot_BC if positions_BS is None else positions_BS.gather(1, slot_BC)
        valid_BC = None if plan.valid_A is None else plan.valid_A.view(B, C)
        cache_rows = None if cache is None else cache.all_rows()
        if r_BS is not None:  # the fused ops (mode.kernels.routed_rows): one op each way for the gather, one for
            # the gated write back; on the CPU the very ops of the path below, bit for bit
            x_BCD, x_keep_BSD = gather_routed(x_BSD, slot_BC)
            # with a cache: every row, through views of the cache; rows with no routed token store nothing
            y_BCD, block_aux = self.block_call(self.block, x_BCD, pos_BC, valid_BC, cache_rows)
            gate = self.router.cfg.gate if self.scale_delta else "one"
            y_BSD, finite = combine_routed(x_keep_BSD, x_BCD, y_BCD, r_BS, slot_BC, valid_BC, gate)
            if defer:
                _checks.check_finite_flag("MoDRouter", finite, r_BS)
            return y_BSD, aux.merge(block_aux)
        # a plan without the scores (made by another router): the composed ops
        index_BCD = slot_BC[..., None].expand(B, C, D)
        x_BCD = x_BSD.gather(1, index_BCD)
        y_BCD, block_aux = self.block_call(self.block, x_BCD, pos_BC, valid_BC, cache_rows)
        if self.scale_delta:
            y_BCD = x_BCD + plan.weight_A.view(B, C, 1).to(x_BCD.dtype) * (y_BCD - x_BCD)
        if valid_BC is not None:
            y_BCD = torch.where(valid_BC[..., None], y_BCD, x_BCD)  # unrouted / padding slots make no update
        return x_BSD.scatter(1, index_BCD, y_BCD), aux.merge(block_aux)

    # ------------------------------------------------------------------------------------------ decoding

    def _decode(self, x_B1D: Tensor, positions_B1: Tensor | None, cache: KVCache) -> tuple[Tensor, Aux]:
        """One token per row with causal routing (a decode step). The cache chose the path when it was made:
        ``cache.static`` decides on the device and never makes the host wait; otherwise (the dynamic path)
        the decision is read on the host once, and only the routed rows do any work."""
        router = self.router
        _checks.check_hidden("x", x_B1D, router.cfg.d_model, device=router.weight.device)
        if router.cfg.causal == "none":
            raise ValueError(
                "causal=True: this MoD router was built with causal='none'; build it with "
                "causal='predictor' or 'aux_bce' to route causally"
            )
        if positions_B1 is None:
            positions_B1 = torch.zeros(x_B1D.shape[0], 1, dtype=torch.long, device=x_B1D.device)
        r_BX, logits_BK = self._decide(x_B1D)
        if cache.static:
            return self._decode_static(x_B1D, positions_B1, cache, r_BX, logits_BK)
        return self._decode_dynamic(x_B1D, positions_B1, cache, r_BX, logits_BK)

    def _decide(self, x_B1D: Tensor) -> tuple[Tensor, Tensor]:
        """``(r_BX, logits_BK)``: the router logit ``r`` (the gate's input) in column 0 of ``r_BX``, and K = 1 or
        2 float32 columns whose last is the causal decision logit (routed where > 0) and whose first is
        finite exactly where ``r`` is (``r`` itself, or ``silu(r)``). One host read of ``logits_BK`` gives the
        decisions and the NaN check together.

        Reference: ``router.scores`` then ``router.decision_logits`` (with autograd, under autocast, for a
        predictor of another shape, or a decision that is not the predictor's logit alone: capacity 1.0, a
        steered threshold). Fast path (no grad, float32, the built predictor): the router vector
        and the predictor's first layer as one matmul, and a second matmul that gives the decision and
        passes ``silu(r)`` through: 3 kernels instead of 6. In a decode step each kernel runs cold (the
        dense layer before it evicted the caches), so kernels, not FLOPs, are a skipped layer's cost.
        """
        fused = (
            self._fused_router_weights()
            if self._bare_predictor and self.router.plain_decision and not torch.is_grad_enabled()
            else None
        )
        if fused is None or torch.is_autocast_enabled(x_B1D.device.type) or x_B1D.dtype != torch.float32:
            r_B1 = self.router.scores(x_B1D)
            decide_B1 = self.router.decision_logits(x_B1D, r_B1)
            return r_B1, (r_B1 if decide_B1 is r_B1 else torch.cat([r_B1, decide_B1], 1))
        w_in, b_in, w_out, b_out = fused
        h_BH = F.linear(x_B1D.reshape(x_B1D.shape[0], -1), w_in, b_in)  # column 0: r, then the hidden layer
        return h_BH, F.linear(F.silu(h_BH), w_out, b_out)  # [silu(r), decision logit]

    def _fused_router_weights(self) -> tuple[Tensor, ...] | None:
        """``(w_in, b_in, w_out, b_out)`` for ``_decide``'s fast path, rebuilt whenever a parameter changed
        (its version counter or storage), or None unless every router parameter is float32."""
        assert self._bare_predictor is not None, "_fused_router_weights: called only with a bare predictor"
        lin1, lin2 = self._bare_predictor
        params = (self.router.weight, lin1.weight, lin1.bias, lin2.weight, lin2.bias)
        key = tuple((p._version, p.data_ptr()) for p in params)  # a dtype or device change moves the data
        if key != self._fused_key:
            self._fused_key = key
            self._fused = None
            if all(p.dtype == torch.float32 for p in params):
                with torch.no_grad():
                    w, hidden = self.router.weight, lin1.weight.shape[0]
                    w_in = torch.cat([w[None], lin1.weight]).contiguous()
                    b_in = torch.cat([w.new_zeros(1), lin1.bias])
                    w_out = w.new_zeros(2, 1 + hidden)
                    w_out[0, :1].fill_(1.0)  # passes silu(r) through, for the finite check
                    w_out[1, 1:] = lin2.weight[0]
                    b_out = torch.cat([w.new_zeros(1), lin2.bias])
                self._fused = (w_in, b_in, w_out, b_out)
        return self._fused

    def _gate(self, r_BX: Tensor, dtype: torch.dtype) -> Tensor:
        """The (B, 1, 1) weight of the block's delta, from the router logit in column 0 of ``r_BX``."""
        r_B11 = r_BX[:, :1, None]
        return (r_B11 if self.router.cfg.gate == "raw" else r_B11.sigmoid()).to(dtype)

    def _decode_static(
        self, x_B1D: Tensor, pos_B1: Tensor, cache: KVCache, r_BX: Tensor, logits_BK: Tensor, aux: Aux | None = None
    ) -> tuple[Tensor, Aux]:
        """No host sync, static shapes: the block runs on every row (compute is not saved), with the routing
        decision as its mask, so skipped rows store nothing in the cache; ``torch.where`` keeps their input."""
        if aux is None:
            if self.router.cfg.check_finite:
                _checks.check_finite_logits("MoDRouter", logits_BK[:, :1])  # queued on the device: no host read
            aux = self._decode_aux(logits_BK)
        routed_B1 = logits_BK[:, -1:] > 0
        y_B1D, block_aux = self.block_call(self.block, x_B1D, pos_B1, routed_B1, cache.all_rows())
        if self.scale_delta:
            y_B1D = x_B1D + self._gate(r_BX, x_B1D.dtype) * (y_B1D - x_B1D)
        y_B1D = torch.where(routed_B1[..., None], y_B1D, x_B1D)
        return y_B1D, aux.merge(block_aux)

    def _decode_dynamic(
        self, x_B1D: Tensor, pos_B1: Tensor, cache: KVCache, r_BX: Tensor, logits_BK: Tensor
    ) -> tuple[Tensor, Aux]:
        """One host read of the decisions (and the router logits, checked for NaN/inf on the host); then the
        block runs only on the routed rows, or not at all. Skipped rows do no work and store nothing."""
        host = logits_BK.tolist()  # the one host sync of this layer's step
        if self.router.cfg.check_finite and not all(math.isfinite(row[0]) for row in host):
            bad = sum(not math.isfinite(row[0]) for row in host)
            raise ValueError(
                f"MoDRouter: {bad} router logits are NaN or inf; router logits must be finite "
                "(check the input hidden states x and the learning rate)"
            )
        rows = [b for b, row in enumerate(host) if row[-1] > 0]
        B = len(host)
        aux = self._decode_aux(logits_BK)
        if not rows:
            if self.skip_empty:
                return x_B1D, aux
            # the block holds collectives every rank must enter: call it on every row, storing nothing
            return self._decode_static(x_B1D, pos_B1, cache, r_BX, logits_BK, aux)
        if len(rows) == B:  # every row routed (always so at batch 1): no indexing at all
            x_n1D, pos_n1, r_nX, view = x_B1D, pos_B1, r_BX, cache.all_rows()
        else:
            view = cache.rows(rows)
            rows_t = cast(Tensor, view.rows_t)  # a view of a host list holds its device copy
            x_n1D, pos_n1, r_nX = (t.index_select(0, rows_t) for t in (x_B1D, pos_B1, r_BX))
        y_n1D, block_aux = self.block_call(self.block, x_n1D, pos_n1, None, view)
        if self.scale_delta:
            y_n1D = x_n1D + self._gate(r_nX, x_n1D.dtype) * (y_n1D - x_n1D)
        y_B1D = y_n1D if len(rows) == B else x_B1D.index_copy(0, cast(Tensor, view.rows_t), y_n1D)
        return y_B1D, aux.merge(block_aux)

    @staticmethod
    def _decode_aux(logits_BK: Tensor) -> Aux:
        """The router's stats for a decode step (as ``MoDRouter`` reports them for causal routing), built
        when first read: a decode step never reads them."""
        aux = Aux()
        aux.stats["mod.router"] = DecodeStats(logits_BK)
        return aux


class DecodeStats(RoutingStats):
    """``RoutingStats`` of one causal decode step at a MoD layer, each field computed on first access (on
    the device) from the decision logits, the last column of ``logits_BK`` (routed where > 0)."""

    def __init__(self, logits_BK: Tensor):  # not the dataclass __init__: the fields are cached properties
        self._logits_BK = logits_BK
        self.entropy = None
        self.causal_accuracy = None
        self.batch_shape = (logits_BK.shape[0], 1)

    @functools.cached_property
    def compute_T(self) -> Tensor:
        return (self._logits_BK[:, -1] > 0).float()

    @functools.cached_property
    def kept_E(self) -> Tensor:
        return self.compute_T.sum().reshape(1)

    @functools.cached_property
    def tokens(self) -> Tensor:
        return scalar(self.batch_shape[0], self._logits_BK.device)

    @functools.cached_property
    def noop(self) -> Tensor:
        return self.tokens - self.kept_E[0]

    @functools.cached_property
    def requested_X(self) -> Tensor:
        return torch.stack([self.kept_E[0], self.noop])  # [block, skip]: skipping is the no-op

    @functools.cached_property
    def dropped(self) -> Tensor:
        return torch.zeros((), device=self._logits_BK.device)


class StagedMoDE(MoD):
    """Staged MoDE (Raposo et al. 2024, sec. 5): MoD routing in front of a block whose MLP is an MoE.

    Skipped tokens skip attention *and* the experts; routed tokens then go through the MoE router. A ``MoD``
    whose block must be a ``TransformerBlock`` with a ``MoELayer`` as its MLP; its call and return are
    ``MoD``'s (the MoE's losses and stats come back under "moe.").

    Shape legend: B batch, S tokens, D hidden, C routed tokens per sequence.

    Args:
        block: a ``TransformerBlock`` whose ``mlp`` is a ``MoELayer``.
        router: the ``MoDRouter`` in front of it.
        skip_empty: as in ``MoD``.
    """

    def __init__(self, block: TransformerBlock, router: MoDRouter, skip_empty: bool = True):
        if not isinstance(getattr(block, "mlp", None), MoELayer):
            raise TypeError(
                f"block.mlp={type(getattr(block, 'mlp', None)).__name__}: staged MoDE needs a "
                "TransformerBlock whose mlp is a MoELayer"
            )
        super().__init__(block, router, skip_empty)
