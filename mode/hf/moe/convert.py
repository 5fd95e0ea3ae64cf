"""``to_mode_moe``: the sparse MoE blocks of a transformers 5.x MoE model become ``mode`` layers, in place;
``save_transformers`` writes the model back as an ordinary transformers checkpoint.

    import mode.hf as mh
    mh.to_mode_moe(model)                        # every family of mode.hf.moe.families (docs/hf.md's table)
    parallelize(model, mesh)                     # mode.parallel: experts over ep, FSDP2 for the rest
    aux = mh.collect_aux(model)                  # layers.{i}.moe.* routing stats (and our losses)
    mh.save_transformers(model, "out")           # every rank calls it; AutoModelForCausalLM loads "out"

What changes and what does not
    * Each block becomes a ``ConvertedMoE`` holding a ``MoELayer`` (``mode.hf.moe.blocks``) built on the
      block's own tensors, as its family's entry in ``mode.hf.moe.families`` describes: the expert weights
      stay transformers' 3D Parameters (``ExpertBank`` layout "EFD" or "EDF"), the router takes the family's
      router weight, shared experts stay transformers' MLP modules. Nothing is copied (DBRX's 2D input weights
      excepted: one copy); the logits equal the original's (float32: 2e-6 + 1e-5 relative; DBRX 1e-4), in train
      and eval, with padding, and ``generate()`` is unchanged (tests/hf/test_hf_moe.py).
    * Attention, norms, embeddings and the decoder layers are transformers' own: any attention backend works,
      and linear attention, Mamba, MLA, hyper-connections stay as they are.
    * State-dict names change below each block (``mlp.moe.router.weight`` for ``mlp.gate.weight`` ...); the
      map back is found by tensor identity at conversion (``blocks.hf_names``) and kept on the slot, with
      the block's unread tensors (``kept``) and the ones derived from ours (LongCat's rows, DBRX's reshapes).
    * ``output_router_logits`` behaves as before: each slot owns a parameter-free module of the family's
      router class (``router_logits``, or the name a name-matching recorder looks for) that it calls with our
      router's logits, so transformers' output recorder sees them exactly where it saw its router's, and the
      model's ``aux_loss`` (Switch balance loss times ``router_aux_loss_coef``) is computed by transformers as
      before. Our ``Aux`` is there too (``collect_aux``), with the coefficients given to ``to_mode_moe`` (0 by
      default: not double-counted).
    * A selection-only correction bias (DeepSeek-V3's ``e_score_correction_bias`` and its kin) becomes our
      router's ``bias_X``: it decides the choice as before; ``mode.routing.update_expert_bias(model)`` moves it
      (``mode.train.Trainer`` calls it), a plain transformers loop leaves it where it is, as transformers does.
      With ``noop_target`` it holds LongCat-Flash's zero experts at a budget.

Which families convert, and how each is described, is ``mode.hf.moe.families`` (one entry per model type).
Refused, by name: the model types of ``families.REFUSED`` (encoder-decoders) and ``NOT_YET`` (each with
what it needs), any other model type whose MoE block is not in the table, quantised models, an expert
activation the family's experts do not compute, an already converted model. Router jitter and PhiMoE convert
(evaluation is exact) but a training forward refuses with the reason.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import Tensor, nn

from mode._module_attr import set_module_attr
from mode.hf.dense.routing import collect_aux
from mode.hf.dense.upcycle import MoESlot, upcycled_mlps
from mode.hf.moe.blocks import FAMILIES, Extras, SharedMLP, adopt_block, hf_names, kept_name, train_refusal
from mode.hf.moe.families import FAMILIES as SPECS, NOT_YET, REFUSED, get_path
from mode.hf.moe.saving import (  # noqa: F401
    converted_slots,
    install_save_pretrained,
    load_family_names,
    save_transformers,
    transformers_names,
    transformers_state_dict,
)
from mode.hf.moe.transformers_api import adopt as adopt_transformers_api
from mode.hf.moe.weight_init import block_skeletons, install_init, mark_initialised
from mode.layers.moe import MoELayer
from mode.measure.flops import mlp_flops_per_token
from mode.measure.stats import RoutingAccumulator
from mode.routing.given import GivenChoices
from mode.routing.keys import MOE, router_key

MOE_MODEL_TYPES = tuple(SPECS)  # the model types of mode.hf.moe.families.FAMILIES


class ConvertedMoE(MoESlot):
    """A transformers sparse-MoE block computed by a ``MoELayer``: ``mlp(x_BSD) -> y_BSD`` (or ``(y_BSD,
    None)`` where the family's decoder layer unpacks a pair: gpt-oss, Llama-4) as the decoder layer calls it.
    ``family``: the model type; ``names``: the layer's state-dict name -> the block's; ``router_logits``: the
    family router's recording point (see the module docstring); ``extras``: what the slot keeps for the way
    back (``blocks.Extras``: the block's unread tensors, and those derived from ours); ``train_refusal``: why a
    training forward refuses (router jitter on, PhiMoE's sampled routing; evaluation is exact), or None."""

    _mode_converted_slot = True  # saving.CONVERTED_MARK: how saving and transformers_api find slots

    def __init__(
        self,
        moe: MoELayer,
        family: str,
        names: dict[str, str],
        router_logits: nn.Module | None,
        extras: Extras | None = None,
        train_refusal: str | None = None,
        point_name: str = "router_logits",
    ):
        super().__init__(moe)
        self.family = family
        self.names = dict(names)
        # a recorder that matches by module name (MiniMax: "mlp.gate") finds the point under that name
        self.point_name = point_name
        setattr(self, point_name, router_logits)
        extras = extras if extras is not None else Extras()
        self.kept = nn.Module()  # the block's tensors the layer does not hold, as they are
        for path, t in extras.kept.items():
            if isinstance(t, nn.Parameter):
                self.kept.register_parameter(kept_name(path), t)
            else:
                self.kept.register_buffer(kept_name(path), t)
        consumed = {part for parts, _ in extras.derived.values() for part in parts}  # rows a derived tensor joins
        self.kept_names = {f"kept.{kept_name(p)}": p for p in extras.kept if f"kept.{kept_name(p)}" not in consumed}
        self.post_norm = None
        if extras.post_norm is not None:  # AXK1: a norm of the block's output, kept as the block's own module
            path, norm = extras.post_norm
            self.post_norm = norm
            self.kept_names.update({f"post_norm.{n}": f"{path}.{n}" for n in norm.state_dict()})
        self.derived = dict(extras.derived)  # the block's name -> (our slot-relative names, function)
        self.inverse = dict(extras.inverse)  # the block's name -> its parts' values from its value (loading)
        self.register_load_state_dict_pre_hook(load_family_names)  # a family checkpoint loads too
        self.train_refusal = train_refusal
        self._hashed = bool(getattr(getattr(moe.router, "cfg", None), "hash_vocab", 0))
        self.returns_tuple = SPECS[family].returns_tuple

    def forward(self, x_BSD: Tensor, input_ids: Tensor | None = None):
        """``input_ids``: where the decoder layer passes them (DeepSeek-V4), for hash routing."""
        if self.train_refusal is not None and self.training:
            raise ValueError(f"{self.family}: a training forward is refused: {self.train_refusal}")
        plan = self.moe.router(x_BSD, ids_BS=input_ids) if self._hashed else self.moe.router(x_BSD)
        point = getattr(self, self.point_name)
        if point is not None:
            point(plan.logits_TX)  # returns them: transformers' recorder hook keeps them
        y_BSD, self.last_aux = self.moe.apply_plan(x_BSD, plan)
        y_BSD = y_BSD.to(x_BSD.dtype)
        if self.post_norm is not None:
            y_BSD = self.post_norm(y_BSD)
        return (y_BSD, None) if self.returns_tuple else y_BSD


class ConvertedExperts(MoESlot):
    """transformers' experts module of a family whose decoder layer calls its own router first (Gemma-4):
    ``experts(x_TD, top_k_index, top_k_weights) -> y_TD`` as the layer calls it, computed by a ``MoELayer``
    whose router is ``GivenChoices`` (the plan of the given choices): mode's dispatch and experts, local or
    expert-parallel; transformers' router, its logits and their recording stay as they are."""

    _mode_converted_slot = True  # saving.CONVERTED_MARK: how saving and transformers_api find slots

    def __init__(self, moe: MoELayer, family: str, names: dict[str, str]):
        super().__init__(moe)
        self.family = family
        self.names = dict(names)
        self.kept = nn.Module()
        self.kept_names: dict[str, str] = {}
        self.derived: dict = {}
        self.inverse: dict = {}
        self.register_load_state_dict_pre_hook(load_family_names)

    def forward(self, x_TD: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        plan = cast(GivenChoices, self.moe.router).plan(top_k_index, top_k_weights)  # the router adopt_block built
        y_BSD, self.last_aux = self.moe.apply_plan(x_TD[None], plan)
        return y_BSD[0].to(x_TD.dtype)


@functools.cache
def _logits_point(router_cls: type, index: int) -> type:
    """A parameter-free subclass of a transformers router class whose forward returns the logits it is
    given at output position ``index``: transformers' ``OutputRecorder(router_cls, index)`` hooks it."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def forward(self, logits_TE: Tensor) -> tuple:
        return (None,) * index + (logits_TE,)

    return type(
        f"{router_cls.__name__}Logits",
        (router_cls,),
        {
            "__init__": __init__,
            "forward": forward,
            "__module__": __name__,
            "__doc__": f"Where {router_cls.__name__}'s logits are recorded (mode.hf.moe.convert).",
        },
    )


def _router_recorder(model: nn.Module, router_cls: type | None = None):
    """transformers' ``OutputRecorder`` for ``router_logits`` on this model class, or None. Where there are
    several (JetMoE records its attention router too), the one of ``router_cls``, the MoE block's router."""
    for m in model.modules():  # the causal LM's class, or its base model's (Llama-4, MiniMax keep it there)
        specs = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
            target = getattr(spec, "target_class", None)
            if target is not None and (router_cls is None or issubclass(router_cls, target)):
                return spec
    return None


def _check_model(model: nn.Module) -> tuple[object, str]:
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model={type(model).__name__}: must be a transformers PreTrainedModel (it has no .config)")
    config = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    quant = getattr(model.config, "quantization_config", None) or getattr(model, "hf_quantizer", None)
    if quant is not None:
        raise ValueError(
            f"quantization_config={quant!r}: to_mode_moe needs the expert weights as float tensors "
            "(mode's experts are not quantised); load the model unquantised"
        )
    if any(isinstance(m, (ConvertedMoE, ConvertedExperts)) for m in model.modules()):
        raise ValueError("model: is already converted (it holds ConvertedMoE layers)")
    if model_type in REFUSED:
        raise ValueError(f"model_type={model_type!r}: to_mode_moe does not convert it: {REFUSED[model_type]}")
    if model_type in NOT_YET:
        raise ValueError(f"model_type={model_type!r}: to_mode_moe does not convert it yet: {NOT_YET[model_type]}")
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r}: to_mode_moe converts {', '.join(MOE_MODEL_TYPES)}; "
            "missing for this model: its MoE block is not one of these (a new family is one entry "
            "of mode.hf.moe.families.FAMILIES)"
        )
    return config, model_type


def _check_unsharded(model: nn.Module, blocks: list) -> None:
    """transformers' own tensor or expert parallelism (``from_pretrained(tp_plan=...)``, ``distributed_config``)
    has split the blocks' tensors across ranks: mode's layers need the whole tensors (mode's expert parallelism
    shards them itself, ``mode.parallel.parallelize``)."""
    tp_size = getattr(model, "_tp_size", None) or 1
    # a DTensor, known by its to_local (as mode.experts.bank.local_weight): no torch.distributed import here
    sharded = [n for _, _, b in blocks for n, p in b.named_parameters() if hasattr(p, "to_local")]
    if tp_size > 1 or sharded:
        raise ValueError(
            f"model: is sharded by transformers' tensor or expert parallelism (tp_size={tp_size}, sharded block "
            f"tensors {sharded[:3]}); to_mode_moe converts the whole model: load it without tp_plan / "
            "distributed_config, convert it, then shard it with mode.parallel.parallelize (experts over the mesh's "
            "ep dim, FSDP2 for the rest)"
        )


def to_mode_moe(
    model: nn.Module,
    *,
    backend: str = "auto",
    balance_coef: float = 0.0,
    z_coef: float = 0.0,
    noop_target: float | None = None,
) -> nn.Module:
    """Replace every sparse MoE block of ``model`` (a transformers causal LM or base model of a supported
    family) by a ``ConvertedMoE``, in place; returns the model. ``backend``: the experts' (``ExpertBank``);
    ``balance_coef`` / ``z_coef``: our Switch balance and z losses in ``collect_aux(model).total()``;
    ``noop_target``: for a family with zero-computation experts and a correction bias (LongCat-Flash), the
    share of choices ``update_expert_bias`` holds on them (the activated-parameter budget)."""
    config, model_type = _check_model(model)
    blocks = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in FAMILIES
    ]
    if not blocks:
        raise ValueError(
            f"model={type(model).__name__}: holds no sparse MoE block (looked for {', '.join(sorted(FAMILIES))})"
        )
    _check_unsharded(model, blocks)
    spec = SPECS[model_type]
    router_classes = {type(get_path(block, spec.router)) for _, _, block in blocks if spec.router}
    recorder = next((r for r in (_router_recorder(model, c) for c in router_classes) if r is not None), None)
    # transformers installs its recording hooks once, on the first recording forward of the model that records
    # (the base model inside a *ForCausalLM): after that, a new recording point gets its hook from us
    hooked = any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules())
    for parent, name, block in blocks:
        layer, extras = adopt_block(
            block, config, backend=backend, balance_coef=balance_coef, z_coef=z_coef, noop_target=noop_target
        )
        if spec.router is None:  # Gemma-4: transformers' router stays; only the experts become mode's
            slot = ConvertedExperts(layer, model_type, hf_names(layer, block, extras))
            _keep_family_init(slot, block)
            setattr(parent, name, slot)
            continue
        point = None
        # a block whose router transformers does not record (DeepSeek-V4's hash layers) gets no point either
        if recorder is not None and isinstance(get_path(block, spec.router), recorder.target_class):
            point = _logits_point(recorder.target_class, recorder.index)()
            if hooked:
                from transformers.utils.output_capturing import install_output_capuring_hook

                install_output_capuring_hook(point, "router_logits", recorder.index)
        point_name = "router_logits"
        if recorder is not None and getattr(recorder, "layer_name", None):
            point_name = recorder.layer_name.split(".")[-1]
        slot = ConvertedMoE(
            layer,
            model_type,
            hf_names(layer, block, extras),
            point,
            extras,
            train_refusal(block, config, SPECS[model_type]),
            point_name,
        )
        _keep_family_init(slot, block)
        setattr(parent, name, slot)
    install_save_pretrained(model)
    install_init(model)
    adopt_transformers_api(model)
    return model


