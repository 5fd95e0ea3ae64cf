"""transformers 5.x MoE blocks as ``mode`` layers, on the block's own tensors, driven by the family table.

    layer = adopt_block(block, config)  # a MoELayer on the block's own tensors (no copy: they are shared)
    layer = from_block(block, config)   # the same on a copy of the block
    y, aux = layer(x_BSD)               # the block's output (float32: to 1e-6), plus routing stats and losses

What each family is (its router rule, where its tensors live, its shared experts) is one entry of
``mode.hf.moe.families.FAMILIES``; nothing here is written per family. The entry's checkpoint-dependent values
(``norm_topk_prob``, ``routed_scaling_factor``, groups, ...) are read from the block's own router module, so a
config that names them differently (Kimi-Linear's ``moe_renormalize``) or per layer (Hunyuan's ``moe_topk``)
converts the same way; ``top_k`` is the router's ``top_k`` and the sizes are the expert tensors'.

The tensors. transformers keeps the experts as ``gate_up_proj (E, 2H, D)`` / ``down_proj (E, D, H)`` ("EFD")
or, in gpt-oss and Llama-4, ``(E, D, 2H)`` / ``(E, H, D)`` ("EDF"): ``ExpertBank`` takes the very Parameter
objects (and gpt-oss's biases). The router takes the family's router weight (and logit bias); the
selection-only correction bias becomes the router's ``bias_X`` (with bias balancing on, so
``mode.routing.update_expert_bias`` can move it; a plain transformers loop leaves it, as transformers does).
Shared experts stay transformers' own MLP module (``SharedMLP`` gives it the MoE layer's call); a
per-token shared gate is the layer's ``shared_gate`` as it is.

LongCat-Flash: its ``zero_expert_num`` zero-computation experts become "copy" no-op slots (``g * x``,
mode.layers.noop) after the E real experts; its ``gate_up_proj`` has E + Z rows of which only the first E are
read: the bank takes a view of those rows (the same storage) and the slot keeps the other Z (``Extras``).
DBRX keeps its experts as 2D ``w1``, ``v1``, ``w2`` of shape (E * H, D): the bank gets one copy of them in its
layout, and the way back reshapes it (``Extras.derived``).

``hf_names(layer, block, extras)`` maps each of the converted slot's state-dict names to the block's,
by tensor identity, which is how a converted model is written back as a transformers checkpoint.

The block's auxiliary losses are not part of its forward; ours come back in ``Aux`` with the coefficients
given (0 by default here).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from mode.experts.bank import ExpertBank
from mode.hf.moe.families import BLOCKS, FAMILIES as SPECS, GLU_ACTS, Family, get_path, read
from mode.layers.moe import IntegratedMoDE, MoEConfig, MoELayer, build_router
from mode.routing.given import GivenChoices
from mode.routing.plan import Aux

FAMILIES = BLOCKS  # block class name -> family (model type)


def family_of(block: nn.Module) -> str:
    name = type(block).__name__
    if name not in BLOCKS:
        raise ValueError(
            f"block={name}: not a supported transformers MoE block (supported: {', '.join(sorted(BLOCKS))})"
        )
    return BLOCKS[name]


def glu_act(config, spec: Family) -> str | None:
    """The gate activation of the family's gated experts for this config (None: the family's fixed one); a value
    mode's experts do not compute refuses here, by name."""
    field = spec.activation_field
    if field is None or not hasattr(config, field):
        return None
    value = getattr(config, field)
    if spec.activation_name is not None or spec.activation != "swiglu":
        wanted = spec.activation_name or spec.activation
        if value != wanted:
            raise ValueError(f"{field}={value!r}: mode's experts for this family use {wanted}")
        return None
    if value not in GLU_ACTS:
        raise ValueError(
            f"{field}={value!r}: mode's gated experts compute act(gate) * up for act in "
            f"{', '.join(sorted(GLU_ACTS))} (mode.hf.moe.families.GLU_ACTS)"
        )
    return GLU_ACTS[value]


