"""A bank of E MLP experts computing on tokens already grouped by expert.

Shape legend
    A rows: the first N = counts_E.sum() grouped by expert (counts_E[0] rows of expert 0, then
      counts_E[1] rows of expert 1, ...), the A - N rows after them padding
    D hidden size   H expert hidden size   F = H (gelu, relu2) or 2H (swiglu: gate and up fused)   E experts

Padding contract of ``forward(x_AD, counts_E)`` (every backend):
    * ``A >= counts_E.sum()``. The router puts no-op, dropped and padding assignments after the real
      ones so that shapes stay static on the GPU; those rows are padding.
    * A padding row's output is exactly zero and its input gets exactly zero gradient, whatever it holds
      (NaN and inf included) and whatever the kernel leaves in rows past the last offset
      (``torch._grouped_mm`` on CUDA never writes them).
    * ``A == 0`` (all counts zero) returns a (0, D) tensor, and backward works.
    * "grouped" keeps counts_E on the device: it masks input and output with ``torch.where(row < N)``
      (NaN-safe, where ``x * 0`` is not), so it cannot check ``counts_E.sum() <= A`` or ``counts_E >= 0``
      without a host sync and does not; "reference" and "megablocks" read the counts on the host anyway
      (one sync per call) and raise ValueError when they break the contract.
    * ``padded=False`` (a plan that promises no padding) lets "grouped" skip both masks.

Routing gates (``gate_A``, the local dispatcher's fast path): the bank multiplies each row's output by
its gate, on the (A, H) activation before the down projection when H < D and there are no biases
("grouped": fewer bytes than the (A, D) output, inside the fused SwiGLU op where it runs; the dispatcher's
combine is a plain scatter-add either way),
else on the output: with biases the function is ``g * (act @ W_out + b_out)``. With
``ExpertConfig.gate_on_input`` (Llama 4) the gate scales the row's input instead, ``expert(g * x)``, and the
output is not gated; a caller that gates outputs itself (the combine) must not be used with it.

The expert function (``ExpertConfig``; the defaults are the plain MLP, bit for bit as before these options)
    h_AF = x_AD @ W_in[e] (+ b_in_EF[e] with ``bias``)      y_AD = act(h_AF) @ W_out[e] (+ b_out_ED[e])
    act = gelu, or swiglu with ``swiglu_limit`` (clamp gate to max=L, up to [-L, L]), ``swiglu_alpha``
    (gate * sigmoid(alpha * gate); None: silu), ``swiglu_up_offset`` ((up + offset) * glu) and ``fused``
    ("concat": gate = F[:H], up = F[H:]; "interleaved": gate = F[0::2], up = F[1::2]); swiglu_options.py has
    the formula and the families that use it (gpt-oss: bias, interleaved, alpha 1.702, limit 7, offset 1;
    DeepSeek-V4: limit 10). The SwiGLU options need activation="swiglu". The default SwiGLU runs swiglu.py's
    fused op on the "grouped" path; other options a plain autograd function (chosen once in ``__init__``).
    Biases are registered after the weights (``parameters()`` keeps the weights first) and start at zero
    (no random draws: the weights' init is the same with and without them); "megablocks" refuses them.
    ``fused_kernels`` (default True): that fused op is ``mode.kernels.gated_swiglu`` (``mode_kernels::swiglu``, the
    row gate multiplied inside; Triton on CUDA where triton is installed, else the same torch ops as
    ``mode.experts.swiglu``, bit for bit); False keeps ``mode.experts.swiglu`` (docs/kernels.md).

Backends
    "reference"  a readable loop over experts (one matmul pair per expert); reads counts_E on the host
    "grouped"    torch._grouped_mm over all experts at once (torch>=2.9; CPU and CUDA; float32, bfloat16,
                 float16; D and H multiples of 16 / itemsize); no host sync on CUDA in bfloat16 (sm90/sm100).
                 In other dtypes on CUDA torch falls back to a loop with a host sync per GEMM: the bank warns
                 once per process (``grouped_mm.SlowPathWarning``); compute under bfloat16 autocast there.
                 On the CPU in bfloat16/float16 with >= 256 rows per expert it lays the rows out at bucketed
                 group sizes (``mode.experts.row_buckets``: oneDNN compiles a kernel per GEMM shape)
    "megablocks" grouped_gemm from MegaBlocks (CUDA, bfloat16, the torch 2.7.0 stack; optional extra)
    "auto"       per (device, compute dtype): "grouped" where it can run, else "megablocks" where it can,
                 else "reference" (docs/backends.md has the table)
The compute dtype is the autocast dtype inside ``torch.autocast`` (float64 excepted, as autocast does),
else x's dtype; the weights are cast to it, so a bfloat16 x with float32 weights computes in bfloat16.
A module can change device and dtype after construction (``.double()``, ``.to("cuda")``), so the backend
is resolved the first time each (device, compute dtype) is seen, then cached: a dictionary lookup per
call, no host sync. An explicit backend that cannot run in this environment raises ValueError at
construction; one that cannot handle a (device, dtype) raises ValueError at the first such call.
Every backend computes the same function on the same parameters; tests check they agree.

Weight layout (``ExpertConfig.layout``)
    "EDF" (the default): ``w_in_EDF (E, D, F)`` and ``w_out_EHD (E, H, D)``, multiplied as ``x @ w``.
    "EFD": ``w_in_EFD (E, F, D)`` and ``w_out_EDH (E, D, H)``, nn.Linear's order: transformers 5.x keeps
    its experts so (``gate_up_proj``, ``down_proj``), and ``mode.hf.to_mode_moe`` adopts those very tensors.
    Every backend computes on transposed views (``weights()``), so the function is the same; "megablocks"
    needs "EDF". ``w_in`` / ``w_out`` name the stored parameters whatever the layout.

Sharded weights (``mode.parallel.parallelize``)
    Expert parallelism may replace the weights (and the biases: every parameter of the bank, by name from
    ``named_parameters``) by DTensors of the global shape ``(E_all, ...)`` sharded on dim 0; ``num_experts``
    is then this process's share ``E = E_all / ep``. The forward computes on ``local_weight(w)``
    (``weights()``, ``biases()``): ``w.to_local()`` when the weight has one (duck typing: this module never
    imports ``torch.distributed``), else ``w`` itself. ``to_local`` is differentiable, so the gradient flows
    back to the sharded parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.experts import grouped_mm as gmm_mod, megablocks_backend, row_buckets
from mode.experts.grouped_mm import autocast_dtype, grouped_mm
from mode.experts.swiglu import swiglu
from mode.experts.swiglu_options import FUSED, GLU_ACTS, SwiGLUOptions
from mode.kernels.swiglu import gated_swiglu

ACTIVATIONS = ("gelu", "swiglu", "relu2")  # relu2: relu(h)^2, ungated (Nemotron-H's experts)
BACKENDS = ("auto", "reference", "grouped", "megablocks")
# Weight layouts: "EDF" (w_in_EDF (E, D, F), w_out_EHD (E, H, D): x @ w) or "EFD" (w_in_EFD (E, F, D),
# w_out_EDH (E, D, H): nn.Linear's order, as transformers 5.x stores its experts (gate_up_proj, down_proj) and
# torchtitan its w1/w2/w3). The bank computes with (E, D, F) / (E, H, D) views of either (``weights``).
LAYOUTS = ("EDF", "EFD")


@dataclass
class ExpertConfig:
    """The settings of an ``ExpertBank`` (checked when built: a bad value raises ``ValueError`` naming it).

    Args:
        d_model: the hidden size D.
        d_hidden: each expert's hidden size H.
        num_experts: the experts E in this bank.
        activation: "gelu", "swiglu" or "relu2".
        backend: "auto" (picked per device and dtype), "reference", "grouped" or "megablocks" (docs/backends.md).
        layout: how the weights are stored, "EDF" or "EFD"; the computation is the same.
        bias: biases after the input and the output projections (gpt-oss).
        swiglu_limit: SwiGLU: clamp the gate to max=L and up to [-L, L].
        swiglu_alpha: SwiGLU: ``gate * sigmoid(alpha * gate)``; None: silu.
        swiglu_up_offset: SwiGLU: ``(up + offset) * glu``.
        fused: SwiGLU: gate and up as the "concat" halves of F = 2H or "interleaved".
        swiglu_gate_softcap: SwiGLU: ``c * tanh(gate / c)`` as the gate's linear factor.
        swiglu_up_softcap: SwiGLU: ``c * tanh(up / c)``.
        glu_act: the gate's activation, "silu" (SwiGLU), "gelu" / "gelu_tanh" (GeGLU) or another of
            ``swiglu_options.GLU_ACTS`` (the gated experts of a transformers ``hidden_act``).
        gate_on_input: a routing gate scales each row's input instead of its output (Llama 4).
        fused_kernels: the plain SwiGLU runs as ``mode.kernels``' fused op (one op each way; Triton on CUDA,
            the torch reference elsewhere, bit for bit ``mode.experts.swiglu`` on the CPU); False keeps that path.
    """

    d_model: int
    d_hidden: int
    num_experts: int
    activation: str = "gelu"
    backend: str = "auto"
    layout: str = "EDF"  # how the weights are stored (LAYOUTS); the computation is the same
    bias: bool = False  # b_in_EF after the input projection, b_out_ED after the output one (gpt-oss)
    # SwiGLU variants (activation="swiglu" only; swiglu_options.py has the formula)
    swiglu_limit: float | None = None  # clamp gate to max=L and up to [-L, L] (DeepSeek-V4 10, gpt-oss 7)
    swiglu_alpha: float | None = None  # gate * sigmoid(alpha * gate); None: silu (gpt-oss 1.702)
    swiglu_up_offset: float = 0.0  # (up + offset) * glu (gpt-oss 1)
    fused: str = "concat"  # gate and up in F = 2H: "concat" halves or "interleaved" (gate 0::2, up 1::2: gpt-oss)
    swiglu_gate_softcap: float | None = None  # c * tanh(gate / c) as the linear gate factor (Inkling-2: 4)
    swiglu_up_softcap: float | None = None  # c * tanh(up / c) (Inkling-2: 25)
    glu_act: str = "silu"  # the gate's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU: Gemma-4), ... GLU_ACTS
    gate_on_input: bool = False  # gate_A scales each row's input, not its output (Llama 4)
    fused_kernels: bool = True  # the plain SwiGLU as mode.kernels' op (Triton on CUDA); False: mode.experts.swiglu

    def __post_init__(self) -> None:
        _checks.check_choice("layout", self.layout, LAYOUTS)
        _checks.check_int("d_model", self.d_model)
        _checks.check_int("d_hidden", self.d_hidden)
        _checks.check_int("num_experts", self.num_experts)
        _checks.check_choice("activation", self.activation, ACTIVATIONS)
        _checks.check_choice("backend", self.backend, BACKENDS)
        _checks.check_bool("bias", self.bias)
        _checks.check_bool("gate_on_input", self.gate_on_input)
        _checks.check_bool("fused_kernels", self.fused_kernels)
        if self.swiglu_limit is not None:
            _checks.check_positive("swiglu_limit", self.swiglu_limit)
        if self.swiglu_alpha is not None:
            _checks.check_positive("swiglu_alpha", self.swiglu_alpha)
        _checks.check_choice("glu_act", self.glu_act, tuple(GLU_ACTS))
        if self.glu_act != "silu" and self.swiglu_alpha is not None:
            raise ValueError(
                f"swiglu_alpha={self.swiglu_alpha}: only applies to glu_act='silu' (got glu_act={self.glu_act!r})"
            )
        for name in ("swiglu_gate_softcap", "swiglu_up_softcap"):
            if getattr(self, name) is not None:
                _checks.check_positive(name, getattr(self, name))
        if isinstance(self.swiglu_up_offset, bool) or not isinstance(self.swiglu_up_offset, (int, float)):
            raise TypeError(f"swiglu_up_offset={self.swiglu_up_offset!r}: must be a float")
        if not math.isfinite(self.swiglu_up_offset):
            raise ValueError(f"swiglu_up_offset={self.swiglu_up_offset}: must be finite")
        _checks.check_choice("fused", self.fused, FUSED)
        if self.activation != "swiglu":
            for name, value, default in (
                ("swiglu_limit", self.swiglu_limit, None),
                ("swiglu_alpha", self.swiglu_alpha, None),
                ("swiglu_up_offset", self.swiglu_up_offset, 0.0),
                ("swiglu_gate_softcap", self.swiglu_gate_softcap, None),
                ("swiglu_up_softcap", self.swiglu_up_softcap, None),
                ("glu_act", self.glu_act, "silu"),
                ("fused", self.fused, "concat"),
            ):
                if value != default:
                    raise ValueError(
                        f"{name}={value!r}: only applies to activation='swiglu' "
                        f"(activation={self.activation!r}); leave it at {default!r}"
                    )
        if self.bias and self.backend == "megablocks":
            raise ValueError(
                "bias=True: backend='megablocks' adds no biases; use backend='grouped', 'reference' or 'auto'"
            )

    @property
    def swiglu_options(self) -> SwiGLUOptions:
        """The SwiGLU fields (limit, alpha, up offset, fusion, softcaps, gate activation) as one ``SwiGLUOptions``; the
        bank's fused op runs where they are the defaults (``is_plain``)."""
        return SwiGLUOptions(
            self.swiglu_limit,
            self.swiglu_alpha,
            float(self.swiglu_up_offset),
            self.fused,
            self.swiglu_gate_softcap,
            self.swiglu_up_softcap,
            self.glu_act,
        )