def _keep_family_init(slot: nn.Module, block: nn.Module) -> None:
    """What transformers' ``_init_weights`` needs to initialise ``slot`` as ``block`` (``weight_init``)."""
    set_module_attr(slot, "hf_skeletons", block_skeletons(block, slot))
    set_module_attr(slot, "block_class", type(block).__name__)
    mark_initialised(slot, block)


def converted_moe(model: nn.Module) -> dict[str, ConvertedMoE | ConvertedExperts]:
    """Module name -> every ``ConvertedMoE`` (and ``ConvertedExperts``) of ``model``."""
    return converted_slots(model)


@torch.no_grad()
def moe_report(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, acc: RoutingAccumulator | None = None
) -> tuple[RoutingAccumulator, dict]:
    """Load balance and per-token compute of a converted model on one batch of token ids (``mode report``'s
    accumulator): runs the model (eval, no grad; its train/eval mode is restored), adds every converted
    layer's routing to ``acc`` (a fresh one by default; pass one to sum over batches) and returns it with
    its summary: per layer the expert shares, max/mean load, drops, no-op share, routing entropy and
    ``experts_per_token`` (routed experts computed per real token); overall ``moe_flops_per_token`` (the
    converted layers' expert, shared-expert and router FLOPs per real token, 2 per multiply-add)."""
    slots = upcycled_mlps(model, (ConvertedMoE, ConvertedExperts))
    if not slots:
        raise ValueError("model: holds no ConvertedMoE layer (convert it with mode.hf.to_mode_moe first)")
    acc = acc if acc is not None else RoutingAccumulator()
    mask_BS = None if attention_mask is None else attention_mask.bool()
    was_training = model.training
    model.eval()
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        model.train(was_training)
    acc.add(collect_aux(model), mask_BS)  # layers.{i}.moe.router, as mode report names them
    summary = acc.summary()
    flops = 0.0
    for i, slot in slots.items():
        name = router_key(i, MOE)
        if name not in acc.router_names():
            continue
        per_token = acc.router_summary(name, positions=False)["assignments_per_token"]
        summary["layers"][str(i)]["experts_per_token"] = per_token
        per_assignment, fixed = _flops_per_token(slot.moe)
        flops += per_token * per_assignment + fixed
    summary["overall"]["moe_flops_per_token"] = flops
    return acc, summary


def _flops_per_token(moe: MoELayer) -> tuple[float, float]:
    """(FLOPs of one routed expert assignment, FLOPs every token pays: router, shared experts and gate)."""
    cfg = moe.experts.cfg
    fixed = 2.0 * cfg.d_model * cast(int, moe.router.num_slots)  # every router has num_slots
    if isinstance(moe.shared_experts, SharedMLP):  # (JetMoE's output bias sits there too: no FLOPs)
        # 2 FLOPs per weight of its linear layers, whatever the family calls them (gated or not)
        fixed += 2.0 * sum(m.weight.numel() for m in moe.shared_experts.modules() if isinstance(m, nn.Linear))
    if moe.shared_gate is not None:
        fixed += 2.0 * cfg.d_model
    return mlp_flops_per_token(cfg.d_model, cfg.d_hidden, cfg.activation), fixed
