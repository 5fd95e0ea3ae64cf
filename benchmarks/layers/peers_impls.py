"""The MoE blocks bench_peers.py measures mode against, each wrapped to one calling convention (``Impl``):
mode's own layer, transformers' Mixtral/Qwen3 blocks, torchtitan's block, Liger's fused kernels; the float32 and
bf16 wrappers, and the training step each row times."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from mode import MoEConfig, MoELayer

TOP_K = 2


INSTALL = 'pip install "mode-torch[peers]"'


# float32 implementations must agree with mode to this (observed: 0 or ~1e-7; summation order may differ)
FLOAT32_TOL = 1e-4


BF16_TOL = 5e-2  # relative to the largest output or input-gradient value


@dataclass
class Impl:
    name: str
    family: str  # mode, transformers, torchtitan, liger
    build: Callable[[MoELayer], nn.Module]  # from mode's layer (weights to copy); runs on the CPU
    returns_aux: bool = False  # mode's convention: (y, Aux)
    float32: bool = True  # computes in float32 (expected to agree with mode to FLOAT32_TOL)
    same_function: bool = True  # False: routes differently by design (reported, not judged)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- mode ------------------------------------------------------------------------------------------------


def build_mode(cfg: dict, num_experts: int, hidden: int, backend: str, seed: int) -> MoELayer:
    torch.manual_seed(seed)  # the same router and expert weights for every backend
    return MoELayer.from_config(
        MoEConfig(
            d_model=cfg["d_model"],
            d_hidden=hidden,
            num_experts=num_experts,
            router="token_choice",
            top_k=TOP_K,
            gate="softmax",
            renormalize=True,
            capacity_factor=None,
            activation="swiglu",
            backend=backend,
        )
    )


def _mode_weights(src: MoELayer) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(router (E, D), gate (E, D, H), up (E, D, H), down (E, H, D)) of mode's layer, detached."""
    w_in = src.experts.w_in_EDF.detach()
    H = src.experts.cfg.d_hidden
    return src.router.weight.detach(), w_in[:, :, :H], w_in[:, :, H:], src.experts.w_out_EHD.detach()


def _copy(param: nn.Parameter, value: Tensor) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise AssertionError(f"weight copy: {tuple(param.shape)} != {tuple(value.shape)}")
    with torch.no_grad():
        param.copy_(value)


# -- transformers ----------------------------------------------------------------------------------------


def transformers_impls() -> tuple[list[Impl], str | None]:
    """Mixtral and Qwen3-MoE sparse MoE blocks, or ([], why not)."""
    try:
        from transformers import MixtralConfig, Qwen3MoeConfig
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except Exception as e:  # noqa: BLE001 - ImportError, or anything a half-installed stack raises at import
        return [], f"transformers does not import here ({type(e).__name__}: {e}); {INSTALL}"
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        return [], (
            f"transformers {_version('transformers')} has no 'grouped_mm' experts implementation "
            f"(transformers>=5 has it); {INSTALL}"
        )

    def copy_into(block: nn.Module, src: MoELayer) -> nn.Module:
        router, gate, up, down = _mode_weights(src)
        _copy(block.gate.weight, router)
        # transformers keeps (E, out, in) weights with the gate half first: [gate; up] @ x
        _copy(block.experts.gate_up_proj, torch.cat([gate, up], dim=2).transpose(1, 2))
        _copy(block.experts.down_proj, down.transpose(1, 2))
        return block

    def mixtral(src: MoELayer) -> nn.Module:
        e, d, h = src.experts.num_experts, src.experts.cfg.d_model, src.experts.cfg.d_hidden
        config = MixtralConfig(
            hidden_size=d,
            intermediate_size=h,
            num_local_experts=e,
            num_experts_per_tok=TOP_K,
            hidden_act="silu",
            router_jitter_noise=0.0,
            experts_implementation="grouped_mm",
        )
        return copy_into(MixtralSparseMoeBlock(config), src)

    def qwen3(src: MoELayer) -> nn.Module:
        e, d, h = src.experts.num_experts, src.experts.cfg.d_model, src.experts.cfg.d_hidden
        config = Qwen3MoeConfig(
            hidden_size=d,
            moe_intermediate_size=h,
            num_experts=e,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=True,
            hidden_act="silu",
            experts_implementation="grouped_mm",
        )
        return copy_into(Qwen3MoeSparseMoeBlock(config), src)

    version = _version("transformers")
    return [
        Impl(f"transformers {version} Mixtral block, grouped_mm", "transformers", mixtral),
        Impl(f"transformers {version} Qwen3-MoE block, grouped_mm", "transformers", qwen3),
    ], None


