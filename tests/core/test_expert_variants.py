"""Expert bank variants the transformers MoE families need: biases, SwiGLU options, gates on the input.

Every backend computes the same function (outputs and all gradients), keeps the padding contract with the
new options, and the options compute what transformers' own expert classes compute on the same tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from scaled_close import assert_close_scaled

from mode.experts import ExpertBank, ExpertConfig, bank as bank_mod
from mode.experts.grouped_mm import grouped_mm_available

# float32 results summed in another order: max |d| <= REL * max |expected| (tests/scaled_close.py)
REL = 1e-5

pytestmark = pytest.mark.skipif(not grouped_mm_available(), reason="compares against backend='grouped' (torch>=2.9)")

D, H = 16, 24
COUNTS, N_PAD = [3, 0, 5, 2], 3
GPT_OSS = dict(
    activation="swiglu", bias=True, fused="interleaved", swiglu_alpha=1.702, swiglu_limit=1.0, swiglu_up_offset=1.0
)  # limit 1 (gpt-oss has 7) so that the clamps bite on unit-scale rows
VARIANTS = {
    "gelu_bias": dict(activation="gelu", bias=True),
    "swiglu_bias": dict(activation="swiglu", bias=True),  # the fused swiglu op plus biases
    "limit": dict(activation="swiglu", swiglu_limit=0.5),  # DeepSeek-V4 (10 there)
    "alpha": dict(activation="swiglu", swiglu_alpha=1.702),
    "offset": dict(activation="swiglu", swiglu_up_offset=1.0),
    "interleaved": dict(activation="swiglu", fused="interleaved"),
    "gpt_oss": GPT_OSS,
    "gate_on_input": dict(activation="swiglu", gate_on_input=True),  # Llama 4
    "everything": dict(GPT_OSS, gate_on_input=True),
}


def make_bank(backend, variant, *, layout="EDF", hidden=H, dtype=torch.float32):
    """The same weights and (non-zero) biases for every backend and layout: drawn as EDF, transposed for EFD."""
    opts = VARIANTS[variant]
    torch.manual_seed(0)
    bank = ExpertBank(
        ExpertConfig(d_model=D, d_hidden=hidden, num_experts=len(COUNTS), backend=backend, layout=layout, **opts)
    )
    torch.manual_seed(1)
    width = 2 * hidden if opts["activation"] == "swiglu" else hidden
    w_in = torch.randn(len(COUNTS), D, width) / math.sqrt(D)
    w_out = torch.randn(len(COUNTS), hidden, D) / math.sqrt(hidden)
    with torch.no_grad():
        if layout == "EDF":
            bank.w_in_EDF.copy_(w_in), bank.w_out_EHD.copy_(w_out)
        else:
            bank.w_in_EFD.copy_(w_in.transpose(1, 2)), bank.w_out_EDH.copy_(w_out.transpose(1, 2))
        if bank.cfg.bias:
            bank.b_in_EF.copy_(torch.randn(len(COUNTS), width))
            bank.b_out_ED.copy_(torch.randn(len(COUNTS), D))
    return bank.to(dtype)


def hand_expert(x_D, e, bank, gate=None):
    """One row, float64, the formulas of gpt-oss / DeepSeek-V4 / Llama 4 written out (not via the bank)."""
    cfg = bank.cfg
    w_in, w_out = (w.detach().double() for w in bank.weights())
    if gate is not None and cfg.gate_on_input:
        x_D = x_D * gate
    h = x_D.double() @ w_in[e]
    if cfg.bias:
        h = h + bank.b_in_EF[e].detach().double()
    if cfg.activation == "gelu":
        act = F.gelu(h)
    else:
        g, u = (h[0::2], h[1::2]) if cfg.fused == "interleaved" else (h[: cfg.d_hidden], h[cfg.d_hidden :])
        if cfg.swiglu_limit is not None:
            g, u = g.clamp(max=cfg.swiglu_limit), u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        act = g * torch.sigmoid((cfg.swiglu_alpha or 1.0) * g) * (u + cfg.swiglu_up_offset)
    y = act @ w_out[e]
    if cfg.bias:
        y = y + bank.b_out_ED[e].detach().double()
    if gate is not None and not cfg.gate_on_input:
        y = y * gate
    return y


def inputs(dtype=torch.float32, poison=None):
    torch.manual_seed(2)
    A = sum(COUNTS) + N_PAD
    x, gate, grad_out = torch.randn(A, D), torch.rand(A), torch.randn(A, D)
    if poison is not None:
        x[sum(COUNTS) :], gate[sum(COUNTS) :] = poison, poison
    return x.to(dtype), gate, grad_out.to(dtype)


def run(bank, x, gate, grad_out, with_gate=True):
    xr, gr = x.clone().requires_grad_(), gate.clone().requires_grad_()
    y = bank(xr, torch.tensor(COUNTS, device=x.device), gate_A=gr if with_gate else None)
    y.backward(grad_out)
    grads = {
        n: p.grad.transpose(1, 2) if p.dim() == 3 and bank.cfg.layout == "EFD" else p.grad
        for n, p in zip(["w_in", "w_out", "b_in", "b_out"], bank.parameters())
    }
    return {"y": y.detach(), "x.grad": xr.grad, **({"gate.grad": gr.grad} if with_gate else {}), **grads}


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_matches_hand_formula(variant):
    bank = make_bank("reference", variant)
    x, gate, _ = inputs()
    y = bank(x, torch.tensor(COUNTS), gate_A=gate)
    expert_of_row = [e for e, c in enumerate(COUNTS) for _ in range(c)]
    want = torch.stack([hand_expert(x[a], e, bank, gate[a]) for a, e in enumerate(expert_of_row)])
    torch.testing.assert_close(y[: len(expert_of_row)].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[len(expert_of_row) :], torch.zeros(N_PAD, D))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["EDF", "EFD"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("with_gate", [True, False])
def test_every_backend_matches_reference_outputs_and_all_gradients(variant, layout, dtype, tol, with_gate):
    """grouped vs reference in this layout, and both vs the EDF reference: outputs, x, gate, weights, biases."""
    x, gate, grad_out = inputs(dtype)
    want = run(make_bank("reference", variant, dtype=dtype), x, gate, grad_out, with_gate)
    assert len(want) == (7 if VARIANTS[variant].get("bias") else 5) - (0 if with_gate else 1)
    for backend in ("reference", "grouped"):
        bank = make_bank(backend, variant, layout=layout, dtype=dtype)
        assert bank.backend == backend
        got = run(bank, x, gate, grad_out, with_gate)
        for name in want:
            torch.testing.assert_close(
                got[name].float(), want[name].float(), rtol=tol, atol=tol, msg=f"{backend} {layout} {name}"
            )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_padding_rows_with_nan_give_zero_output_and_zero_gradient(variant, backend, poison):
    """Biases would make a padding row non-zero and gate_on_input puts NaN * 0 into it: neither leaks."""
    x, gate, grad_out = inputs(poison=poison)
    bank = make_bank(backend, variant)
    got = run(bank, x, gate, grad_out)
    N = sum(COUNTS)
    assert torch.equal(got["y"][N:], torch.zeros(N_PAD, D))
    assert torch.equal(got["x.grad"][N:], torch.zeros(N_PAD, D))
    assert torch.equal(got["gate.grad"][N:], torch.zeros(N_PAD))
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
    clean = run(make_bank(backend, variant), *inputs()[:2], grad_out)  # the real rows do not see the padding
    for name in got:
        torch.testing.assert_close(
            got[name][:N] if name in ("y", "x.grad", "gate.grad") else got[name],
            clean[name][:N] if name in ("y", "x.grad", "gate.grad") else clean[name],
            rtol=1e-6,
            atol=1e-6,
            msg=name,
        )


def test_bucketed_rows_with_biases_match_reference():
    """CPU bfloat16 with >= 256 rows per expert lays rows out at bucketed sizes (row_buckets.py): the gap rows
    get a bias in the hidden activation but are never read back, and add nothing to any gradient."""
    counts = [400, 0, 361, 270]
    A = sum(counts) + 5
    torch.manual_seed(3)
    x, gate, grad_out = torch.randn(A, D, dtype=torch.bfloat16), torch.rand(A), torch.randn(A, D, dtype=torch.bfloat16)
    x[sum(counts) :] = float("nan")
    got = {}
    for backend in ("reference", "grouped"):
        torch.manual_seed(0)
        bank = ExpertBank(ExpertConfig(d_model=D, d_hidden=H, num_experts=4, backend=backend, **GPT_OSS))
        with torch.no_grad():
            bank.b_in_EF.normal_(), bank.b_out_ED.normal_()
        bank = bank.to(torch.bfloat16)
        xr, gr = x.clone().requires_grad_(), gate.clone().requires_grad_()
        y = bank(xr, torch.tensor(counts), gate_A=gr)
        y.backward(grad_out)
        got[backend] = [y, xr.grad, gr.grad, *(p.grad for p in bank.parameters())]
    assert bank_mod.row_buckets.needed("cpu", torch.bfloat16, A, 4)
    for g, w in zip(got["grouped"], got["reference"]):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=6e-2)
    assert torch.equal(got["grouped"][0][sum(counts) :].float(), torch.zeros(5, D))


@pytest.mark.parametrize("variant", ["gpt_oss", "everything"])
@pytest.mark.parametrize("mode", ["bf16_input", "autocast"])
def test_mixed_precision_backends_agree(variant, mode):
    """float32 parameters, computed in bfloat16 (a bfloat16 input, or CPU autocast): biases are cast with the
    weights; outputs in bfloat16, parameter gradients in float32."""
    x, gate, grad_out = inputs()
    got = {}
    for backend in ("reference", "grouped"):
        bank = make_bank(backend, variant)
        xr = x.to(torch.bfloat16 if mode == "bf16_input" else torch.float32).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            y = bank(xr, torch.tensor(COUNTS), gate_A=gate)
        assert y.dtype == torch.bfloat16
        y.float().backward(grad_out)
        assert all(p.grad.dtype == torch.float32 for p in bank.parameters())
        got[backend] = [y, xr.grad, *(p.grad for p in bank.parameters())]
    for g, w in zip(got["grouped"], got["reference"]):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels: needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore::mode.experts.grouped_mm.SlowPathWarning")  # float32 on CUDA: torch's loop
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_grouped_matches_reference_with_nan_padding(variant, dtype, tol):
    """torch._grouped_mm on CUDA leaves the rows past the last offset unwritten, gradients included: with
    biases those rows' gradients must not reach any expert's bias gradient."""
    dev = torch.device("cuda")
    x, gate, grad_out = (t.to(dev) for t in inputs(dtype, poison=float("nan")))
    ref, fast = (make_bank(b, variant, dtype=dtype).to(dev) for b in ("reference", "grouped"))
    assert fast.backend == "grouped"
    got, want = run(fast, x, gate, grad_out), run(ref, x, gate, grad_out)
    N = sum(COUNTS)
    assert torch.equal(got["y"][N:], torch.zeros_like(got["y"][N:]))
    assert torch.equal(got["x.grad"][N:], torch.zeros_like(got["x.grad"][N:]))
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("variant", ["gelu_bias", "swiglu_bias", "gpt_oss"])
@pytest.mark.parametrize("hidden", [8, 24])  # without biases H < D gates the (A, H) activation: not with them
@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_gate_inside_the_bank_is_gating_the_output_bias_included(variant, hidden, backend):
    """bank(x, gate_A=g) == g * (act @ W_out + b_out), i.e. bank(x) * g, values and gradients."""
    x, gate, grad_out = inputs()
    N = sum(COUNTS)
    bank = make_bank(backend, variant, hidden=hidden)
    assert not bank._gate_on_hidden
    inside = run(bank, x, gate, grad_out)
    bank = make_bank(backend, variant, hidden=hidden)
    xr, gr = x.clone().requires_grad_(), gate.clone().requires_grad_()
    y = bank(xr, torch.tensor(COUNTS)) * torch.where(torch.arange(len(gate)) < N, gr, 0)[:, None]
    y.backward(grad_out)
    outside = [y.detach(), xr.grad, gr.grad, *(p.grad for p in bank.parameters())]
    for (name, g), w in zip(inside.items(), outside):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", ["gate_on_input", "everything"])
@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_gate_on_input_is_the_expert_of_the_scaled_input(variant, backend):
    """gate_on_input: bank(x, gate_A=g) == bank(g * x) (no gate on the output), values and gradients."""
    x, gate, grad_out = inputs()
    N = sum(COUNTS)
    inside = run(make_bank(backend, variant), x, gate, grad_out)
    bank = make_bank(backend, variant)
    xr, gr = x.clone().requires_grad_(), gate.clone().requires_grad_()
    y = bank(xr * torch.where(torch.arange(len(gate)) < N, gr, 0)[:, None], torch.tensor(COUNTS))
    y.backward(grad_out)
    outside = [y.detach(), xr.grad, gr.grad, *(p.grad for p in bank.parameters())]
    for (name, g), w in zip(inside.items(), outside):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)
    gated_output = make_bank(backend, variant)(x, torch.tensor(COUNTS)) * gate[:, None]  # a different function
    assert not torch.allclose(gated_output[:N], inside["y"][:N])


# -- defaults, parameters, paths chosen once ------------------------------------------------------------


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("layout", ["EDF", "EFD"])
def test_biases_come_after_the_weights_start_at_zero_and_keep_the_weights_init(activation, layout):
    cfg = dict(d_model=D, d_hidden=H, num_experts=4, activation=activation, layout=layout)
    torch.manual_seed(0)
    plain = ExpertBank(ExpertConfig(**cfg))
    plain_next = torch.rand(3)
    torch.manual_seed(0)
    biased = ExpertBank(ExpertConfig(**cfg, bias=True))
    assert torch.equal(torch.rand(3), plain_next)  # the biases' init draws nothing
    names = [n for n, _ in biased.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()] + ["b_in_EF", "b_out_ED"]
    width = 2 * H if activation == "swiglu" else H
    assert biased.b_in_EF.shape == (4, width) and biased.b_out_ED.shape == (4, D)
    assert not biased.b_in_EF.any() and not biased.b_out_ED.any()
    assert torch.equal(biased.w_in, plain.w_in) and torch.equal(biased.w_out, plain.w_out)
    x, counts = torch.randn(sum(COUNTS), D), torch.tensor(COUNTS)
    for backend in ("reference", "grouped"):  # zero biases: the plain bank's function
        torch.manual_seed(0)
        plain = ExpertBank(ExpertConfig(**cfg, backend=backend))
        torch.manual_seed(0)
        biased = ExpertBank(ExpertConfig(**cfg, backend=backend, bias=True))
        torch.testing.assert_close(biased(x, counts), plain(x, counts), rtol=0, atol=0)


def test_paths_are_chosen_once():
    assert make_bank("grouped", "swiglu_bias")._fast_swiglu  # default SwiGLU options: swiglu.py's fused op
    for variant in ("limit", "alpha", "offset", "interleaved", "gpt_oss"):
        bank = make_bank("grouped", variant)
        assert not bank._fast_swiglu and bank._act == bank.cfg.swiglu_options, variant
    assert make_bank("grouped", "gate_on_input", hidden=8)._gate_on_hidden  # no biases, H < D
    assert not make_bank("grouped", "gpt_oss", hidden=8)._gate_on_hidden  # biases: gate the output


def test_biases_go_through_local_weight(monkeypatch):
    """Expert parallelism shards every bank parameter on dim 0; the forward must take the local shard of the
    biases too (``local_weight``)."""
    bank = make_bank("grouped", "gpt_oss")
    seen = []
    real = bank_mod.local_weight
    monkeypatch.setattr(bank_mod, "local_weight", lambda w: (seen.append(w), real(w))[1])
    bank(torch.randn(sum(COUNTS), D), torch.tensor(COUNTS))
    assert any(w is bank.b_in_EF for w in seen) and any(w is bank.b_out_ED for w in seen)


def test_sharding_a_biased_bank_keeps_each_experts_rows():
    from mode.parallel.ep_model import shard_experts

    full = make_bank("reference", "gpt_oss")
    shard = shard_experts(full, 1, 2)
    assert shard.cfg.bias and shard.num_experts == 2
    for name, p in shard.named_parameters():
        assert torch.equal(p, getattr(full, name)[2:]), name


# -- against transformers' own expert classes --------------------------------------------------------------


def _grouped_rows(top_k_index_TK, top_k_weights_TK, E):
    """The (token, expert) pairs of a top-k routing grouped by expert: token_A, gate_A, counts_E."""
    T, K = top_k_index_TK.shape
    expert_A = top_k_index_TK.reshape(-1)
    order_A = torch.argsort(expert_A, stable=True)
    token_A = torch.arange(T).repeat_interleave(K)[order_A]
    return token_A, top_k_weights_TK.reshape(-1)[order_A], torch.bincount(expert_A, minlength=E)


def _bank_moe(bank, x_TD, top_k_index_TK, top_k_weights_TK):
    token_A, gate_A, counts_E = _grouped_rows(top_k_index_TK, top_k_weights_TK, bank.num_experts)
    y_AD = bank(x_TD[token_A], counts_E, gate_A=gate_A)
    return torch.zeros_like(x_TD).index_add(0, token_A, y_AD)


def _eager_forward(experts, *args):
    """transformers' own loop (``use_experts_implementation`` wraps it; ``__wrapped__`` is the original)."""
    forward = type(experts).forward
    return getattr(forward, "__wrapped__", forward)(experts, *args)


