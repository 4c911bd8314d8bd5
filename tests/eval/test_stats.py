"""Statistics against independent references: scipy, Newcombe (1998) Table II, hand computation,
and the seed's own numbers (handoff: l3 - l2 not resolvable at +-11.5..13.1 pp, slopes -18..-29)."""

import math

import pytest
from scipy import stats as sps

from megablu.eval.stats import (
    effective_length,
    effective_length_contiguous,
    n_to_resolve,
    newcombe,
    slope_per_doubling,
    t_quantile,
    wilson,
    z_of,
)


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (73, 100), (35, 100), (1, 3), (49, 50)])
def test_wilson_matches_scipy(k, n):
    p, lo, hi = wilson(k, n)
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert p == k / n
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)


# Newcombe (1998), Statistics in Medicine 17:873-890, Table II, method 10 (score, no CC)
NEWCOMBE_TABLE_II = [
    ((56, 70, 48, 80), (0.0524, 0.3339)),
    ((9, 10, 3, 10), (0.1705, 0.8090)),
    ((6, 7, 2, 7), (0.0582, 0.8062)),
    ((5, 56, 0, 29), (-0.0381, 0.1926)),
    ((0, 10, 0, 20), (-0.1611, 0.2775)),
    ((0, 10, 0, 10), (-0.2775, 0.2775)),
    ((10, 10, 0, 20), (0.6791, 1.0000)),
    ((10, 10, 0, 10), (0.6075, 1.0000)),
]


@pytest.mark.parametrize("counts,ci", NEWCOMBE_TABLE_II)
def test_newcombe_matches_published_table(counts, ci):
    d = newcombe(*counts)
    assert d.diff == pytest.approx(counts[0] / counts[1] - counts[2] / counts[3])
    assert d.lo == pytest.approx(ci[0], abs=6e-5) and d.hi == pytest.approx(ci[1], abs=6e-5)


def test_newcombe_on_the_seeds_ladder_is_not_resolvable():
    # handoff: l3 - l2 = -6.0 / +2.0 / +0.0 pp at n=100, "none resolvable (combined bars +-11.5 to +-13.1)"
    for l3, l2 in [(74, 80), (64, 62), (35, 35)]:
        d = newcombe(l3, 100, l2, 100)
        assert not d.resolvable
        assert 11.0 < 100 * (d.hi - d.lo) / 2 < 13.5
    # a collapse like the cache bug (4k: 74% -> 16%) is resolvable
    assert newcombe(16, 100, 74, 100).resolvable


def test_slope_matches_scipy_linregress():
    lengths, k, n = [1024, 4096, 16360, 32744], [95, 80, 52, 30], [100, 100, 100, 100]
    s = slope_per_doubling(lengths, k, n)
    x = [math.log2(L) for L in lengths]
    lr = sps.linregress(x, [100 * a / b for a, b in zip(k, n)])
    assert s.pp_per_doubling == pytest.approx(lr.slope, rel=1e-12)
    assert s.intercept_pp == pytest.approx(lr.intercept, rel=1e-12)
    t = sps.t.ppf(0.975, len(x) - 2)
    assert s.fit_ci_pp[0] == pytest.approx(lr.slope - t * lr.stderr, rel=1e-10)
    assert s.fit_ci_pp[1] == pytest.approx(lr.slope + t * lr.stderr, rel=1e-10)


def test_slope_binomial_interval_by_hand():
    # two lengths one doubling apart: slope = y2 - y1 and Var = Var(y1) + Var(y2),
    # each from the Agresti-Coull p~ = (k+2)/(n+4): 62/104 and 42/104
    s = slope_per_doubling([4096, 8192], [60, 40], [100, 100])
    assert s.pp_per_doubling == pytest.approx(-20.0)
    p1, p2 = 62 / 104, 42 / 104
    half = 1.959963984540054 * 100 * math.sqrt(p1 * (1 - p1) / 100 + p2 * (1 - p2) / 100)
    assert s.ci_pp == pytest.approx((-20.0 - half, -20.0 + half))
    assert s.fit_ci_pp is None  # no residual degrees of freedom


def test_slope_on_the_seeds_arms():
    # handoff: "all arms sat at -18 to -29 pp/doubling"
    for ys in [(73, 53, 33), (75, 48, 30), (80, 62, 35), (74, 64, 35)]:
        s = slope_per_doubling([4096, 8192, 16360], list(ys), [100] * 3)
        assert -29 <= s.pp_per_doubling <= -18
        assert s.ci_pp[1] < 0  # the decline itself is resolved


def test_effective_length():
    acc = {1024: 97.0, 4096: 85.6, 16360: 60.0, 32744: 90.0}
    assert effective_length(acc) == 32744  # the definition: longest length >= threshold
    assert effective_length_contiguous(acc) == 4096  # every shorter length passes too
    assert effective_length(acc, threshold=98) is None
    assert effective_length({4096: 85.59}) is None  # 85.6 is inclusive, 85.59 is not


def test_n_to_resolve_by_hand():
    # (z_.975 + z_.8)^2 (.8*.2 + .74*.26) / .06^2 = 7.8489 * .3524 / .0036 = 768.3 -> 769
    assert n_to_resolve(0.80, 0.74) == 769
    # at power 0.5 the Wald half-width at that n equals the difference
    n = n_to_resolve(0.6, 0.4, power=0.5)
    half = z_of() * math.sqrt((0.24 + 0.24) / n)
    assert half <= 0.2 < z_of() * math.sqrt(0.48 / (n - 1))
    with pytest.raises(ValueError):
        n_to_resolve(0.5, 0.5)


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 5, 8, 13, 30])
@pytest.mark.parametrize("conf", [0.9, 0.95, 0.99])
def test_t_quantile_matches_scipy(dof, conf):
    assert t_quantile(conf, dof) == pytest.approx(sps.t.ppf(0.5 + conf / 2, dof), rel=1e-9)