class _Bf16Weights(nn.Module):
    """A peer block with bfloat16 weights fed bfloat16 activations (how a transformers model runs when loaded
    with ``dtype=torch.bfloat16``; autocast alone leaves its ``torch._grouped_mm`` experts in float32)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.bfloat16()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.bfloat16()).float()


def bf16_weights(impl: Impl) -> Impl:
    return Impl(
        impl.name + ", weights in bfloat16",
        impl.family,
        lambda src: _Bf16Weights(impl.build(src)),
        impl.returns_aux,
        float32=False,
    )


# -- torchtitan ------------------------------------------------------------------------------------------


class _KeepFloat32(TorchFunctionMode):
    """Turns ``Tensor.bfloat16()`` into a no-op: torchtitan's grouped experts cast their inputs and weights
    with it, so inside this mode they compute in float32 (nothing else about them changes)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0]
        return func(*args, **(kwargs or {}))


class _Float32Experts(nn.Module):
    """Runs a torchtitan ``GroupedExperts`` under :class:`_KeepFloat32` (its parameters stay its own)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.num_experts = inner.num_experts

    def forward(self, *args, **kwargs):
        with _KeepFloat32():
            return self.inner(*args, **kwargs)


def torchtitan_impls() -> tuple[list[Impl], str | None]:
    """torchtitan's MoE as shipped (bfloat16 expert matmuls) and with float32 expert matmuls, or ([], why not)."""
    try:
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except Exception as e:  # noqa: BLE001 - any import failure is reported as the reason this peer is skipped
        hint = INSTALL
        if isinstance(e, ModuleNotFoundError) and e.name == "triton":
            hint = (
                "torchtitan 0.3 imports triton when it loads; CUDA builds of torch bring it, a CPU build "
                "does not: pip install triton"
            )
        return [], f"torchtitan does not import here ({type(e).__name__}: {e}); {hint}"

    def build(src: MoELayer, float32: bool) -> nn.Module:
        e, d, h = src.experts.num_experts, src.experts.cfg.d_model, src.experts.cfg.d_hidden
        config = MoE.Config(
            num_experts=e,
            routed_experts=RoutedExperts.Config(
                inner_experts=GroupedExperts.Config(dim=d, hidden_dim=h, num_experts=e),
                token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=TOP_K),
            ),
            router=TokenChoiceTopKRouter.Config(
                num_experts=e,
                gate=Linear.Config(in_features=d, out_features=e),
                top_k=TOP_K,
                score_func="softmax",
                route_norm=True,
            ),
        )
        moe = config.build()
        router, gate, up, down = _mode_weights(src)
        experts = moe.routed_experts.inner_experts
        _copy(moe.router.gate.weight, router)
        _copy(experts.w1_EFD, gate.transpose(1, 2))  # torchtitan: (E, out, in), w1 gate, w3 up, w2 down
        _copy(experts.w3_EFD, up.transpose(1, 2))
        _copy(experts.w2_EDF, down.transpose(1, 2))
        if float32:
            moe.routed_experts.inner_experts = _Float32Experts(experts)
        return moe

    version = _version("torchtitan")
    return [
        Impl(f"torchtitan {version} MoE, expert matmuls kept in float32", "torchtitan", lambda src: build(src, True)),
        Impl(
            f"torchtitan {version} MoE as shipped (expert matmuls in bfloat16)",
            "torchtitan",
            lambda src: build(src, False),
            float32=False,
        ),
    ], None