def _routing(T, E, K):
    torch.manual_seed(5)
    index_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return index_TK, torch.softmax(torch.randn(T, K), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_options_are_bitwise_transformers_apply_gate(dtype):
    """SwiGLUOptions runs gpt-oss's and DeepSeek-V4's ``_apply_gate`` ops in their order: the same bits."""
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from mode.experts.swiglu_options import SwiGLUOptions

    config = GptOssConfig(
        hidden_size=D,
        intermediate_size=H,
        num_local_experts=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=32,
    )
    h = (torch.randn(50, 2 * H) * 6).to(dtype)  # well past the limits
    gpt_oss = SwiGLUOptions(limit=config.swiglu_limit, alpha=config.swiglu_alpha, up_offset=1.0, fused="interleaved")
    assert torch.equal(gpt_oss(h), GptOssExperts(config)._apply_gate(h))
    try:
        from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    except ImportError:
        return
    config = DeepseekV4Config(
        hidden_size=D, moe_intermediate_size=H, n_routed_experts=2, num_hidden_layers=1, vocab_size=32
    )
    assert torch.equal(SwiGLUOptions(limit=config.swiglu_limit)(h), DeepseekV4Experts(config)._apply_gate(h))


def _draw(module: torch.nn.Module) -> None:
    """Every parameter of a transformers experts module drawn (seed 4, std 0.5): transformers zero-inits some."""
    torch.manual_seed(4)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.5)


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_gpt_oss_experts_match_transformers(backend):
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    E, I, T, K = 4, 24, 11, 2  # noqa: E741 - I: the intermediate size, as transformers names it
    config = GptOssConfig(
        hidden_size=D,
        intermediate_size=I,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=32,
    )
    hf = GptOssExperts(config)
    _draw(hf)
    bank = ExpertBank(
        ExpertConfig(
            d_model=D,
            d_hidden=I,
            num_experts=E,
            activation="swiglu",
            backend=backend,
            bias=True,
            fused="interleaved",
            swiglu_alpha=config.swiglu_alpha,
            swiglu_limit=config.swiglu_limit,
            swiglu_up_offset=1.0,
        )
    )
    with torch.no_grad():  # the same layout: gate_up_proj (E, D, 2I) is "EDF", down_proj (E, I, D)
        bank.w_in_EDF.copy_(hf.gate_up_proj), bank.w_out_EHD.copy_(hf.down_proj)
        bank.b_in_EF.copy_(hf.gate_up_proj_bias), bank.b_out_ED.copy_(hf.down_proj_bias)
    x = torch.randn(T, D) * 3  # some gate / up values beyond the limit 7
    index_TK, weights_TK = _routing(T, E, K)
    want = _eager_forward(hf, x, index_TK, weights_TK)
    h = torch.einsum("td,edf->tef", x, hf.gate_up_proj.detach()) + hf.gate_up_proj_bias.detach()
    assert (h.abs() > config.swiglu_limit).any()  # the clamps are exercised
    # the same sums in another order (transformers runs every expert on every token, zeros included): a bound
    # scaled to the output (tests/scaled_close.py)
    assert_close_scaled(_bank_moe(bank, x, index_TK, weights_TK), want, REL, "llama4 experts")


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_deepseek_v4_experts_match_transformers(backend):
    pytest.importorskip("transformers")
    try:
        from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    except ImportError:
        pytest.skip("this transformers has no DeepSeek-V4")

    E, I, T, K = 4, 24, 11, 2  # noqa: E741 - I: the intermediate size, as transformers names it
    config = DeepseekV4Config(
        hidden_size=D,
        moe_intermediate_size=I,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        vocab_size=32,
        swiglu_limit=1.5,
    )
    hf = DeepseekV4Experts(config)
    _draw(hf)
    bank = ExpertBank(
        ExpertConfig(
            d_model=D,
            d_hidden=I,
            num_experts=E,
            activation="swiglu",
            backend=backend,
            layout="EFD",
            swiglu_limit=config.swiglu_limit,
        )
    )
    with torch.no_grad():  # nn.Linear's order: gate_up_proj (E, 2I, D) [gate; up], down_proj (E, D, I)
        bank.w_in_EFD.copy_(hf.gate_up_proj), bank.w_out_EDH.copy_(hf.down_proj)
    x = torch.randn(T, D)
    index_TK, weights_TK = _routing(T, E, K)
    want = _eager_forward(hf, x, index_TK, weights_TK)
    # the same sums in another order (transformers runs every expert on every token, zeros included): a bound
    # scaled to the output (tests/scaled_close.py)
    assert_close_scaled(_bank_moe(bank, x, index_TK, weights_TK), want, REL, "llama4 experts")


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_llama4_experts_match_transformers(backend):
    """Llama4TextMoe runs every expert on router-scaled inputs (score 0 for unchosen experts: expert(0) = 0);
    the bank with gate_on_input runs only the chosen (token, expert) rows and must give the same sum."""
    pytest.importorskip("transformers")
    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    E, I, T, K = 4, 24, 11, 2  # noqa: E741 - I: the intermediate size, as transformers names it
    config = Llama4TextConfig(
        hidden_size=D,
        intermediate_size=I,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        vocab_size=32,
    )
    hf = Llama4TextExperts(config)
    _draw(hf)
    bank = ExpertBank(
        ExpertConfig(d_model=D, d_hidden=I, num_experts=E, activation="swiglu", backend=backend, gate_on_input=True)
    )
    with torch.no_grad():  # gate_up_proj (E, D, 2I) [gate; up] is "EDF", down_proj (E, I, D)
        bank.w_in_EDF.copy_(hf.gate_up_proj), bank.w_out_EHD.copy_(hf.down_proj)
    x = torch.randn(T, D)
    index_TK, _ = _routing(T, E, K)
    logits_TE = torch.randn(T, E)
    weights_TK = torch.sigmoid(logits_TE.gather(1, index_TK))
    scores_TE = torch.zeros(T, E).scatter(1, index_TK, weights_TK)  # Llama4Router: sigmoid(-inf) = 0 unchosen
    routed_in = x.repeat(E, 1) * scores_TE.t().reshape(-1, 1)  # Llama4TextMoe.forward's routed part
    want = _eager_forward(hf, routed_in).reshape(E, T, D).sum(0)
    # the same sums in another order (transformers runs every expert on every token, zeros included): a bound
    # scaled to the output (tests/scaled_close.py)
    assert_close_scaled(_bank_moe(bank, x, index_TK, weights_TK), want, REL, "llama4 experts")


