"""``UpdateMoments`` and ``SkipUpdate.fit_moments``: the estimate fitted from running sums, batch by batch, is
the estimate ``SkipUpdate.fit`` (the reference) fits on all the tokens at once, with the same returned share,
and the sums do not grow with the tokens."""

import pytest
import torch

from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.update_moments import UpdateMoments


def _tokens(n: int, d: int, offset: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x_ND = offset + torch.randn(n, d, generator=g) * torch.linspace(0.2, 3.0, d)  # features of unequal scale
    w_DD = torch.randn(d, d, generator=g) / d**0.5
    u_ND = x_ND @ w_DD + 0.3 * torch.randn(n, d, generator=g) + 2.0  # a full-rank map, noise and a shift
    return x_ND, u_ND


@pytest.mark.parametrize("rank", [0, 4, 24])
@pytest.mark.parametrize("offset", [0.0, 300.0])  # 300: inputs far from zero, the raw second moments large
def test_fit_from_moments_batch_by_batch_equals_the_fit_on_all_tokens(rank, offset):
    x_ND, u_ND = _tokens(3000, 24, offset)
    reference = SkipUpdate(24, rank)
    left_ref = reference.fit(x_ND, u_ND)
    moments = UpdateMoments()
    for start, stop in [(0, 1), (1, 1), (1, 700), (700, 2999), (2999, 3000)]:  # uneven, one empty
        moments.add(x_ND[start:stop], u_ND[start:stop])
    assert moments.n == 3000
    streamed = SkipUpdate(24, rank)
    left = streamed.fit_moments(moments)
    # The two differ only by float64 summation order before the float32 parameters are rounded; the map
    # they apply (not down and up alone, whose SVD signs and near-equal singular vectors may swap) agrees.
    torch.testing.assert_close(streamed.bias, reference.bias, rtol=1e-5, atol=1e-5 * (1 + offset))
    with torch.no_grad():
        torch.testing.assert_close(streamed(x_ND[None]), reference(x_ND[None]), rtol=1e-4, atol=1e-4)
    assert left == pytest.approx(left_ref, rel=1e-5, abs=1e-9)
    assert 0.0 < left < 1.0  # better than the plain skip, not exact (noise)


def test_the_sums_do_not_grow_with_the_tokens():
    moments = UpdateMoments()
    for seed in range(5):
        moments.add(*_tokens(2000, 8, 1.0, seed))
    held = list(moments._sums.values())  # every tensor it keeps
    assert held and max(t.numel() for t in held) == 8 * 8
    assert all(t.dtype == torch.float64 for t in held)


def test_refusals_name_the_input():
    moments = UpdateMoments()
    with pytest.raises(ValueError, match="no tokens"):
        SkipUpdate(8, 2).fit_moments(moments)
    moments.add(torch.zeros(0, 8), torch.zeros(0, 8))  # an empty batch adds nothing
    with pytest.raises(ValueError, match="no tokens"):
        moments.centred()
    with pytest.raises(ValueError, match=r"x_ND \(3, 8\) and update_ND \(3, 7\)"):
        moments.add(torch.zeros(3, 8), torch.zeros(3, 7))
    moments.add(torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="x_ND has 6 features; earlier batches had 8"):
        moments.add(torch.zeros(3, 6), torch.zeros(3, 6))
    with pytest.raises(ValueError, match="x_ND has no tokens"):
        SkipUpdate(8, 2).fit(torch.zeros(0, 8), torch.zeros(0, 8))