def check_backend_environment(name: str, sizes: dict[str, int]) -> None:
    """Construction-time check of an explicit backend: does this torch / machine have it at all?"""
    if name == "grouped":
        # float32 has the loosest size rule: a size that fails it fails every dtype.
        reason = gmm_mod.unsupported_reason("cpu", torch.float32, sizes)
        if reason is not None:
            raise ValueError(f"backend='grouped': {reason}; use backend='reference' or 'auto'")
    elif name == "megablocks":
        megablocks_backend.require()


def resolve_backend(
    name: str,
    device_type: str,
    dtype: torch.dtype,
    sizes: dict[str, int],
    num_experts: int | None = None,
    bias: bool = False,
) -> str:
    """The concrete backend for ``name`` on (device_type, dtype), or ValueError with the reason it cannot run.

    ``sizes`` are the row lengths the GEMMs see (``{"d_model": D, "d_hidden": H}``); ``num_experts`` the
    experts on this process (torch._grouped_mm on CUDA runs at most 1023); ``bias``: the bank has biases,
    which "megablocks" does not add ("auto" then skips it)."""
    if name == "reference":
        return "reference"
    grouped_reason = gmm_mod.unsupported_reason(device_type, dtype, sizes, num_experts)
    if name == "grouped":
        if grouped_reason is not None:
            raise ValueError(f"backend='grouped': {grouped_reason}; use backend='reference' or 'auto'")
        return "grouped"
    if name == "auto" and grouped_reason is None:
        return "grouped"
    mb_reason = "it adds no biases (bias=True)" if bias else megablocks_backend.unsupported_reason(device_type, dtype)
    if name == "megablocks":
        if mb_reason is not None:
            raise ValueError(f"backend='megablocks': {mb_reason}; use backend='reference' or 'auto'")
        return "megablocks"
    assert name == "auto", name
    return "megablocks" if mb_reason is None else "reference"


