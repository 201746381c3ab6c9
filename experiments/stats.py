"""The statistics of the experiments' pre-registered rules (experiments/qwen_gsm8k/PROTOCOL.md, v3).

Without scipy: Student's t quantiles from the regularized incomplete beta function, and the
exact McNemar test from binomial sums in integers.

- `slope_within` / `mean_within`: one run's (or one seed's paired) slope per 100 steps or mean,
  with its within-run standard error, inflated by (1 + rho) / (1 - rho) for a positive lag-1
  autocorrelation rho of the residuals (capped at RHO_CAP).
- `over_seeds`: the mean of per-seed values, SE = sqrt(max(between-seed variance, mean within-run
  variance) / n), and the 95% interval with t(0.975, n - 1).
- `welch`: an unpaired difference of means over seeds with Welch-Satterthwaite df.
- `non_inferior`, `superior_or_equivalent`: the decisions of PROTOCOL.md from an interval.
"""

from __future__ import annotations

import math

import numpy as np

RHO_CAP = 0.9
LEVEL = 0.975  # the two-sided 95% interval's upper quantile


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny = 1e-300
    clamp = lambda v: v if abs(v) > tiny else tiny  # noqa: E731
    c, d = 1.0, 1.0 / clamp(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, 500):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for num in (even, odd):
            d = 1.0 / clamp(1.0 + num * d)
            c = clamp(1.0 + num / c)
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df > 0 degrees of freedom (df may be fractional)."""
    if not (0.0 < p < 1.0 and df > 0):
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0; got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def _ar1_inflation(resid: np.ndarray) -> tuple[float, float]:
    """(lag-1 autocorrelation of the residuals, the variance factor (1 + rho) / (1 - rho) if rho > 0)."""
    denom = float(resid @ resid)
    rho = float(resid[1:] @ resid[:-1]) / denom if denom > 0 and len(resid) > 2 else 0.0
    capped = min(rho, RHO_CAP)
    return rho, (1.0 + capped) / (1.0 - capped) if capped > 0 else 1.0


def slope_within(steps: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """OLS slope of y on steps, per 100 steps, and its within-run SE (AR(1)-inflated); needs 3+ points."""
    x = np.asarray(steps, np.float64) - np.mean(steps)
    y = np.asarray(y, np.float64)
    sxx = float(x @ x)
    slope = float(x @ (y - y.mean())) / sxx
    resid = y - y.mean() - slope * x
    rho, factor = _ar1_inflation(resid)
    var = float(resid @ resid) / (len(y) - 2) / sxx * factor
    return {"value": 100.0 * slope, "se": 100.0 * math.sqrt(var), "rho": rho}


def mean_within(y: np.ndarray) -> dict[str, float]:
    """Mean of y and its within-run SE, sd / sqrt(T) (AR(1)-inflated); needs 2+ points."""
    y = np.asarray(y, np.float64)
    rho, factor = _ar1_inflation(y - y.mean())
    return {"value": float(y.mean()), "se": float(y.std(ddof=1)) / math.sqrt(len(y)) * math.sqrt(factor), "rho": rho}


def over_seeds(values: list[float], within_se: list[float]) -> dict[str, float | int]:
    """Mean over seeds, SE from max(between-seed variance, mean within-run variance), 95% interval
    with t(0.975, n - 1); with one seed the interval is NaN."""
    n = len(values)
    mean = float(np.mean(values)) if n else float("nan")
    if n < 2:
        return {"n": n, "mean": mean, "se": float("nan"), "df": 0, "lo": float("nan"), "hi": float("nan")}
    between = float(np.var(values, ddof=1))
    within = float(np.mean(np.square(within_se)))
    se = math.sqrt(max(between, within) / n)
    t = t_quantile(LEVEL, n - 1)
    return {
        "n": n,
        "mean": mean,
        "se": se,
        "se_between": math.sqrt(between / n),
        "se_within": math.sqrt(within / n),
        "df": n - 1,
        "lo": mean - t * se,
        "hi": mean + t * se,
    }


def welch(a: list[float], b: list[float]) -> dict[str, float | int]:
    """mean(b) - mean(a), Welch SE, Welch-Satterthwaite df and the 95% interval (NaN below 2 per side)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = float(b.mean() - a.mean()) if len(a) and len(b) else float("nan")
    out = {"n_a": len(a), "n_b": len(b), "diff": diff, "se": float("nan"), "df": float("nan")}
    if min(len(a), len(b)) < 2:
        return {**out, "lo": float("nan"), "hi": float("nan")}
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0.0:
        return {**out, "se": 0.0, "df": float(len(a) + len(b) - 2), "lo": diff, "hi": diff}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = t_quantile(LEVEL, df)
    return {**out, "se": se, "df": float(df), "lo": diff - t * se, "hi": diff + t * se}


def mcnemar_exact(b_only: int, a_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (problems only b got right, only a got right)."""
    n = b_only + a_only
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b_only, a_only) + 1))
    return min(1.0, 2 * tail / (1 << n))


def non_inferior(lo: float, hi: float, margin: float) -> str:
    """b - a at least -margin: supported if lo > -margin, not supported if hi < -margin."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    return "supported" if lo > -margin else ("not supported" if hi < -margin else "inconclusive")


def superior_or_equivalent(lo: float, hi: float, margin: float) -> tuple[str, str]:
    """(verdict, reading) for "b adds to a": supported if lo > 0; not supported if hi < 0 (worse)
    or the interval lies inside (-margin, +margin) (equivalent); else inconclusive."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive", "no interval"
    if lo > 0:
        return "supported", "above 0"
    if hi < 0:
        return "not supported", "below 0"
    if -margin < lo and hi < margin:
        return "not supported", f"equivalent within ±{margin:g}"
    return "inconclusive", f"holds 0 and reaches past ±{margin:g}"
