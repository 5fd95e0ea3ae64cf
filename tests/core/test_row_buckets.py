"""Bucketed expert group sizes (mode/experts/row_buckets.py): the rounding rule, the layout's bounds and
order, and the grouped bank computing the same function through it (padding, gates, empty input)."""

from __future__ import annotations

import pytest
import torch

from mode.experts import ExpertBank, ExpertConfig, grouped_mm as gmm_mod, row_buckets
from mode.experts.row_buckets import bucket_sizes, bucketed_layout, padded_capacity

needs_grouped_mm = pytest.mark.skipif(not gmm_mod.grouped_mm_available(), reason="needs torch._grouped_mm (torch>=2.9)")


@pytest.mark.parametrize(
    "count, size",
    [
        (0, 0),
        (1, 8),
        (8, 8),
        (9, 16),
        (37, 40),
        (255, 256),
        (256, 256),
        (257, 272),
        (1000, 1024),
        (1100, 1152),
        (8191, 8192),
    ],
)
def test_bucket_sizes_keep_five_significant_bits_and_multiples_of_eight(count, size):
    assert bucket_sizes(torch.tensor([count])).tolist() == [size]


def test_bucket_sizes_bound_the_padding_and_the_number_of_shapes():
    counts = torch.arange(0, 1 << 14)
    sizes = bucket_sizes(counts)
    pad = sizes - counts
    assert bool((pad >= 0).all())
    assert bool((pad < torch.maximum(counts // 16 + 1, torch.tensor(row_buckets.MIN_ROWS))).all())
    assert bool((bucket_sizes(sizes) == sizes).all())  # a bucket size is its own bucket
    # 16384 possible counts take 32 sizes up to 256 and 16 per octave above it
    assert len(set(sizes.tolist())) == 1 + 32 + 16 * 6


@pytest.mark.parametrize("seed", range(20))
def test_layout_keeps_rows_in_order_inside_their_bucketed_group(seed):
    g = torch.Generator().manual_seed(seed)  # a CPU generator: the same draws on every test device
    E = int(torch.randint(1, 9, (), generator=g, device="cpu"))
    A = int(torch.randint(0, 3000, (), generator=g, device="cpu"))
    N = int(torch.randint(0, A + 1, (), generator=g, device="cpu"))
    counts = torch.zeros(E, dtype=torch.int64)
    if N:  # N rows spread over the experts, some of them empty
        counts += torch.bincount(
            torch.randint(0, E, (N,), generator=g, device="cpu") * (torch.rand(N, generator=g, device="cpu") < 0.9),
            minlength=E,
        ).to(counts.device)
    offsets, dest, R = bucketed_layout(counts, A)
    assert R == padded_capacity(A, E) and offsets.dtype == torch.int32
    sizes = bucket_sizes(counts)
    assert offsets.tolist() == torch.cumsum(sizes, 0).tolist() and offsets[-1] <= R
    assert dest.shape == (A,) and len(set(dest.tolist())) == A and (A == 0 or 0 <= dest.min() <= dest.max() < R)
    assert bool((dest[1:] > dest[:-1]).all())  # order kept
    starts = torch.cumsum(sizes, 0) - sizes
    row = 0
    for e, c in enumerate(counts.tolist()):
        assert dest[row : row + c].tolist() == list(range(int(starts[e]), int(starts[e]) + c))
        row += c
    assert bool((dest[row:] >= offsets[-1]).all())  # padding rows past the last group


def _bank(activation: str, d_model: int, d_hidden: int, E: int) -> ExpertBank:
    torch.manual_seed(0)
    return ExpertBank(
        ExpertConfig(d_model=d_model, d_hidden=d_hidden, num_experts=E, activation=activation, backend="grouped")
    )


def _run(bank, x, counts, gate, padded):
    x = x.clone().requires_grad_(True)
    gate = None if gate is None else gate.clone().requires_grad_(True)
    bank.zero_grad(set_to_none=True)
    y = bank(x, counts, padded=padded, gate_A=gate)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y, x.grad, bank.w_in_EDF.grad, bank.w_out_EHD.grad] + ([] if gate is None else [gate.grad])


@needs_grouped_mm
@pytest.mark.parametrize("activation, d_model, d_hidden", [("swiglu", 32, 16), ("gelu", 16, 32)])
@pytest.mark.parametrize(
    "counts, n_pad, with_gate",
    [([37, 0, 5, 19], 7, True), ([37, 0, 5, 19], 0, False), ([0, 0, 0, 0], 3, True), ([0, 0, 0, 0], 0, False)],
)
def test_bucketed_grouped_bank_computes_the_same_function(
    monkeypatch, activation, d_model, d_hidden, counts, n_pad, with_gate
):
    """float32 forced through the bucketed layout against the plain grouped path: the same outputs and
    gradients (gate on the hidden activation when H < D, on the output otherwise), padding rows NaN in,
    zero out and zero gradient."""
    E, N = len(counts), sum(counts)
    x = torch.randn(N + n_pad, d_model)
    x[N:] = float("nan")
    gate = torch.rand(N + n_pad) if with_gate else None
    counts_E = torch.tensor(counts)
    bank = _bank(activation, d_model, d_hidden, E)
    padded = n_pad > 0 or N == 0
    want = _run(bank, x, counts_E, gate, padded)
    used = []
    layout = row_buckets.bucketed_layout
    monkeypatch.setattr(row_buckets, "needed", lambda device_type, dtype, rows, experts: True)
    monkeypatch.setattr(row_buckets, "bucketed_layout", lambda *a: used.append(a) or layout(*a))
    got = _run(bank, x, counts_E, gate, padded)
    assert used, "the bucketed layout was not used"
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad", "gate.grad"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(got[0][N:], torch.zeros_like(got[0][N:]))
    assert torch.equal(got[1][N:], torch.zeros_like(got[1][N:]))


@needs_grouped_mm
def test_cpu_bf16_takes_the_bucketed_layout_and_float32_does_not(monkeypatch):
    with torch.device("cpu"):  # a CPU path: on the CPU under a CUDA test device too (CPU autocast does not touch CUDA)
        bank = _bank("swiglu", 32, 16, 4)
        x, counts = torch.randn(1030, 32), torch.tensor([200, 3, 0, 827])  # 257.5 rows per expert
    used = []
    layout = row_buckets.bucketed_layout
    monkeypatch.setattr(row_buckets, "bucketed_layout", lambda *a: used.append(a) or layout(*a))
    bank(x, counts)
    assert not used
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bank(x, counts)
    assert len(used) == 1 and y.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bank(x[:1020], torch.tensor([200, 3, 0, 817], device="cpu"))  # 255 rows per expert: exact sizes
    assert len(used) == 1
    assert row_buckets.needed("cpu", torch.float16, 1024, 4) and not row_buckets.needed("cuda", torch.bfloat16, 1024, 4)


@needs_grouped_mm
def test_bucketed_path_compiles_fullgraph_and_matches_eager(fresh_dynamo):
    with torch.device("cpu"):  # the bucketed path is the CPU's (bf16 autocast on the CPU), whatever the test device
        bank = _bank("swiglu", 32, 16, 4)
        x, counts = torch.randn(1030, 32), torch.tensor([200, 3, 0, 820])  # bucketed in bf16; 7 padding rows
    x[1023:] = float("nan")

    def run(fn):
        bank.zero_grad(set_to_none=True)
        xb = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xb, counts)
        y.float().square().sum().backward()
        return y.detach(), xb.grad, bank.w_in_EDF.grad.clone(), bank.w_out_EHD.grad.clone()

    got = run(torch.compile(bank, backend="aot_eager", fullgraph=True))
    want = run(bank)
    assert torch.equal(got[0][1023:], torch.zeros_like(got[0][1023:]))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
