"""A per-layer KV cache for a converted MoD layer inside transformers' ``Cache`` (``generate()`` included).

Shape legend: B batch (rows; beams count as rows), H key/value heads, L stored keys (the widest row),
K head dim, C routed slots of one call.

A row stores only the keys and values of the tokens it routed through the layer, packed in order, with
``len_B`` (how many each row holds) and ``slot_BL`` (the dense position of each stored key, in the cache's
coordinates, pads included). Keys are stored already rotated (RoPE at the token's true position), as
transformers stores them. What the layer *reports* is the dense length, the number of tokens the model has
seen: ``generate()`` slices its inputs by it, the model derives default positions from it, and the mask is
sized by it, so every layer of the cache must agree on it (see docs/hf.md, "traps").

One call of the MoD layer: ``stage()`` hands over which new slots are real and their dense positions; the
attention's own ``cache.update(k, v, layer_idx)`` then returns the stored keys followed by the C new ones
(the key columns the MoD layer's mask was built for) and appends the real new ones to each row. A call that
routes nothing calls ``skip()``: the dense length grows and nothing is written.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer


class MoDCacheLayer(DynamicLayer):
    """The sparse KV cache of one converted MoD layer (``to_mod(kv="routed")``): each row stores the keys and
    values of only the tokens it routed through the layer, while reporting the dense length (every token the
    model has seen) to ``generate()``. It replaces transformers' layer of a ``Cache`` for that layer; the MoD
    layer ``stage()``s each call's real slots before the attention's ``update``. It cannot be cropped, so
    assisted and speculative decoding are refused.

    Shape legend: B rows (beams count as rows), H key/value heads, L stored keys (the widest row), K head dim.

    Args:
        sliding_window: the layer's sliding window, or None for full attention (``get_max_length`` reports it).
    """

    is_croppable = False  # tells generate() not to roll it back (assisted decoding needs crop: refused)

    def __init__(self, sliding_window: int | None = None):
        super().__init__()
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # keeps transformers' per-layer classification of the cache
        self.dense_len = 0
        self.len_B: Tensor | None = None
        self.slot_BL: Tensor | None = None
        self._staged: tuple[Tensor, Tensor, int] | None = None

    # -- what the MoD layer calls --
    def stored(self) -> tuple[Tensor | None, Tensor | None]:
        """``(slot_BL, len_B)`` before this call, or ``(None, None)`` while nothing was ever stored."""
        return self.slot_BL, self.len_B

    def stage(self, valid_BC: Tensor, slot_BC: Tensor, seq_len: int) -> None:
        """The next ``update`` writes the real (``valid_BC``) slots at dense positions ``slot_BC`` and
        advances the dense length by ``seq_len``."""
        assert self._staged is None, "MoDCacheLayer: a staged write was never committed"
        self._staged = (valid_BC, slot_BC, seq_len)

    def unstage(self) -> None:
        """Drop a staged write the attention never made (its call raised)."""
        self._staged = None

    def skip(self, seq_len: int) -> None:
        """A call that routed no token: the model saw ``seq_len`` more tokens, this layer stores none."""
        self.dense_len += seq_len

    def committed(self) -> bool:
        """Whether no staged write is waiting for the attention's ``update``."""
        return self._staged is None

    # -- transformers' cache-layer interface --
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Start empty stores from the first call's keys and values: (B, H, 0, K) keys and values in their dtype and on
        their device, ``len_B`` zeros, an empty ``slot_BL`` (the first ``update`` calls it)."""
        B, H, _, K = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(B, H, 0, K)
        self.values = value_states.new_zeros(B, value_states.shape[1], 0, value_states.shape[3])
        self.len_B = torch.zeros(B, dtype=torch.long, device=self.device)
        self.slot_BL = torch.zeros(B, 0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write the staged call (``stage``): returns ``(keys, values)``, each row's stored keys and values (padded to
        the widest row, L) followed by the C new ones, what the routed queries attend over; then appends the real new
        slots to their rows and advances the dense length. Raises ``RuntimeError`` when nothing was staged."""
        if self._staged is None:
            raise RuntimeError(
                "MoDCacheLayer.update was called without a staged write: only a layer converted "
                "by mode.hf.to_mod can write to this cache layer"
            )
        valid_BC, slot_BC, seq_len = self._staged
        self._staged = None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None, "MoDCacheLayer: set by lazy_initialization"
        assert self.len_B is not None and self.slot_BL is not None, "MoDCacheLayer: set by lazy_initialization"
        # What the routed queries attend over: each row's stored keys (padding past len_B), then the new ones.
        keys_out = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        values_out = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)

        count_B = valid_BC.sum(1)
        new_len_B = self.len_B + count_B
        width = int(new_len_B.max()) if new_len_B.numel() else 0  # host sync: the widest row after this call
        grow = width - self.keys.shape[2]
        if grow > 0:
            self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, grow))
            self.values = torch.nn.functional.pad(self.values, (0, 0, 0, grow))
            self.slot_BL = torch.nn.functional.pad(self.slot_BL, (0, grow))
        row_n, col_n = valid_BC.nonzero(as_tuple=True)
        dest_BC = self.len_B[:, None] + valid_BC.long().cumsum(1) - 1  # real slots go after the row's stored ones
        dest_n = dest_BC[row_n, col_n]
        self.keys[row_n, :, dest_n] = key_states[row_n, :, col_n].to(self.keys.dtype)
        self.values[row_n, :, dest_n] = value_states[row_n, :, col_n].to(self.values.dtype)
        self.slot_BL[row_n, dest_n] = slot_BC[row_n, col_n]
        self.len_B = new_len_B
        self.dense_len += seq_len
        return keys_out, values_out

    def get_seq_length(self) -> int:
        """The dense length: every token the model has seen, routed here or not."""
        return self.dense_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for transformers' mask: the dense length after this call, ``dense_len +
        query_length``, and 0."""
        return self.dense_len + query_length, 0

    def get_max_length(self) -> int:
        """The sliding window, or -1 (no limit) for full attention."""
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        """Empty the cache: nothing stored, the dense length 0, no staged write."""
        super().reset()
        self.dense_len = 0
        self.len_B = self.slot_BL = None
        self._staged = None

    def crop(self, tokens_to_remove: int) -> None:
        """Refuse (``ValueError``) every crop but one of 0 tokens: the sparse cache cannot be rolled back."""
        if tokens_to_remove == 0:
            return
        raise ValueError(
            f"crop({tokens_to_remove}): a MoD layer's sparse KV cache cannot be cropped (it does not "
            "keep which dense tokens it dropped in a way a rollback could undo), so assisted and "
            "speculative decoding are not supported with mode.hf MoD layers"
        )

    def _rows(self, fn) -> None:
        if not self.is_initialized:
            return  # nothing stored yet: every row is empty, whatever the batch becomes
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.len_B, self.slot_BL = fn(self.len_B), fn(self.slot_BL)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the rows by ``beam_idx`` (beam search): the stored keys, values, lengths and positions alike."""
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (``generate()`` expanding the batch for beams or samples)."""
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep the rows ``indices`` only."""
        self._rows(lambda t: t[indices])

    # -- statistics --
    def stored_tokens(self) -> Tensor:
        """How many tokens each row stores (``len_B``); an empty tensor while nothing was ever stored."""
        return self.len_B if self.len_B is not None else torch.zeros(0, dtype=torch.long)


