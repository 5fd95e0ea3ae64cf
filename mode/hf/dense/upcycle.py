"""``upcycle``: turn a decoder's dense MLPs into mode MoE layers whose experts all start as copies of it.

Shape legend: D hidden, H the MLP's intermediate size, E experts.

A Llama-style MLP ``down(silu(gate(x)) * up(x))`` is exactly one expert of a SwiGLU ``ExpertBank``:
``w_in[e] = [gate.weightᵀ | up.weightᵀ]`` (D, 2H; the bank splits it gate first) and
``w_out[e] = down.weightᵀ`` (H, D). With every expert a copy, a token's output is ``Σ_k g_k · MLP(x)``; it
equals the dense MLP exactly when the gates of its computed experts sum to 1 and nothing is dropped:

    renormalised (renormalize=True) dropless token choice, top-1 or top-k   equal (float rounding only)
    renormalize=False                         scaled by the chosen probabilities' sum (< 1): differs
    capacity_factor set                       dropped tokens get no MLP output: differs
    num_noop > 0 (integrated MoDE)            no-op choices take gate mass and compute nothing: differs
    expert choice                             tokens get 0..E experts with softmax gates: differs

What moves the router at the start: while the experts are identical and the gates sum to 1, the LM loss
does not depend on the router (its gradient is zero up to rounding), so only the load-balancing and z
losses move it (``mode.hf.collect_aux``) until the experts drift apart. ``noise`` perturbs each copy
(relative Gaussian noise) to break the symmetry from the first step, at the cost of exact equality.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mode import _checks
from mode._module_attr import set_module_attr
from mode.experts.bank import ExpertBank
from mode.hf._compat import check_model_type, decoder_config, decoder_layers
from mode.hf.dense.convert import resolve_layers
from mode.layers.moe import IntegratedMoDE, MoEConfig, MoELayer, build_router
from mode.routing.plan import Aux


class MoESlot(nn.Module):
    """The MLP slot of a decoder layer holding a mode MoE layer: ``mlp(x) -> y`` as transformers calls it;
    the routing result of the last call is kept in ``last_aux`` (``mode.hf.collect_aux`` reads it)."""

    def __init__(self, moe: MoELayer):
        super().__init__()
        self.moe = moe
        self.last_aux: Aux | None = None

    def forward(self, x_BSD: Tensor) -> Tensor:
        y_BSD, self.last_aux = self.moe(x_BSD)
        return y_BSD.to(x_BSD.dtype)


class UpcycledMLP(MoESlot):
    """A dense MLP upcycled into an MoE (``spec``: the ``upcycle`` arguments, saved with the conversion)."""

    def __init__(self, moe: MoELayer, spec: dict):
        super().__init__(moe)
        self.spec = dict(spec)


def upcycle(
    model: nn.Module,
    layers: str | Sequence[int] = "all",
    num_experts: int = 8,
    top_k: int = 2,
    num_noop: int = 0,
    router: str = "token_choice",
    renormalize: bool = True,
    gate: str = "softmax",
    capacity_factor: float | None = None,
    noise: float = 0.0,
    balance_coef: float = 0.01,
    z_coef: float = 1e-3,
    backend: str = "auto",
) -> nn.Module:
    """Replace the MLP of the chosen decoder layers by an MoE (``num_noop > 0``: integrated MoDE) whose
    ``num_experts`` experts are copies of it, in place. The defaults (renormalised dropless top-2 token
    choice) start equal to the dense model; see the module docstring for the settings that cannot.
    Parameters of an upcycled MLP grow E-fold; its state-dict keys become ``...mlp.moe.*``."""
    check_model_type(model)
    config = decoder_config(model)
    if getattr(config, "hidden_act", None) != "silu":
        raise ValueError(
            f"hidden_act={getattr(config, 'hidden_act', None)!r}: upcycling maps SwiGLU MLPs "
            "(hidden_act='silu') onto mode's SwiGLU experts"
        )
    _checks.check_non_negative("noise", noise)
    all_layers = decoder_layers(model)
    chosen = resolve_layers(layers, len(all_layers))
    spec = {
        "num_experts": num_experts,
        "top_k": top_k,
        "num_noop": num_noop,
        "router": router,
        "renormalize": renormalize,
        "gate": gate,
        "capacity_factor": capacity_factor,
        "balance_coef": balance_coef,
        "z_coef": z_coef,
        "backend": backend,
    }
    for i in chosen:
        mlp = all_layers[i].mlp
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"layers: layer {i}'s mlp is a {type(mlp).__name__}, not an nn.Module")
        if isinstance(mlp, UpcycledMLP):
            raise ValueError(f"layers: the MLP of layer {i} is already upcycled")
        all_layers[i].mlp = upcycled_mlp(mlp, spec, noise)
    conversion = getattr(model, "mode_conversion", None) or {}
    conversion.setdefault("upcycle", {}).update({str(i): dict(spec) for i in chosen})
    set_module_attr(model, "mode_conversion", conversion)
    return model


def upcycled_mlp(mlp: nn.Module, spec: dict, noise: float = 0.0) -> UpcycledMLP:
    gate_w, up_w, down_w = (
        getattr(getattr(mlp, name, None), "weight", None) for name in ("gate_proj", "up_proj", "down_proj")
    )
    if gate_w is None or up_w is None or down_w is None:
        raise ValueError(f"mlp={type(mlp).__name__}: upcycling needs gate_proj, up_proj and down_proj")
    if any(getattr(mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(
            f"mlp={type(mlp).__name__}: upcycling maps bias-free MLPs (mlp_bias=False); mode's experts have no bias"
        )
    H, D = gate_w.shape
    cfg = MoEConfig(
        d_model=D,
        d_hidden=H,
        num_experts=spec["num_experts"],
        router=spec["router"],
        top_k=spec["top_k"],
        num_noop=spec["num_noop"],
        capacity_factor=spec["capacity_factor"],
        gate=spec["gate"],
        renormalize=spec["renormalize"],
        balance_coef=spec["balance_coef"],
        z_coef=spec["z_coef"],
        activation="swiglu",
        backend=spec["backend"],
    )
    bank = ExpertBank(cfg.expert_config())
    E = cfg.num_experts
    with torch.no_grad():
        w_in_DF = torch.cat([gate_w.t(), up_w.t()], dim=1).float()  # the bank's chunk(2) takes gate first
        w_out_HD = down_w.t().float()
        bank.w_in_EDF.copy_(w_in_DF.expand(E, -1, -1))
        bank.w_out_EHD.copy_(w_out_HD.expand(E, -1, -1))
        if noise > 0:
            bank.w_in_EDF.mul_(1 + noise * torch.randn_like(bank.w_in_EDF))
            bank.w_out_EHD.mul_(1 + noise * torch.randn_like(bank.w_out_EHD))
    layer_cls = IntegratedMoDE if cfg.num_noop > 0 else MoELayer
    moe = layer_cls(build_router(cfg), bank)
    moe.experts.to(device=gate_w.device, dtype=gate_w.dtype)
    moe.router.to(device=gate_w.device, dtype=torch.float32)  # routers stay in float32
    return UpcycledMLP(moe, spec)


def upcycled_mlps(
    model: nn.Module, kind: type[MoESlot] | tuple[type[MoESlot], ...] = UpcycledMLP
) -> dict[int, MoESlot]:
    """The upcycled MLPs of ``model`` by layer index (``kind=MoESlot``: every MoE slot, converted ones too; a
    tuple of classes: any of them)."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        return {}
    out = {}
    for i, layer in enumerate(layers):  # wherever the layer keeps it: mlp, feed_forward, block_sparse_moe, experts
        slot = next((m for m in layer.modules() if isinstance(m, kind)), None)
        if slot is not None:
            out[i] = slot
    return out
