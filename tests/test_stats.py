"""experiments/stats: t quantiles, within-run SEs, the seed-level interval, Welch, McNemar, the decisions."""

import math

import numpy as np
import pytest

from experiments import stats

# Two-sided 95% (0.975) and 90% (0.95) quantiles of Student's t from printed tables.
TABLE = {(0.975, 1): 12.706, (0.975, 2): 4.303, (0.975, 3): 3.182, (0.975, 10): 2.228, (0.975, 120): 1.980,
         (0.95, 1): 6.314, (0.95, 2): 2.920, (0.95, 5): 2.015}


@pytest.mark.parametrize("key", sorted(TABLE))
def test_t_quantile_matches_the_table(key):
    p, df = key
    assert stats.t_quantile(p, df) == pytest.approx(TABLE[key], abs=1e-3)
    assert stats.t_quantile(1 - p, df) == pytest.approx(-TABLE[key], abs=1e-3)


def test_t_quantile_at_fractional_df_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (0.7, 1.3, 2.02, 3.07, 47.5):
        assert stats.t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-7)
    with pytest.raises(ValueError, match="df > 0"):
        stats.t_quantile(0.975, 0)


def test_slope_within_is_ols_with_its_standard_error():
    rng = np.random.default_rng(1)
    steps = np.arange(150)
    y = 0.3 + 0.0005 * steps + rng.normal(0, 0.02, 150)
    got = stats.slope_within(steps, y)
    x = np.vstack([np.ones(150), steps]).T
    coef, rss, *_ = np.linalg.lstsq(x, y, rcond=None)
    se = math.sqrt(rss[0] / 148 / ((steps - steps.mean()) ** 2).sum())
    assert got["value"] == pytest.approx(100 * coef[1])
    if got["rho"] <= 0:
        assert got["se"] == pytest.approx(100 * se)
    else:
        assert got["se"] == pytest.approx(100 * se * math.sqrt((1 + got["rho"]) / (1 - got["rho"])))


def test_positively_autocorrelated_residuals_widen_the_error():
    steps = np.arange(100)
    wave = np.repeat([1.0, -1.0], 10).tolist() * 5  # runs of 10: lag-1 autocorrelation ~0.8
    y = 0.01 * np.asarray(wave)
    got = stats.slope_within(steps, y)
    assert got["rho"] > 0.7
    resid_se = 100 * math.sqrt(((y - y.mean()) ** 2).sum() / 98 / ((steps - steps.mean()) ** 2).sum())
    assert got["se"] > 2.5 * resid_se  # sqrt((1 + 0.8) / (1 - 0.8)) = 3
    m = stats.mean_within(y)
    assert m["se"] > 2.5 * y.std(ddof=1) / 10


def test_over_seeds_uses_the_larger_of_between_and_within_variance():
    close = stats.over_seeds([0.005, 0.006, 0.007], [0.009, 0.009, 0.009])  # seeds agree more than one run's noise
    assert close["se"] == pytest.approx(0.009 / math.sqrt(3))
    assert close["lo"] == pytest.approx(0.006 - 4.303 * 0.009 / math.sqrt(3), abs=1e-5)
    spread = stats.over_seeds([-0.05, 0.0, 0.05], [0.001] * 3)
    assert spread["se"] == pytest.approx(0.05 / math.sqrt(3))
    one = stats.over_seeds([0.01], [0.002])
    assert one["n"] == 1 and math.isnan(one["lo"])


def test_welch_interval_and_degrees_of_freedom():
    a, b = [0.675, 0.670, 0.680], [0.648, 0.640, 0.630]
    w = stats.welch(a, b)
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    assert w["diff"] == pytest.approx(np.mean(b) - np.mean(a))
    assert w["df"] == pytest.approx(df)
    half = stats.t_quantile(0.975, df) * math.sqrt(va + vb)
    assert (w["lo"], w["hi"]) == pytest.approx((w["diff"] - half, w["diff"] + half))
    assert math.isnan(stats.welch([0.6], [0.5, 0.55])["lo"])


def test_mcnemar_exact_is_the_two_sided_binomial_test():
    assert stats.mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert stats.mcnemar_exact(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert stats.mcnemar_exact(7, 7) == 1.0 and stats.mcnemar_exact(0, 0) == 1.0
    assert 0.0 <= stats.mcnemar_exact(900, 1100) < 1e-5  # 2000 discordant problems: no overflow


@pytest.mark.parametrize(
    "lo,hi,want",
    [(-0.009, 0.02, "supported"), (-0.03, -0.011, "not supported"), (-0.02, 0.01, "inconclusive"), (math.nan, 1, "inconclusive")],
)
def test_non_inferiority(lo, hi, want):
    assert stats.non_inferior(lo, hi, 0.01) == want


@pytest.mark.parametrize(
    "lo,hi,want",
    [
        (0.001, 0.03, ("supported", "above 0")),
        (-0.03, -0.001, ("not supported", "below 0")),
        (-0.008, 0.009, ("not supported", "equivalent within ±0.01")),
        (-0.014, 0.013, ("inconclusive", "holds 0 and reaches past ±0.01")),
    ],
)
def test_superiority_or_equivalence(lo, hi, want):
    assert stats.superior_or_equivalent(lo, hi, 0.01) == want