def mod_cache_layer(cache: object, layer_idx: int) -> MoDCacheLayer:
    """The MoD cache layer at ``layer_idx`` of ``cache``, installed in place of transformers' own the first
    time the converted layer meets this cache. Refuses caches whose layout it cannot keep sparse."""
    if not isinstance(cache, Cache):
        raise ValueError(
            f"past_key_values={type(cache).__name__}: MoD layers need a transformers Cache (a DynamicCache)"
        )
    if getattr(cache, "offloading", False):
        raise ValueError(
            "past_key_values: an offloading cache is not supported by MoD layers; use a plain DynamicCache"
        )
    if cache.layer_class_to_replicate is not None:  # a DynamicCache built without a config grows lazily
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(cache.layers):
        raise ValueError(f"past_key_values has {len(cache.layers)} layers: none for layer {layer_idx}")
    layer = cache.layers[layer_idx]
    if isinstance(layer, MoDCacheLayer):
        return layer
    kind = type(layer)
    if kind not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise ValueError(
            f"past_key_values.layers[{layer_idx}]={kind.__name__}: MoD layers need a DynamicCache "
            "(static, quantized and offloaded caches preallocate or transform every token's keys, "
            "which a sparse per-row cache cannot); generate with the default cache_implementation"
        )
    layer = cast(DynamicLayer, layer)  # one of the two kinds, checked above
    if layer.get_seq_length() > 0:
        raise ValueError(
            f"past_key_values.layers[{layer_idx}] already holds {layer.get_seq_length()} tokens "
            "written before the layer was converted to MoD; start from an empty cache"
        )
    new = MoDCacheLayer(sliding_window=getattr(layer, "sliding_window", None))
    cache.layers[layer_idx] = new
    return new