# -- bad values ------------------------------------------------------------------------------------------

BASE = dict(d_model=D, d_hidden=H, num_experts=4, activation="swiglu")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("swiglu_limit", 0.0, r"swiglu_limit=0.0: must be finite and > 0"),
        ("swiglu_limit", -7.0, r"swiglu_limit=-7.0: must be finite and > 0"),
        ("swiglu_limit", float("inf"), r"swiglu_limit=inf: must be finite and > 0"),
        ("swiglu_limit", float("nan"), r"swiglu_limit=nan: must be finite and > 0"),
        ("swiglu_alpha", 0.0, r"swiglu_alpha=0.0: must be finite and > 0"),
        ("swiglu_alpha", -1.702, r"swiglu_alpha=-1.702: must be finite and > 0"),
        ("swiglu_up_offset", float("nan"), r"swiglu_up_offset=nan: must be finite"),
        ("fused", "halves", r"fused='halves': must be one of 'concat', 'interleaved'"),
    ],
)
def test_bad_swiglu_options_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ExpertConfig(**BASE, **{field: value})


@pytest.mark.parametrize(
    "field,value", [("swiglu_limit", 7.0), ("swiglu_alpha", 1.702), ("swiglu_up_offset", 1.0), ("fused", "interleaved")]
)
def test_swiglu_options_need_swiglu(field, value):
    with pytest.raises(
        ValueError,
        match=rf"{field}={value!r}: only applies to activation='swiglu' "
        r"\(activation='gelu'\)",
    ):
        ExpertConfig(**{**BASE, "activation": "gelu"}, **{field: value})


