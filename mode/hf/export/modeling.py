"""mode's LM as a transformers model: ``ModeConfig`` + ``ModeForCausalLM``, for the layers no standard family
computes exactly (MoD, staged and integrated MoDE, expert choice, copy/constant no-op experts, capacity limits,
mixed layer patterns). ``mode.hf.export_transformers`` writes such a folder; transformers loads it with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` (the folder's ``modeling_mode.py``
imports this module, so ``mode`` must be installed), or without ``trust_remote_code`` in a process that has
imported ``mode.hf.export`` (the Auto classes are registered on import).

Shape legend: B batch, S tokens, V vocabulary.

What it computes is ``mode.model.LM``'s forward, unchanged: the weights are the LM's, under ``model.``.
    routing     MoD layers route every token by their causal decision (``causal_routing``, what ``mode sample``
                sees: a logit never depends on a later token) when the model was trained with causal routing;
                otherwise by the top-C of the sequence, as in training (then ``generate`` raises)
    padding     an ``attention_mask`` may hold padding on either side: each row's tokens are moved to the front,
                run with mode's padding mask, and the logits put back in their columns
    generate()  mode's own per-layer KV caches (``ModeCache``): a MoD layer stores only the tokens routed
                through it, exactly as ``mode.model.generate``; greedy decoding gives its tokens
    losses      ``labels`` give the mean next-token cross-entropy; with ``output_router_logits`` (config or
                call) the routers' weighted aux losses (``Aux.total()``) are added, as transformers' MoE
                families add theirs, and returned as ``aux_loss``
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from mode.model.config import LMConfig
from mode.model.lm import LM

MODEL_TYPE = "mode_lm"


class ModeConfig(PretrainedConfig):
    """The config of a ``ModeForCausalLM``: mode's ``LMConfig`` as a dict (``lm``) and how MoD layers route.

    Args:
        lm: the ``LMConfig`` fields (``dataclasses.asdict`` of it).
        causal_routing: MoD layers route by their causal decision (True) or the sequence's top-C (False).
        output_router_logits: add the routers' aux losses to the loss (transformers' MoE convention).
        kwargs: ``PretrainedConfig``'s own fields.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        lm: dict | None = None,
        causal_routing: bool = False,
        output_router_logits: bool = False,
        **kwargs,
    ):
        self.lm = dict(lm or {})
        self.causal_routing = causal_routing
        self.output_router_logits = output_router_logits
        cfg = self.lm_config()
        # the names transformers and tools read (lm-eval: max_position_embeddings; generate: vocab_size)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.num_attention_heads = cfg.n_heads
        self.max_position_embeddings = cfg.seq_len
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        super().__init__(**kwargs)

    def lm_config(self) -> LMConfig:
        """The ``LMConfig`` this config holds (JSON lists back to tuples)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in self.lm.items()}
        return LMConfig(**fields)

    @classmethod
    def from_lm_config(cls, cfg: LMConfig, **kwargs) -> ModeConfig:
        """The config of ``cfg``; MoD layers route causally where every layer of ``cfg`` can (a causal decision
        trained, no expert choice, no capacity drops)."""
        from mode.model.generate import causal_problem

        causal = cfg.uses_mod and causal_problem(cfg) is None
        return cls(lm=_json_safe(dataclasses.asdict(cfg)), causal_routing=causal, **kwargs)


def _json_safe(value) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class ModeCache:
    """mode's per-layer KV caches for ``generate()``, and each row's count of tokens fed so far (the next
    token's position). Made by ``ModeForCausalLM`` when ``generate`` prepares its cache (it knows the longest
    sequence, ``capacity``, then); the caches themselves on the first call, for its rows. ``get_seq_length``:
    the longest row's count."""

    is_compileable = False

    def __init__(self, model: LM, capacity: int):
        self.model, self.capacity = model, capacity
        self.layers: list = []
        self.seen_B = torch.zeros(0, dtype=torch.long)
        self.started = False

    def start(self, batch: int) -> None:
        """Make the caches for ``batch`` rows (the prompts as ``generate`` expanded them: beams, returned
        sequences)."""
        device = self.model.embed.weight.device
        self.layers = self.model.new_caches(batch, self.capacity, static=device.type == "cuda")
        self.seen_B = torch.zeros(batch, dtype=torch.long, device=device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The most tokens any row has fed (a host read)."""
        return int(self.seen_B.max()) if self.started else 0

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: row ``b`` continues beam ``beam_idx[b]`` (every layer's keys, values and lengths)."""
        for layer in self.layers:
            layer.reorder_rows(beam_idx)
        self.seen_B = self.seen_B.index_select(0, beam_idx.to(self.seen_B.device))

    def crop(self, max_length: int) -> None:
        """Assisted decoding's rollback: not supported (a MoD layer's cache holds only its routed tokens)."""
        raise ValueError(
            "ModeCache.crop: assisted (speculative) decoding is not supported by ModeForCausalLM; generate without "
            "assistant_model / prompt_lookup_num_tokens"
        )


class ModeForCausalLM(PreTrainedModel, GenerationMixin):
    """mode's ``LM`` behind transformers' causal-LM interface (module doc): ``forward``, ``generate``,
    ``save_pretrained``/``from_pretrained``, the Auto classes, ``Trainer`` and peft.

    Args:
        config: a ``ModeConfig``.
    """

    config_class = ModeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock", "MoD", "StagedMoDE"]
    _supports_sdpa = True
    accepts_loss_kwargs = False  # the loss is a mean over the batch's tokens: Trainer scales it for accumulation

    def __init__(self, config: ModeConfig):
        super().__init__(config)
        self.model = LM(config.lm_config())
        if config.tie_word_embeddings != self.model.cfg.tie_embeddings:
            raise ValueError(
                f"tie_word_embeddings={config.tie_word_embeddings}: must equal the LM's "
                f"tie_embeddings={self.model.cfg.tie_embeddings}"
            )
        self.post_init()

    @property
    def _tied_weights_keys(self):  # transformers 5: {tied: source}
        return {"model.head.weight": "model.embed.weight"} if self.model.cfg.tie_embeddings else {}

    def _init_weights(self, module) -> None:
        """The buffers no folder holds get their built values (``reset_buffers``: transformers allocates them
        empty when it loads on the meta device); the weights are ``LM``'s own initialization or the folder's."""
        reset = getattr(module, "reset_buffers", None)
        if callable(reset) and module is not self:
            reset()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # generate() must not make a DynamicCache: ModeCache
        return False

    def get_input_embeddings(self):
        """The token embedding (``model.embed``)."""
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        """Replace the token embedding."""
        self.model.embed = cast(nn.Embedding, value)

    def get_output_embeddings(self):
        """The output projection (``model.head``)."""
        return self.model.head

    def set_output_embeddings(self, value) -> None:
        """Replace the output projection."""
        self.model.head = cast(nn.Linear, value)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ) -> None:
        if generation_config.use_cache is False or model_kwargs.get("past_key_values") is not None:
            return
        model_kwargs["past_key_values"] = ModeCache(self.model, max_cache_length)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: ModeCache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        """Logits of ``input_ids`` (B, S); see the module doc for routing, padding, caches and losses.

        Args:
            input_ids: token ids (B, S).
            attention_mask: 1 at real tokens, 0 at padding (either side of each row's tokens).
            position_ids: ignored: positions are each row's count of real tokens (RoPE).
            past_key_values: a ``ModeCache`` (``generate`` makes it).
            inputs_embeds: not supported (``ValueError``): mode's layers route on token ids' embeddings only.
            labels: next-token targets (B, S), -100 ignored; shifted inside, as transformers does.
            use_cache: accepted; caches come from ``generate`` (a ``ModeCache``) or are passed in.
            output_router_logits: add the routers' aux losses to the loss (default: the config's).
            logits_to_keep: keep only the last this many positions' logits (0: all).
            return_dict: accepted (always a ``MoeCausalLMOutputWithPast``).
            kwargs: further transformers arguments, ignored.

        Returns:
            ``MoeCausalLMOutputWithPast`` with ``logits`` (B, S', V), ``loss``, ``aux_loss``, ``past_key_values``.
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: not supported by ModeForCausalLM; pass input_ids")
        if input_ids is None:
            raise ValueError("input_ids: required")
        B, S = input_ids.shape
        mask_BS = None if attention_mask is None else attention_mask.to(torch.bool)
        if mask_BS is not None and mask_BS.shape != (B, S) and past_key_values is not None:
            mask_BS = mask_BS[:, -S:]  # generate() passes the whole sequence's mask
        if mask_BS is not None and bool(mask_BS.all()):
            mask_BS = None
        cache = past_key_values
        if cache is not None and not isinstance(cache, ModeCache):
            raise TypeError(f"past_key_values={type(cache).__name__}: must be a ModeCache (made by generate())")
        if cache is None:
            logits_BSV, aux = self._run(input_ids, mask_BS, None, self.config.causal_routing)
        else:
            logits_BSV, aux = self._run_cached(input_ids, mask_BS, cache)
        want_aux = self.config.output_router_logits if output_router_logits is None else output_router_logits
        aux_loss = aux.total() if want_aux else None
        loss = None
        if labels is not None:
            shift_BSV = logits_BSV[:, :-1].float()
            target = labels[:, 1:].to(logits_BSV.device)
            loss = F.cross_entropy(shift_BSV.reshape(-1, shift_BSV.shape[-1]), target.reshape(-1), ignore_index=-100)
            if aux_loss is not None:
                loss = loss + aux_loss.to(loss.device)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits_BSV = logits_BSV[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, Tensor):
            logits_BSV = logits_BSV[:, logits_to_keep]
        past = cast(Any, cache)  # not a transformers Cache: generate() hands it back as it is
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits_BSV, past_key_values=past)

    def _run(self, ids_BS: Tensor, mask_BS: Tensor | None, caches, causal: bool):
        """The LM on ``ids_BS``; padding (``mask_BS`` False) moved behind each row's tokens and back."""
        if mask_BS is None:
            out = self.model(ids_BS, caches=caches, causal_routing=causal)
            return out.logits_BSV, out.aux
        order_BS = _real_first(mask_BS)
        n_B = mask_BS.sum(1)
        packed_mask = torch.arange(ids_BS.shape[1], device=ids_BS.device)[None, :] < n_B[:, None]
        out = self.model(ids_BS.gather(1, order_BS), mask_BS=packed_mask, caches=caches, causal_routing=causal)
        logits_BSV = torch.zeros_like(out.logits_BSV).scatter(
            1, order_BS[..., None].expand_as(out.logits_BSV), out.logits_BSV
        )
        return logits_BSV, out.aux

    def _run_cached(self, ids_BS: Tensor, mask_BS: Tensor | None, cache: ModeCache):
        """A step of ``generate``: the prompt (prefill) once, then tokens at each row's next positions."""
        from mode.model.generate import _check_generatable

        causal = _check_generatable(self.model)
        if not cache.started:
            cache.start(ids_BS.shape[0])
            logits_BSV, aux = self._run(ids_BS, mask_BS, cache.layers, causal)
            cache.seen_B = mask_BS.sum(1) if mask_BS is not None else torch.full_like(cache.seen_B, ids_BS.shape[1])
            cache.started = True
            return logits_BSV, aux
        if mask_BS is not None:
            raise ValueError("attention_mask: padding after the prompt is not supported with a ModeCache")
        positions_BS = cache.seen_B[:, None] + torch.arange(ids_BS.shape[1], device=ids_BS.device)
        out = self.model(ids_BS, positions_BS=positions_BS, caches=cache.layers, causal_routing=causal)
        cache.seen_B = cache.seen_B + ids_BS.shape[1]
        return out.logits_BSV, out.aux


def _real_first(mask_BS: Tensor) -> Tensor:
    """Per row, the column order that puts the real tokens first (in their order), then the padding."""
    S = mask_BS.shape[1]
    cols_S = torch.arange(S, device=mask_BS.device)
    key_BS = torch.where(mask_BS, cols_S, cols_S + S)
    return key_BS.argsort(dim=1)


def register() -> None:
    """Register ``ModeConfig``/``ModeForCausalLM`` with transformers' Auto classes (done on import)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register(MODEL_TYPE, ModeConfig)
        AutoModelForCausalLM.register(ModeConfig, ModeForCausalLM)
    except ValueError:  # already registered (a second import of a copied module)
        pass


register()
