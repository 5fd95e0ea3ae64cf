"""Interval arithmetic for seeded comparisons: mean ± std, Student-t quantiles, paired differences.

`mode compare --seeds N` and `mode isoflop --seeds N` train every variant once per seed, with the same
data order for a given seed (``mode.train.data.BatchSampler`` is seeded by it). Two variants trained on seed
``s`` form a pair; the claim "A is lower than B" is read from the ``N`` paired differences ``a_s - b_s``:
their mean, their sample standard deviation, and the 95% interval ``mean ± t(0.975, N - 1) * std / sqrt(N)``.
A difference is *significant* when that interval excludes 0. With one seed there is no interval (``None``).

``window_noise`` is the other source of error: the validation set is a fixed sample of windows, so a
loss measured on it has a standard error of ``std(per-window losses) / sqrt(windows)``; for a difference
between two models evaluated on the same windows the per-window differences are used (paired, much smaller).

Pure Python (no SciPy): the t quantile inverts the Student-t CDF, computed from the regularized
incomplete beta function (Numerical Recipes' continued fraction), by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("xs=[]: needs at least one value")
    return math.fsum(xs) / len(xs)


def std(xs: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1 in the denominator); None for fewer than two values."""
    if len(xs) < 2:
        return None
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def standard_error(xs: Sequence[float]) -> float | None:
    s = std(xs)
    return None if s is None else s / math.sqrt(len(xs))


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x={x}: must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast on this side
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df}: must be > 0")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (``t_quantile(0.975, 2) = 4.3027``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p}: must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # df = 1 at p = 0.9999 needs hi ~ 3e3
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def summarize(xs: Sequence[float]) -> dict:
    """``{"n", "mean", "std", "values"}`` of per-seed values (std None for one value)."""
    return {"n": len(xs), "mean": mean(xs), "std": std(xs), "values": list(xs)}


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict:
    """The paired difference ``a - b`` (one pair per seed): mean, std, the t-based ``level`` interval of
    the mean, and whether that interval excludes 0. ``rel`` is the mean difference over the mean of ``b``."""
    if len(a) != len(b):
        raise ValueError(f"len(a)={len(a)}, len(b)={len(b)}: a paired difference needs one pair per seed")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}: must be in (0, 1)")
    diffs = [x - y for x, y in zip(a, b)]
    m, s = mean(diffs), std(diffs)
    out = {
        "n": len(diffs),
        "mean": m,
        "std": s,
        "rel": m / mean(b),
        "level": level,
        "diffs": diffs,
        "t": None,
        "low": None,
        "high": None,
        "significant": None,
    }
    if s is not None:
        t = t_quantile(0.5 + level / 2.0, len(diffs) - 1)
        half = t * s / math.sqrt(len(diffs))
        out.update(t=t, low=m - half, high=m + half, significant=(m - half > 0) or (m + half < 0))
    return out


def window_noise(losses_a: Sequence[float], losses_b: Sequence[float] | None = None) -> float | None:
    """Standard error that the finite validation set adds to one mean loss (``losses_b`` None) or to the
    difference of two models' mean losses on the same windows (paired over windows)."""
    if losses_b is None:
        return standard_error(losses_a)
    if len(losses_a) != len(losses_b):
        raise ValueError(
            f"{len(losses_a)} and {len(losses_b)} windows: both models must be evaluated on the same validation windows"
        )
    return standard_error([x - y for x, y in zip(losses_a, losses_b)])


def format_pm(m: float, s: float | None, fmt: str = ".4f") -> str:
    """``"1.2345 ± 0.0012"`` (or just the mean when there is no std)."""
    return format(m, fmt) if s is None else f"{format(m, fmt)} ± {format(s, fmt.lstrip('+'))}"


def format_difference(d: dict, fmt: str = "+.4f") -> str:
    """``"-0.0123 ± 0.0040 [-0.0222, -0.0024] *"``: mean ± std [95% interval], ``*`` when significant."""
    text = format(d["mean"], fmt)
    if d["std"] is None:
        return text + " (1 seed: no interval)"
    mark = " *" if d["significant"] else ""
    return f"{text} ± {format(d['std'], fmt[1:])} [{format(d['low'], fmt)}, {format(d['high'], fmt)}]{mark}"