@pytest.mark.parametrize(
    "field,value", [("bias", 1), ("gate_on_input", "yes"), ("swiglu_limit", "7"), ("swiglu_up_offset", True)]
)
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(TypeError, match=rf"{field}={value!r}: must be a"):
        ExpertConfig(**BASE, **{field: value})


def test_megablocks_refuses_biases():
    with pytest.raises(ValueError, match=r"bias=True: backend='megablocks' adds no biases"):
        ExpertConfig(**BASE, bias=True, backend="megablocks")
    with pytest.raises(ValueError, match=r"backend='megablocks': it adds no biases \(bias=True\)"):
        bank_mod.resolve_backend("megablocks", "cuda", torch.bfloat16, {"d_model": D, "d_hidden": H}, bias=True)
    assert (
        bank_mod.resolve_backend("auto", "cuda", torch.float64, {"d_model": D, "d_hidden": H}, bias=True) == "reference"
    )


def test_input_gated_experts_behind_a_combine_side_dispatcher():
    """Llama-4's experts scale each row's input by its gate. A dispatcher that applies the gates at the combine
    (expert parallelism) gets the tokens pre-scaled instead, which is exact for top-1 routing only: top-2 refuses,
    top-1 equals the local layer (output and gradients)."""
    from mode.dispatch.local import LocalDispatcher
    from mode.layers.moe import MoEConfig, MoELayer

    class CombineSide(LocalDispatcher):
        gates_in_experts = False

    def config(k):
        return MoEConfig(
            d_model=16,
            d_hidden=32,
            num_experts=4,
            top_k=k,
            gate="sigmoid",
            activation="swiglu",
            expert_options=dict(gate_on_input=True),
        )

    local = MoELayer.from_config(config(2))
    with pytest.raises(ValueError, match="needs top_k=1"):
        MoELayer(local.router, local.experts, CombineSide())
    torch.manual_seed(0)
    local = MoELayer.from_config(config(1))
    combine_side = MoELayer(local.router, local.experts, CombineSide())
    x = torch.randn(2, 5, 16, requires_grad=True)
    y_local, _ = local(x)
    (g_local,) = torch.autograd.grad(y_local.square().sum(), x)
    y_cs, _ = combine_side(x)
    (g_cs,) = torch.autograd.grad(y_cs.square().sum(), x)
    torch.testing.assert_close(y_cs, y_local, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cs, g_local, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["EDF", "EFD"])