def train_refusal(block: nn.Module, config, spec: Family) -> str | None:
    """Why a training forward of the converted block must refuse (None: it trains exactly): the family's
    training-time routing noise, when on, or a training rule mode does not compute."""
    jitter = max([float(read(v, block, config) or 0.0) for v in spec.jitter], default=0.0)
    if jitter > 0:
        return (
            f"router jitter {jitter} is on, and mode's routers add no jitter: evaluation is exact, training "
            "would not be; set the config's jitter to 0.0 (e.g. config.router_jitter_noise = 0.0) before "
            "converting, or call model.eval()"
        )
    return spec.train_refusal


def moe_config(
    block: nn.Module,
    config,
    *,
    backend: str = "auto",
    balance_coef: float = 0.0,
    z_coef: float = 0.0,
    noop_target: float | None = None,
) -> MoEConfig:
    """The ``MoEConfig`` computing what ``block`` (a sparse block of a family in the table) computes."""
    family = family_of(block)
    spec = SPECS[family]
    act = glu_act(config, spec)
    why = read(spec.check, block, config) if spec.check is not None else None
    if why:
        raise ValueError(why)
    experts = get_path(block, spec.experts)
    router = get_path(block, spec.router) if spec.router is not None else None
    w_out = get_path(experts, spec.weights[1])
    num_zero = int(read(spec.num_zero, block, config) or 0)
    rows = w_out.shape[0] if router is None else get_path(router, spec.router_weight).shape[0]
    num_experts, d_model = rows - num_zero, config.hidden_size
    if w_out.dim() == 2:  # DBRX: (E * H, D)
        d_hidden = w_out.shape[0] // num_experts
    else:
        d_hidden = w_out.shape[2] if spec.layout == "EFD" else w_out.shape[1]
    if spec.top_k is not None:
        top_k = read(spec.top_k, block, config)
    else:
        assert router is not None, f"{spec}: a family without top_k in its spec reads it from its router"
        top_k = router.top_k
    table = get_path(block, spec.hash_table) if spec.hash_table else None
    groups = read(spec.groups, block, config)
    n_group, topk_group = (1, None) if groups is None else (int(read(g, block, config)) for g in groups)
    scale = float(read(spec.scale, block, config) or 1.0)
    shared = get_path(block, spec.shared) if spec.shared else None
    average = bool(read(spec.shared_average, block, config)) and shared is not None
    options = dict(
        scale=scale * (0.5 if average else 1.0),
        n_group=n_group,
        topk_group=topk_group,
        group_score=spec.group_score,
        renorm_eps=spec.renorm_eps,
        renorm_min=float(read(spec.renorm_min, block, config) or 0.0),
        logit_bias=spec.router_bias is not None,
        mixer_eps=float(read(spec.mixer_eps, block, config) or 0.0),
        renorm_p=float(read(spec.renorm_p, block, config) or 1.0),
        hash_vocab=0 if table is None else int(table.shape[0]),
        logit_softcap=float(read(spec.logit_softcap, block, config) or 0.0),
        bias_on=spec.bias_on,
        dropped_groups=spec.dropped_groups,
        bias_balance=spec.choice_bias is not None and get_path(block, spec.choice_bias) is not None,
    )
    if noop_target is not None:
        options["noop_target"] = noop_target
    if topk_group is not None and int(top_k) > topk_group * (num_experts // n_group):
        options["surplus_from_dropped"] = True  # transformers' torch.topk takes the rest from dropped groups
    renormalize = bool(read(spec.renormalize, block, config))
    if not renormalize:
        options.pop("renorm_eps")
        options.pop("renorm_min")
        options.pop("renorm_p")
    expert_options = {k: read(v, block, config) for k, v in spec.expert_options.items()}
    if act not in (None, "silu"):
        expert_options["glu_act"] = act
    shared_hidden = None
    if shared is not None:
        shared_hidden = next(p for p in shared.parameters()).shape[0]  # its gate (or first) projection's rows
    return MoEConfig(
        d_model=d_model,
        d_hidden=d_hidden,
        num_experts=num_experts,
        top_k=int(top_k),
        num_noop=num_zero,
        noop_kinds="copy",
        gate=read(spec.score, block, config),
        renormalize=renormalize,
        activation=spec.activation,
        backend=backend,
        balance_coef=balance_coef,
        z_coef=z_coef,
        expert_layout=spec.layout,
        router_options=options,
        num_shared=1 if shared is not None else 0,
        shared_hidden=shared_hidden,
        shared_gate=bool(spec.shared_gate and get_path(block, spec.shared_gate) is not None),
        expert_options=expert_options,
    )


class SharedMLP(nn.Module):
    """transformers' own shared-expert MLP with the call ``MoELayer`` makes: ``(y, Aux())``; ``scale``
    multiplies its output (Cohere2's average: 0.5, exact in binary floating point)."""

    def __init__(self, mlp: nn.Module, scale: float = 1.0):
        super().__init__()
        self.mlp = mlp
        self.scale = scale

    def forward(self, x_BSD: Tensor) -> tuple[Tensor, Aux]:
        y_BSD = self.mlp(x_BSD)
        return (y_BSD if self.scale == 1.0 else y_BSD * self.scale), Aux()


class OutputBias(nn.Module):
    """A bias added to the layer's output after the combine (JetMoE's ``mlp.bias``), in the shared experts'
    slot of ``MoELayer``: ``(bias broadcast to x's shape, Aux())``. It costs no FLOPs worth counting."""

    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.bias = bias

    def forward(self, x_BSD: Tensor) -> tuple[Tensor, Aux]:
        return self.bias.to(x_BSD.dtype).expand_as(x_BSD), Aux()


def _check_experts(block: nn.Module, spec: Family) -> None:
    if not spec.experts:  # the tensors live on the block itself (JetMoE): hf_names checks every one
        return
    experts = get_path(block, spec.experts)
    names = sorted(name for name, _ in experts.named_parameters())
    wanted = sorted([*spec.weights, *spec.other_weights, *(spec.biases or ())])
    if names != wanted:
        raise ValueError(
            f"{type(block).__name__}.{spec.experts} holds {names}: the {family_of(block)} entry "
            f"of mode.hf.moe.families adopts exactly {wanted}"
        )


@dataclass
class Extras:
    """What a converted block keeps beside its ``MoELayer`` for the way back to transformers' names.

    ``kept``: tensors of the block the layer does not hold (name in the block -> tensor: LongCat's unread
    rows and classifier bias), which the slot registers as they are; ``derived``: the block's tensors that are
    a function of the slot's (name in the block -> (slot-relative names, function)): LongCat's ``gate_up_proj``
    is the bank's rows then the kept rest, DBRX's ``w1`` / ``v1`` / ``w2`` are reshapes of the bank's."""

    kept: dict[str, Tensor] = field(default_factory=dict)
    derived: dict[str, tuple[list[str], Callable]] = field(default_factory=dict)
    # the way in: a derived tensor's name -> f(its value, *its parts' current values) -> the parts' new values
    inverse: dict[str, Callable] = field(default_factory=dict)
    post_norm: tuple[str, nn.Module] | None = None  # (path in the block, module) applied to the output (AXK1)


def kept_name(path: str) -> str:
    """A block path as one attribute name of the slot's ``kept`` module."""
    return path.replace(".", "__")


def _cat0(*parts: Tensor) -> Tensor:
    return torch.cat(parts, 0)


def _split0(whole: Tensor, first: Tensor, rest: Tensor) -> tuple[Tensor, Tensor]:
    return whole[: first.shape[0]], whole[first.shape[0] :]


def _adopt_rows(spec: Family, w_in: Tensor, num_experts: int, names: tuple[str, str], extras: Extras) -> Tensor:
    """LongCat: ``gate_up_proj`` has rows past the real experts that nothing reads; the bank takes a view of
    the first ``num_experts`` (the same storage), the slot keeps the rest."""
    path = f"{spec.experts}.{spec.weights[0]}"
    extras.kept[path + ".rest"] = w_in.detach()[num_experts:]
    extras.derived[path] = ([f"moe.experts.{names[0]}", "kept." + kept_name(path + ".rest")], _cat0)
    extras.inverse[path] = _split0
    return nn.Parameter(w_in.detach()[:num_experts], requires_grad=w_in.requires_grad)


def _dbrx_half(index: int, hidden: int, w_in_EDF: Tensor) -> Tensor:
    """DBRX's ``w1`` (index 0) or ``v1`` (1), (E * H, D), from the bank's (E, D, 2H) input weight."""
    return w_in_EDF[:, :, index * hidden : (index + 1) * hidden].transpose(1, 2).reshape(-1, w_in_EDF.shape[1])


def _dbrx_half_back(index: int, hidden: int, w_half: Tensor, w_in_EDF: Tensor) -> tuple[Tensor]:
    """The bank's input weight with DBRX's ``w1`` (index 0) or ``v1`` (1), (E * H, D), written into its half."""
    E, D, _ = w_in_EDF.shape
    w = w_in_EDF.detach().clone()
    w[:, :, index * hidden : (index + 1) * hidden] = w_half.reshape(E, hidden, D).transpose(1, 2)
    return (w,)


def _flatten_experts(w_EHD: Tensor) -> Tensor:
    return w_EHD.reshape(-1, w_EHD.shape[-1])


def _unflatten_experts(w_flat: Tensor, w_EHD: Tensor) -> tuple[Tensor]:
    return (w_flat.reshape(w_EHD.shape),)


def _dbrx_tensors(
    experts: nn.Module, cfg: MoEConfig, names: tuple[str, str], extras: Extras, path: str
) -> tuple[Tensor, Tensor]:
    """DBRX's experts: ``w1`` (gate), ``v1`` (up), ``w2`` (down), each (E * H, D), used as x @ w1_e.T and
    h @ w2_e. The bank ("EDF") gets ``[w1_e.T, v1_e.T]`` as one (E, D, 2H) copy and ``w2`` as an (E, H, D)
    view; the way back slices and reshapes them."""
    E, H, D = cfg.num_experts, cfg.d_hidden, cfg.d_model
    w1, v1, w2 = cast("tuple[Tensor, Tensor, Tensor]", (experts.w1, experts.v1, experts.w2))  # the block's parameters
    w_in = torch.cat([w1.detach().view(E, H, D), v1.detach().view(E, H, D)], 1).transpose(1, 2).contiguous()
    extras.derived[f"{path}.w1"] = ([f"moe.experts.{names[0]}"], functools.partial(_dbrx_half, 0, H))
    extras.derived[f"{path}.v1"] = ([f"moe.experts.{names[0]}"], functools.partial(_dbrx_half, 1, H))
    extras.derived[f"{path}.w2"] = ([f"moe.experts.{names[1]}"], _flatten_experts)
    extras.inverse.update(
        {
            f"{path}.w1": functools.partial(_dbrx_half_back, 0, H),
            f"{path}.v1": functools.partial(_dbrx_half_back, 1, H),
            f"{path}.w2": _unflatten_experts,
        }
    )
    return (
        nn.Parameter(w_in, requires_grad=w1.requires_grad),
        nn.Parameter(w2.detach().view(E, H, D), requires_grad=w2.requires_grad),
    )


TENSOR_RULES = {"dbrx": _dbrx_tensors}  # Family.tensors: a family whose expert tensors need reshaping


def adopt_block(block: nn.Module, config=None, **kw) -> tuple[MoELayer, Extras]:
    """A ``MoELayer`` computing what ``block`` computes on the block's own tensors (no copy: a change to
    one is a change to the other; DBRX's fused 2D weights are the one exception, copied once), and the
    ``Extras`` the converted slot keeps for the way back. ``config``: the model's config (default: the
    block's own); ``kw`` go to ``moe_config``."""
    family = family_of(block)
    spec = SPECS[family]
    config = config if config is not None else getattr(block, "config", None)
    if config is None:
        raise ValueError(f"config=None: {type(block).__name__} keeps no config; pass the model's config")
    _check_experts(block, spec)
    cfg = moe_config(block, config, **kw)
    experts = get_path(block, spec.experts)
    if spec.router is None:  # the choices come from transformers' own router, called by the decoder layer
        router = GivenChoices(cfg.num_experts, cfg.top_k)
    else:
        router_mod = get_path(block, spec.router)
        gate_w = get_path(router_mod, spec.router_weight)
        router = build_router(cfg).to(gate_w.device)  # (X, D): small; its float32 buffers stay float32
        router.weight = gate_w
        if spec.router_bias is not None:
            router.logit_bias_X = getattr(router_mod, spec.router_bias)
        # cfg is moe_config's reading of this spec: each of these is on only where the spec names its tensor
        if cfg.router_config().bias_balance:
            router.bias_X = get_path(block, cast(str, spec.choice_bias))
        if cfg.router_config().hash_vocab:
            router.hash_table_VK = get_path(block, cast(str, spec.hash_table))
    with torch.device("meta"):  # the experts' own tensors replace these: nothing is allocated
        bank = ExpertBank(cfg.expert_config())
    names = ("w_in_EFD", "w_out_EDH") if spec.layout == "EFD" else ("w_in_EDF", "w_out_EHD")
    extras = Extras()
    if spec.tensors is not None:  # the family's own reshaping (DBRX)
        w_in, w_out = TENSOR_RULES[spec.tensors](experts, cfg, names, extras, spec.experts)
    else:
        w_in, w_out = (get_path(experts, n) for n in spec.weights)
        if w_in.shape[0] != cfg.num_experts:
            w_in = _adopt_rows(spec, w_in, cfg.num_experts, names, extras)
    setattr(bank, names[0], w_in)
    setattr(bank, names[1], w_out)
    if spec.biases is not None:
        bank.b_in_EF, bank.b_out_ED = (getattr(experts, n) for n in spec.biases)
    for path in spec.unused:
        t = get_path(block, path)
        if t is not None:
            extras.kept[path] = t
    if spec.post_norm is not None:  # a module: the slot applies it to the layer's output and keeps its tensors
        extras.post_norm = (spec.post_norm, get_path(block, spec.post_norm))
    shared = shared_gate = None
    if cfg.num_shared:
        average = bool(read(spec.shared_average, block, config))
        shared = SharedMLP(get_path(block, cast(str, spec.shared)), 0.5 if average else 1.0)  # as above
        shared_gate = get_path(block, cast(str, spec.shared_gate)) if cfg.shared_gate else None
    elif spec.output_bias is not None:  # JetMoE: a bias added after the combine, as an always-on constant
        shared = OutputBias(get_path(block, spec.output_bias))
    layer_cls = IntegratedMoDE if cfg.num_noop else MoELayer
    return layer_cls(router, bank, None, shared, shared_gate, cfg.build_noop()), extras


def hf_names(layer: MoELayer, block: nn.Module, extras: Extras | None = None) -> dict[str, str]:
    """The layer's state-dict name -> the block's, for a layer made by ``adopt_block(block)``: the tensors
    are the same objects. Every tensor of either must have its partner, or be accounted for by ``extras``
    (kept or derived; else ValueError)."""
    extras = extras if extras is not None else Extras()
    derived_ours = {n.removeprefix("moe.") for parts, _ in extras.derived.values() for n in parts}
    ours = {id(t): name for name, t in layer.state_dict(keep_vars=True).items() if name not in derived_ours}
    skip = set(extras.kept) | set(extras.derived)
    if extras.post_norm is not None:
        skip |= {f"{extras.post_norm[0]}.{n}" for n in extras.post_norm[1].state_dict()}
    theirs = {id(t): name for name, t in block.state_dict(keep_vars=True).items() if name not in skip}
    if set(ours) != set(theirs):
        only_ours = sorted(ours[i] for i in set(ours) - set(theirs))
        only_theirs = sorted(theirs[i] for i in set(theirs) - set(ours))
        raise ValueError(
            f"{type(block).__name__}: the converted layer does not hold exactly the block's tensors "
            f"(only in the layer: {only_ours}; only in the block: {only_theirs})"
        )
    return {ours[i]: theirs[i] for i in ours}


def from_block(block: nn.Module, config=None, **kw) -> MoELayer:
    """A ``MoELayer`` computing what ``block`` computes, on a copy of its tensors (``adopt_block`` shares them)."""
    layer, _ = adopt_block(copy.deepcopy(block), config, **kw)
    return layer