def local_weight(w: Tensor) -> Tensor:
    """The part of an expert weight this process computes with: ``w.to_local()`` for a sharded DTensor
    (set by ``mode.parallel``), else ``w``."""
    to_local = getattr(w, "to_local", None)
    return w if to_local is None else to_local()


def activate(h_AF: Tensor, activation: str) -> Tensor:
    if activation == "gelu":
        return F.gelu(h_AF)
    if activation == "relu2":
        return F.relu(h_AF).square()
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    return F.silu(gate_AH) * up_AH


class ExpertBank(nn.Module):
    """E MLP experts, computing on rows already grouped by expert: row ``a`` of expert ``e`` gets
    ``act(x_a @ W_in[e]) @ W_out[e]`` (the module doc has the full function and the padding contract).

    Shape legend: A rows (the first ``counts_E.sum()`` grouped by expert, then padding), D hidden, H expert
    hidden, F = H or 2H (swiglu), E experts.

    Parameters: ``w_in_EDF`` (E, D, F) and ``w_out_EHD`` (E, H, D) (layout "EFD": ``w_in_EFD``, ``w_out_EDH``),
    with ``bias`` also ``b_in_EF`` and ``b_out_ED``.

    Args:
        cfg: an ``ExpertConfig``.
    """

    def __init__(self, cfg: ExpertConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.sizes = {"d_model": cfg.d_model, "d_hidden": cfg.d_hidden}  # F = H or 2H: aligned with H
        check_backend_environment(cfg.backend, self.sizes)
        if cfg.backend == "megablocks" and cfg.layout != "EDF":
            raise ValueError(
                f"layout={cfg.layout!r}: backend='megablocks' needs contiguous (E, D, F) weights, layout='EDF'"
            )
        width = 2 * cfg.d_hidden if cfg.activation == "swiglu" else cfg.d_hidden
        E, D, H = cfg.num_experts, cfg.d_model, cfg.d_hidden
        if cfg.layout == "EDF":
            self.w_in_EDF = nn.Parameter(torch.empty(E, D, width))
            self.w_out_EHD = nn.Parameter(torch.empty(E, H, D))
            self._names = ("w_in_EDF", "w_out_EHD")
        else:
            self.w_in_EFD = nn.Parameter(torch.empty(E, width, D))
            self.w_out_EDH = nn.Parameter(torch.empty(E, D, H))
            self._names = ("w_in_EFD", "w_out_EDH")
        if cfg.bias:  # registered after the weights: the weights keep their place in parameters()
            self.b_in_EF = nn.Parameter(torch.empty(E, width))
            self.b_out_ED = nn.Parameter(torch.empty(E, D))
        self._transposed = cfg.layout == "EFD"  # chosen once: views in weights()
        self.reset_parameters()
        # the activation, chosen once: swiglu.py's fused op (the grouped path) where the options are the default
        # ones, else SwiGLUOptions' plain autograd (swiglu_options.py); the reference path calls self._act
        options = cfg.swiglu_options
        self._fast_swiglu = cfg.activation == "swiglu" and options.is_plain
        self._swiglu = gated_swiglu if cfg.fused_kernels else swiglu  # mode.kernels' op, or mode.experts'
        if cfg.activation == "swiglu" and not options.is_plain:
            self._act = options
        else:
            self._act = functools.partial(activate, activation=cfg.activation)  # a partial pickles, a lambda not
        self._impls = {
            "reference": self._forward_reference,
            "grouped": self._forward_grouped,
            "megablocks": self._forward_megablocks,
        }
        self._resolved: dict[tuple[torch.device, torch.dtype], str] = {}  # (device, compute dtype) -> backend
        # "grouped" multiplies by routing gates on the (A, H) activation when it is smaller than the (A, D) output
        # (inside the fused SwiGLU op where it runs); not with an output bias: g * (act @ W_out + b_out) is the
        # function, so the gate goes on the output. Gating the hidden activation whenever the fused op runs would
        # save 4-6 operators per step where H >= D, but rounds differently from transformers' experts (which
        # gate the output): converted models would no longer match them to float32 rounding (docs/performance.md)
        self._gate_on_hidden = cfg.d_hidden < cfg.d_model and not cfg.bias
        self._gate_on_input = cfg.gate_on_input  # Llama 4: gate_A scales the input rows (forward)

    def set_backend(self, backend: str) -> None:
        """Choose another backend (``BACKENDS``) for the next forward, with the construction-time checks."""
        cfg = dataclasses.replace(self.cfg, backend=backend)  # validated by ExpertConfig
        check_backend_environment(backend, self.sizes)
        if backend == "megablocks" and cfg.layout != "EDF":
            raise ValueError(
                f"layout={cfg.layout!r}: backend='megablocks' needs contiguous (E, D, F) weights, layout='EDF'"
            )
        self.cfg = cfg
        self._resolved.clear()

    @property
    def gates_inside(self) -> bool:
        """Whether ``forward(..., gate_A=)`` applies the gates inside the experts' computation (on the (A, H)
        hidden activation, or on the input rows) rather than multiplying the (A, D) output rows, which a
        weighted combine does as well (``MoELayer`` then leaves the gates to the dispatcher)."""
        return self._gate_on_hidden or self._gate_on_input

    def reset_parameters(self, out_std: float | None = None) -> None:
        """Draw the weights again, in place: ``w_in`` normal with std ``1/sqrt(d_model)``, ``w_out`` normal with std
        ``out_std`` (None: ``1/sqrt(d_hidden)``); the biases (``cfg.bias``) zeros."""
        nn.init.normal_(self.w_in, std=1 / math.sqrt(self.cfg.d_model))
        nn.init.normal_(self.w_out, std=out_std or 1 / math.sqrt(self.cfg.d_hidden))
        if self.cfg.bias:  # zeros: no random draws, so every other parameter's init is what it was without biases
            nn.init.zeros_(self.b_in_EF)
            nn.init.zeros_(self.b_out_ED)

    @property
    def w_in(self) -> nn.Parameter:
        """The input weight as stored: ``w_in_EDF`` or ``w_in_EFD`` (``cfg.layout``)."""
        return getattr(self, self._names[0])

    @property
    def w_out(self) -> nn.Parameter:
        """The output weight as stored: ``w_out_EHD`` or ``w_out_EDH``."""
        return getattr(self, self._names[1])

    def weights(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The weights this process computes with, as ``(w_in_EDF, w_out_EHD)`` (views of an "EFD" bank's,
        local shards of sharded ones), cast to ``dtype`` when given."""
        w_in, w_out = local_weight(self.w_in), local_weight(self.w_out)
        if dtype is not None:
            w_in, w_out = w_in.to(dtype), w_out.to(dtype)
        if self._transposed:
            return w_in.transpose(1, 2), w_out.transpose(1, 2)
        return w_in, w_out

    def biases(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor] | None:
        """``(b_in_EF, b_out_ED)`` as this process computes with them (local shards of sharded ones, as
        ``weights``), cast to ``dtype`` when given; None without ``cfg.bias``."""
        if not self.cfg.bias:
            return None
        b_in, b_out = local_weight(self.b_in_EF), local_weight(self.b_out_ED)
        if dtype is not None:
            b_in, b_out = b_in.to(dtype), b_out.to(dtype)
        return b_in, b_out

    @property
    def backend(self) -> str:
        """The backend that runs an input in the weights' own dtype on their device."""
        return self.backend_for(self.w_in.device, self.w_in.dtype)

    def backend_for(self, device: torch.device, dtype: torch.dtype) -> str:
        """The backend (one of ``BACKENDS``) that runs an input of ``dtype`` on ``device``: ``cfg.backend``, or what
        ``"auto"`` resolves to there. Resolved once per (device, dtype), then cached."""
        key = (device, dtype)
        name = self._resolved.get(key)
        if name is None:
            name = self._resolved[key] = resolve_backend(
                self.cfg.backend, device.type, dtype, self.sizes, self.num_experts, self.cfg.bias
            )
        return name

    def forward(self, x_AD: Tensor, counts_E: Tensor, *, padded: bool = True, gate_A: Tensor | None = None) -> Tensor:
        """Compute every expert on its rows.

        Returns ``y_AD``: row a's expert output (times ``gate_A[a]`` when given); padding rows are exactly zero.

        ``x_AD``: the rows, the first ``counts_E.sum()`` grouped by expert (A may be 0).
        ``counts_E`` (integer, on x's device): each expert's number of rows, in order; rows past
        ``counts_E.sum()`` are padding (zero output, zero gradient; see the module docstring).

        ``padded=False`` promises ``counts_E.sum() == A`` (a dropless plan without no-op experts or a
        mask, known when the router is built): "grouped" then skips its two padding masks, four passes
        over (A, D). The promise is not checked (that would be a host sync); breaking it leaves the rows
        past ``counts_E.sum()`` undefined.

        ``gate_A`` (A,), optional and differentiable: multiply row a's output by ``gate_A[a]`` (a routing
        gate; padding rows ignore theirs). "grouped" applies it to the (A, H) activation, before the down
        projection, when H < D and the bank has no biases (fewer bytes than the (A, D) output; the same
        function, rounded differently), else to the output, as the dispatcher's combine would. With
        ``cfg.gate_on_input`` the gate multiplies row a's input instead, and the output is not gated
        (Llama 4: ``expert(g * x)``, a different function since the expert is not linear)."""
        self._check_inputs(x_AD, counts_E)
        if gate_A is not None:
            if (
                not isinstance(gate_A, Tensor)
                or not gate_A.is_floating_point()
                or tuple(gate_A.shape) != (x_AD.shape[0],)
            ):
                raise ValueError(
                    f"gate_A: must be a floating tensor of shape (A,)=({x_AD.shape[0]},), got "
                    f"{getattr(gate_A, 'dtype', type(gate_A))} {tuple(getattr(gate_A, 'shape', ()))}"
                )
            if padded:  # padding rows ignore their gate (where: NaN-safe, and their gate gets zero gradient)
                real_A = torch.arange(x_AD.shape[0], device=x_AD.device) < counts_E.sum()
                gate_A = torch.where(real_A, gate_A, 0)
            if self._gate_on_input:  # padding rows may turn NaN here; every backend masks or skips them
                x_AD, gate_A = x_AD * gate_A.to(x_AD.dtype)[:, None], None
        dtype = autocast_dtype(x_AD) or x_AD.dtype
        name = self.backend_for(x_AD.device, dtype)
        if name == "grouped":
            if x_AD.is_cuda and dtype != torch.bfloat16:  # torch's looped fallback: warns once per process
                gmm_mod.warn_if_slow(x_AD.device.type, dtype)
            return self._forward_grouped(x_AD, counts_E, dtype, padded=padded, gate_A=gate_A)
        y_AD = self._impls[name](x_AD, counts_E, dtype)
        return y_AD if gate_A is None else y_AD * gate_A.to(y_AD.dtype)[:, None]

    def _check_inputs(self, x_AD: Tensor, counts_E: Tensor) -> None:
        """Metadata only: no host sync."""
        if not isinstance(x_AD, Tensor) or not x_AD.is_floating_point():
            raise TypeError(f"x_AD: must be a floating torch.Tensor, got {getattr(x_AD, 'dtype', type(x_AD))}")
        if x_AD.dim() != 2 or x_AD.shape[1] != self.cfg.d_model:
            raise ValueError(f"x_AD.shape={tuple(x_AD.shape)}: must be (A, d_model={self.cfg.d_model})")
        if (
            not isinstance(counts_E, Tensor)
            or counts_E.is_floating_point()
            or counts_E.is_complex()
            or counts_E.dtype == torch.bool
        ):
            raise TypeError(f"counts_E: must be an integer torch.Tensor, got {getattr(counts_E, 'dtype', counts_E)}")
        if tuple(counts_E.shape) != (self.num_experts,):
            raise ValueError(f"counts_E.shape={tuple(counts_E.shape)}: must be (num_experts,)=({self.num_experts},)")
        if counts_E.device != x_AD.device:
            raise ValueError(f"counts_E.device={counts_E.device}: must be x_AD's device ({x_AD.device})")

    def _forward_reference(self, x_AD: Tensor, counts_E: Tensor, dtype: torch.dtype) -> Tensor:
        counts = counts_E.tolist()  # host sync, reference path only
        num_padding = _check_host_counts(counts, x_AD.shape[0])
        x_AD = x_AD.to(dtype)
        # unbind once: indexing w[e] per expert makes each backward fill a zero grad of the whole (E, ...) weight
        w_in_EDF, w_out_EHD = self.weights(dtype)
        w_in, w_out = w_in_EDF.unbind(0), w_out_EHD.unbind(0)
        biases = self.biases(dtype)
        b_in, b_out = (None, None) if biases is None else (biases[0].unbind(0), biases[1].unbind(0))
        *pieces, _padding = x_AD.split([*counts, num_padding])  # padding rows are never read: no NaN gets in
        outs = []
        for e, x_eD in enumerate(pieces):
            h_eF = x_eD @ w_in[e]
            if b_in is not None:
                h_eF = h_eF + b_in[e]
            y_eD = self._act(h_eF) @ w_out[e]
            if b_out is not None:
                y_eD = y_eD + b_out[e]
            outs.append(y_eD)
        # zeros in the outputs' dtype: torch.cat under autocast would promote to the widest input
        outs.append(outs[0].new_zeros(num_padding, self.cfg.d_model))
        return torch.cat(outs)

    def _forward_grouped(
        self, x_AD: Tensor, counts_E: Tensor, dtype: torch.dtype, padded: bool = True, gate_A: Tensor | None = None
    ) -> Tensor:
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        x_AD = x_AD.to(dtype)
        if padded:
            # rows at or past offsets_E[-1] are padding; the comparison stays on the device (no sync)
            real_A1 = (torch.arange(x_AD.shape[0], device=x_AD.device) < offsets_E[-1]).unsqueeze(1)
            x_AD = torch.where(real_A1, x_AD, 0)  # NaN-safe, and where's gradient there is exactly 0
        gate_hidden_A = gate_A if self._gate_on_hidden else None
        if row_buckets.needed(x_AD.device.type, dtype, x_AD.shape[0], counts_E.shape[0]):
            # kernels compiled per shape (oneDNN, CPU bf16/fp16): group sizes from a small set (row_buckets.py)
            bucket_offsets_E, dest_A, R = row_buckets.bucketed_layout(counts_E, x_AD.shape[0])
            x_RD = x_AD.new_zeros(R, x_AD.shape[1]).index_copy(0, dest_A, x_AD)
            gate_hidden_R = (
                None if gate_hidden_A is None else gate_hidden_A.new_zeros(R).index_copy(0, dest_A, gate_hidden_A)
            )
            y_AD = self._grouped_mlp(x_RD, bucket_offsets_E, dtype, gate_hidden_R).index_select(0, dest_A)
        else:
            y_AD = self._grouped_mlp(x_AD, offsets_E, dtype, gate_hidden_A)
        if padded:
            y_AD = torch.where(real_A1, y_AD, 0)  # the kernel leaves padding rows unwritten (any bits)
        if gate_A is not None and gate_hidden_A is None:
            y_AD = y_AD * gate_A.to(y_AD.dtype)[:, None]
        return y_AD

    def _grouped_mlp(self, x_AD: Tensor, offsets_E: Tensor, dtype: torch.dtype, gate_A: Tensor | None) -> Tensor:
        """The two grouped GEMMs and the activation (times ``gate_A`` on the hidden activation when given);
        rows past ``offsets_E[-1]`` come out undefined."""
        w_in, w_out = self.weights(dtype)
        biases = self.biases(dtype)
        h_AF = grouped_mm(x_AD, w_in, offsets_E)
        if biases is not None:
            # each row's expert, found on the device (no sync); rows past offsets_E[-1] get E, a zero bias row
            # appended here: the kernels leave those rows' gradients unwritten (any bits), so they must sum
            # into a row that is thrown away, not into expert E - 1's bias gradient
            expert_A = torch.searchsorted(
                offsets_E, torch.arange(x_AD.shape[0], device=x_AD.device, dtype=offsets_E.dtype), right=True
            )
            b_in_EF, b_out_ED = (torch.cat([b, b.new_zeros(1, b.shape[1])]) for b in biases)
            h_AF = h_AF + b_in_EF.index_select(0, expert_A)
        if self._fast_swiglu:  # the same values as activate(); one gradient buffer (swiglu.py)
            act_AH = self._swiglu(h_AF, gate_A)
        else:
            act_AH = self._act(h_AF)
            if gate_A is not None:
                act_AH = act_AH * gate_A.to(act_AH.dtype)[:, None]
        y_AD = grouped_mm(act_AH, w_out, offsets_E)
        if biases is not None:  # gate_A is None here: a bank with biases gates its output (_gate_on_hidden)
            y_AD = y_AD + b_out_ED.index_select(0, expert_A)
        return y_AD

    def _forward_megablocks(self, x_AD: Tensor, counts_E: Tensor, dtype: torch.dtype) -> Tensor:
        return megablocks_backend.expert_mlp(x_AD, counts_E, *self.weights(), dtype, self._act)


def _check_host_counts(counts: list[int], num_rows: int) -> int:
    """Validate counts read on the host against the padding contract; return the number of padding rows."""
    if any(c < 0 for c in counts):
        raise ValueError(f"counts_E={counts}: must be >= 0")
    if sum(counts) > num_rows:
        raise ValueError(
            f"counts_E.sum()={sum(counts)}: must be <= x_AD.shape[0]={num_rows} (rows past counts_E.sum() are padding)"
        )
    return num_rows - sum(counts)