def test_relu2_experts_agree_across_backends_and_with_the_formula(layout):
    """Ungated relu^2 experts (Nemotron-H): y = relu(x W_in)^2 W_out, every backend the same, padding zero."""
    torch.manual_seed(0)
    cfg = dict(d_model=16, d_hidden=32, num_experts=3, activation="relu2", layout=layout)
    ref = ExpertBank(ExpertConfig(**cfg, backend="reference"))
    fast = ExpertBank(ExpertConfig(**cfg, backend="grouped"))
    fast.load_state_dict(ref.state_dict())
    counts = torch.tensor([3, 0, 4])
    x = torch.randn(9, 16)
    x[7:] = float("nan")  # padding rows
    w_in, w_out = ref.weights(torch.float32)
    expected = torch.cat(
        [
            torch.relu(x[:3] @ w_in[0]).square() @ w_out[0],
            torch.relu(x[3:7] @ w_in[2]).square() @ w_out[2],
            torch.zeros(2, 16),
        ]
    )
    for bank in (ref, fast):
        torch.testing.assert_close(bank(x, counts), expected, rtol=1e-5, atol=1e-6)


def _reference_and_grouped_agree(cfg: ExpertConfig) -> None:
    """The same weights and rows through "reference" and "grouped": the same output."""
    torch.manual_seed(0)
    ref = ExpertBank(ExpertConfig(**{**cfg.__dict__, "backend": "reference"}))
    fast = ExpertBank(ExpertConfig(**{**cfg.__dict__, "backend": "grouped"}))
    fast.load_state_dict(ref.state_dict())
    x, counts = torch.randn(6, cfg.d_model), torch.tensor([2, 4])
    torch.testing.assert_close(fast(x, counts), ref(x, counts), rtol=1e-5, atol=1e-6)