# -- liger-kernel ----------------------------------------------------------------------------------------


LIGER_WHEEL = (
    "liger-kernel: pip download liger-kernel --no-deps -d .whl (a 0.9 MB pure-Python wheel; "
    "docs/gpu.md carries .whl/ to the GPU machine)"
)


class _LigerMoE(nn.Module):
    """liger-kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``: Triton kernels for the
    routing metadata, a gather + grouped GEMM + SwiGLU, the down projection and the weighted combine) behind
    mode's router convention (softmax over the experts, top-2, the two gates renormalised). It takes the
    routing precomputed; its weights are (E, 2H, D) gate half first and (E, D, H), in one dtype: the
    autocast dtype under autocast (cast each call, as autocast casts a Linear's weight), else the input's."""

    def __init__(self, src: MoELayer, fn):
        super().__init__()
        router, gate, up, down = _mode_weights(src)
        self.fn = fn
        self.router = nn.Parameter(router.clone())
        self.gate_up = nn.Parameter(torch.cat([gate, up], dim=2).transpose(1, 2).contiguous())
        self.down = nn.Parameter(down.transpose(1, 2).contiguous())

    def forward(self, x: Tensor) -> Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        probs_TE = nn.functional.linear(x_TD, self.router).float().softmax(-1)
        w_TK, idx_TK = probs_TE.topk(TOP_K, dim=-1)
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        y_TD = self.fn(
            x_TD.to(dtype), self.gate_up.to(dtype), self.down.to(dtype), idx_TK.to(torch.int32), w_TK.to(dtype)
        )
        return y_TD.reshape(x.shape)


def liger_impls(device: torch.device) -> tuple[list[Impl], str | None]:
    """liger-kernel's fused MoE (CUDA only: Triton), or ([], why not)."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as e:  # noqa: BLE001 - any import failure is reported as the reason this peer is skipped
        return [], f"liger-kernel does not import here ({type(e).__name__}: {e}); {LIGER_WHEEL}"
    if device.type != "cuda":
        return [], f"liger-kernel's fused MoE runs Triton kernels on CUDA only (device {device})"
    version = _version("liger-kernel")
    return [
        Impl(
            f"liger-kernel {version} fused MoE (Triton)",
            "liger",
            lambda src: _LigerMoE(src, LigerFusedMoEFunction.apply),
            float32=False,
        )
    ], None


# -- measurement -----------------------------------------------------------------------------------------


def make_step(
    module: nn.Module, x: Tensor, grad_out: Tensor, returns_aux: bool, with_aux: bool = True, bf16: bool = False
) -> Callable[[], tuple[Tensor, Tensor]]:
    """One forward + backward of ``<y, grad_out>`` (plus mode's aux losses when ``with_aux``), the forward
    under bfloat16 autocast when ``bf16``; returns (y, x.grad), both detached. Gradients of the module are
    dropped first."""
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> tuple[Tensor, Tensor]:
        for p in params:
            p.grad = None
        x.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = module(x)
        y, aux = out if returns_aux else (out, None)
        outs, grads = [y], [grad_out]
        if with_aux and aux is not None:
            total = aux.total()
            if total.requires_grad:
                outs.append(total)
                grads.append(None)
        torch.autograd.backward(outs, grads)
        return y.detach(), x.grad

    return step


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _rebuild_mode(src: MoELayer, backend: str, router_options: dict | None = None) -> MoELayer:
    """mode's layer with another expert backend (and router options) and the same weights."""
    cfg = src.experts.cfg
    layer = MoELayer.from_config(
        MoEConfig(
            d_model=cfg.d_model,
            d_hidden=cfg.d_hidden,
            num_experts=cfg.num_experts,
            router="token_choice",
            top_k=TOP_K,
            gate="softmax",
            renormalize=True,
            capacity_factor=None,
            activation="swiglu",
            backend=backend,
            router_options=dict(router_options or {}),
        )
    )
    layer.load_state_dict(src.state_dict(), strict=not router_options)  # the options add a zero bias buffer
    return layer