def test_softcapped_swiglu_is_inkling2s_bit_for_bit():
    """Inkling-2's experts: softcap_4(gate) * sigmoid(gate) * softcap_25(up), in float32; both backends agree."""
    from types import SimpleNamespace

    from transformers.models.inkling2.modeling_inkling2 import Inkling2SoftcappedSwiGLU

    theirs = Inkling2SoftcappedSwiGLU(SimpleNamespace(mlp_gate_softcap=4.0, mlp_up_softcap=25.0))
    cfg = ExpertConfig(
        d_model=16, d_hidden=32, num_experts=2, activation="swiglu", swiglu_gate_softcap=4.0, swiglu_up_softcap=25.0
    )
    h = torch.randn(5, 64) * 10
    assert torch.equal(cfg.swiglu_options(h), theirs(*h.chunk(2, dim=-1)))
    _reference_and_grouped_agree(cfg)
    with pytest.raises(ValueError, match="swiglu_up_softcap=25.0: only applies to activation='swiglu'"):
        ExpertConfig(d_model=16, d_hidden=32, num_experts=2, activation="gelu", swiglu_up_softcap=25.0)


def test_geglu_experts_are_gemma4s():
    """glu_act="gelu_tanh": gelu(gate, tanh) * up, transformers' gelu_pytorch_tanh; the backends agree."""
    from transformers.activations import ACT2FN

    cfg = ExpertConfig(d_model=16, d_hidden=32, num_experts=2, activation="swiglu", glu_act="gelu_tanh")
    h = torch.randn(5, 64)
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(cfg.swiglu_options(h), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    _reference_and_grouped_agree(cfg)
    with pytest.raises(ValueError, match="glu_act"):
        ExpertConfig(d_model=16, d_hidden=32, num_experts=2, activation="swiglu", glu_act="softplus")
