"""The paired intervals (stats.newcombe_paired for 0/1 scores, stats.paired_mean_diff for part credit) and
compare's choice of them (report.difference): arms scored on the same seeded prompts are paired data, and a
paired interval is both valid (coverage) and narrower when the arms agree on most prompts."""

import math
import random
import statistics

import pytest
from scipy import stats as sps

from megablu.config.schema import GateConfig
from megablu.eval.gate import check_gate
from megablu.eval.report import difference, markdown
from megablu.eval.stats import (
    n_to_resolve,
    n_to_resolve_mean,
    n_to_resolve_paired,
    newcombe,
    newcombe_paired,
    paired_mean_diff,
    t_quantile,
)

# Newcombe (1998, Stat Med 17:2635-2650) method 10 on published paired tables (a, b, c, d) = (both, arm 1 only,
# arm 2 only, neither), 95%, as printed (4 or 3 decimals): the paper's worked example (Armitage & Berry's 50
# sputum specimens on two media; method 8, the same without the phi correction, gives 0.0618 to 0.3242);
# Fagerland, Lydersen & Laake 2014 (Stat Med 33:2850) Table V, Bentur et al. 2009 (ad - bc = 5 <= n/2: phi 0);
# their book's Cavo et al. 2012 example (contingencytables' tests); Tang et al. 2010; Chang et al. 2024
# (all as quoted by the R packages contingencytables and ratesci, whose code reproduces them). (1, 0, 0, 1):
# contingencytables' own test of a table whose phi is 0 (ad - bc = 1 <= n/2).
NEWCOMBE_PAIRED_PUBLISHED = [
    ((20, 12, 2, 16), (0.0562, 0.3292), 5e-5),
    ((1, 1, 7, 12), (-0.507, -0.026), 5e-4),
    ((59, 6, 16, 80), (-0.1186, -0.0046), 5e-5),
    ((8, 3, 1, 2), (-0.1574, 0.4136), 5e-5),
    ((7, 25, 2, 68), (0.133, 0.318), 5e-4),
    ((1, 0, 0, 1), (-0.5734, 0.5734), 5e-5),
]


@pytest.mark.parametrize("table,ci,tol", NEWCOMBE_PAIRED_PUBLISHED)
def test_newcombe_paired_matches_published_method_10(table, ci, tol):
    d = newcombe_paired(*table)
    n = sum(table)
    assert d.diff == pytest.approx((table[1] - table[2]) / n)
    assert d.lo == pytest.approx(ci[0], abs=tol) and d.hi == pytest.approx(ci[1], abs=tol)


# Tables the published examples leave out, from the reference code itself: contingencytables'
# Newcombe_square_and_add_CI_paired_2x2 (Fagerland, Lydersen & Laake; github ocbe-uio/contingencytables at
# b1fde68, R 4.2.2), which reproduces every row above to 1e-10. ad < bc keeps its negative phi (wider), down
# to phi = -1 for (0, 4, 6, 0).
NEWCOMBE_PAIRED_REFERENCE = [
    ((2, 8, 9, 1), (-0.4122622741, 0.3271266975)),
    ((3, 10, 12, 5), (-0.3480033979, 0.2276297946)),
    ((0, 4, 6, 0), (-0.6636393406, 0.3746524605)),
    ((4, 3, 2, 1), (-0.2977539570, 0.4596394229)),
    ((12, 1, 9, 78), (-0.1491673413, -0.0163164639)),
    ((303, 14, 0, 83), (0.0162105139, 0.0547896048)),
]


@pytest.mark.parametrize("table,ci", NEWCOMBE_PAIRED_REFERENCE)
def test_newcombe_paired_matches_reference_code(table, ci):
    d = newcombe_paired(*table)
    assert (d.lo, d.hi) == pytest.approx(ci, abs=2e-10)


# A margin of 0 (an arm right on every prompt or on none): phi = 0, so the paired interval is Newcombe's
# independent one, whose values Newcombe (1998, Stat Med 17:873-890) Table II prints: 0/10 vs 0/10 and
# 10/10 vs 0/10 (also the reference code's output for these tables).
@pytest.mark.parametrize(
    "table,ci",
    [((0, 0, 0, 10), (-0.2775, 0.2775)), ((10, 0, 0, 0), (-0.2775, 0.2775)), ((0, 10, 0, 0), (0.6075, 1.0000))],
)
def test_newcombe_paired_degenerate_margins(table, ci):
    d = newcombe_paired(*table)
    assert d.lo == pytest.approx(ci[0], abs=5e-5) and d.hi == pytest.approx(ci[1], abs=5e-5)


def test_newcombe_paired_one_prompt():
    """n = 1: every margin but two is 0; the interval is the Wilson half-widths of 1/1 or 0/1 combined
    (reference code: +-0.7934506856)."""
    for t in ((0, 0, 0, 1), (1, 0, 0, 0)):
        d = newcombe_paired(*t)
        assert (d.diff, d.lo, d.hi) == pytest.approx((0.0, -0.7934506856, 0.7934506856), abs=2e-10)


def test_no_correlation_is_the_independent_interval():
    """phi = 0 (both*neither == only1*only2): the paired interval is Newcombe's independent one."""
    d = newcombe_paired(4, 4, 6, 6)
    i = newcombe(8, 20, 10, 20)
    assert (d.diff, d.lo, d.hi) == pytest.approx((i.diff, i.lo, i.hi))


def test_coverage_and_width_by_simulation():
    """2,000 simulated prompt sets of n=100 with correlated outcomes (true p1 = 0.8, p2 = 0.7): the
    95% paired interval covers the true difference 93-97.5% of the time, and is clearly narrower than
    the independent interval, which ignores the correlation (and over-covers)."""
    rng = random.Random(0)
    true = 0.8 - 0.7
    cover = cover_i = 0
    width = width_i = 0.0
    sims = 2000
    for _ in range(sims):
        t = [0, 0, 0, 0]
        for _ in range(100):
            u = rng.random()
            a = u < 0.8
            b = (u < 0.7) if rng.random() < 0.8 else (rng.random() < 0.7)  # mostly the same prompts fail
            t[(0 if a else 2) + (0 if b else 1)] += 1
        both, only1, only2, neither = t[0], t[1], t[2], t[3]
        d = newcombe_paired(both, only1, only2, neither)
        i = newcombe(both + only1, 100, both + only2, 100)
        cover += d.lo <= true <= d.hi
        cover_i += i.lo <= true <= i.hi
        width += d.hi - d.lo
        width_i += i.hi - i.lo
    assert 0.93 <= cover / sims <= 0.975, cover / sims
    assert cover_i / sims > 0.975  # independent: too wide for paired data
    assert width / width_i < 0.75, (width / sims, width_i / sims)


def _res(outcomes, task="passkey", length=992, digest="d1"):
    samples = [{"task": task, "length": length, "index": i, "correct": bool(c)} for i, c in enumerate(outcomes)]
    cell = {"task": task, "length": length, "n": len(outcomes), "correct": sum(outcomes), "digest": digest}
    return {"samples": samples, "cells": [cell]}, cell


def test_compare_pairs_same_prompts_and_not_others():
    """The CPU quick start's extension at 992 tokens with YaRN's attention factor 1.3 vs its trained
    1.139 (n=400, 2026-12-04): 14 prompts flipped to right, none to wrong. Independent: +3.5
    [-2.3, +9.3], unresolved; paired: resolved. Other prompts (another digest) stay independent."""
    base = [1] * 303 + [0] * 14 + [0] * 83
    arm = [1] * 303 + [1] * 14 + [0] * 83
    ra, ca = _res(arm)
    rb, cb = _res(base)
    d, paired = difference(ra, ca, rb, cb)
    i = newcombe(ca["correct"], 400, cb["correct"], 400)
    assert (paired.kind, paired.table) == ("binary", (303, 14, 0, 83)) and d.resolvable and d.lo > 0
    assert not i.resolvable and d.diff == pytest.approx(i.diff)
    rc, cc = _res(arm, digest="other")
    d2, paired2 = difference(rc, cc, rb, cb)
    assert paired2 is None and (d2.lo, d2.hi) == pytest.approx((i.lo, i.hi))
    # part-credit scores (not 0/1): the paired mean; missing samples: independent
    ra["samples"][0]["score"] = 0.5
    assert difference(ra, ca, rb, cb)[1].kind == "mean"
    del rb["samples"][-1]
    assert difference(_res(arm)[0], ca, rb, cb)[1] is None


def test_paired_sample_size():
    """McNemar's sample size (Connor 1987): with independent arms it is the independent formula's n
    (within rounding); the more the arms agree (fewer discordant prompts), the fewer prompts; and a
    simulated paired study of that size resolves the difference about `power` of the time."""
    p1, p2 = 0.8, 0.7
    indep_psi = p1 * (1 - p2) + p2 * (1 - p1)  # discordant share of independent arms
    assert abs(n_to_resolve_paired(indep_psi, p1 - p2) - n_to_resolve(p1, p2)) <= 0.03 * n_to_resolve(p1, p2)
    assert n_to_resolve_paired(0.14, 0.10) < n_to_resolve(p1, p2) / 2
    n = n_to_resolve_paired(0.14, 0.10)
    rng = random.Random(1)
    hits = 0
    for _ in range(1000):
        t = [0, 0, 0, 0]
        for _ in range(n):
            u = rng.random()
            t[0 if u < 0.68 else 1 if u < 0.80 else 2 if u < 0.82 else 3] += 1  # only1 0.12, only2 0.02
        hits += newcombe_paired(*t).resolvable
    assert 0.7 < hits / 1000 < 0.9, (n, hits)
    with pytest.raises(ValueError):
        n_to_resolve_paired(0.1, 0.0)


@pytest.mark.parametrize("dof,t", [(1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228), (30, 2.042)])
def test_t_quantile_table(dof, t):
    """t_{0.975, dof} from the printed table (no scipy)."""
    assert t_quantile(0.95, dof) == pytest.approx(t, abs=5e-4)


def _fwe_scores(rng, n, pa=0.7, pb=0.6, redraw=0.2):
    """n prompts of 3 answers each: an answer is found by arm a when its shared difficulty h < pa, by arm b
    when h < pb (a fresh h with probability `redraw`): correlated arms, true mean difference pa - pb."""
    a, b = [], []
    for _ in range(n):
        h = [rng.random() for _ in range(3)]
        a.append(sum(x < pa for x in h) / 3)
        b.append(sum((rng.random() if rng.random() < redraw else x) < pb for x in h) / 3)
    return a, b


def test_paired_mean_coverage_and_width_by_simulation():
    """1,000 simulated prompt sets of n=100 with part-credit scores (3 answers a prompt) and correlated arms
    (true difference 0.7 - 0.6): the paired t interval covers the true difference 93-97% of the time and is
    clearly narrower than the independent interval on the same scores (which over-covers)."""
    rng = random.Random(0)
    true, sims = 0.1, 1000
    cover = cover_i = 0
    width = width_i = 0.0
    for _ in range(sims):
        a, b = _fwe_scores(rng, 100)
        d = paired_mean_diff([x - y for x, y in zip(a, b)])
        i = newcombe(sum(a), 100, sum(b), 100)
        assert d.diff == pytest.approx(i.diff)
        cover += d.lo <= true <= d.hi
        cover_i += i.lo <= true <= i.hi
        width += d.hi - d.lo
        width_i += i.hi - i.lo
    assert 0.93 <= cover / sims <= 0.97, cover / sims
    assert cover_i / sims > 0.975
    assert width / width_i < 0.75, (width / sims, width_i / sims)


def test_paired_mean_ties_and_sample_size():
    """Every difference equal: not a point but the exact bound (100 ties at 0 give +-2.95 pp, unresolved; a
    difference of 0.5 on 2 prompts is unresolved, on 100 resolved); n_to_resolve_mean(0, c) is the smallest n
    that resolves such ties; with sd > 0 a simulated study of n_to_resolve_mean prompts resolves ~80%."""
    d = paired_mean_diff([0.0] * 100)
    assert (d.lo, d.hi) == pytest.approx((-(1 - 0.05**0.01), 1 - 0.05**0.01)) and not d.resolvable
    assert not paired_mean_diff([0.5] * 2).resolvable and paired_mean_diff([0.5] * 100).resolvable
    assert paired_mean_diff([2 / 3 - 1 / 3] * 50 + [1 - 2 / 3] * 50).lo < 1 / 3 - 0.01  # equal up to rounding
    for c in (0.5, 0.1, -0.3):
        n = n_to_resolve_mean(0.0, c)
        assert paired_mean_diff([c] * n).resolvable and not paired_mean_diff([c] * (n - 1)).resolvable
    rng = random.Random(2)
    a, b = _fwe_scores(rng, 20000)
    sd = statistics.stdev(x - y for x, y in zip(a, b))
    n = n_to_resolve_mean(sd, 0.1)
    assert n == math.ceil(((1.959964 + 0.841621) * sd / 0.1) ** 2)
    hits = sum(paired_mean_diff([x - y for x, y in zip(*_fwe_scores(rng, n))]).resolvable for _ in range(600))
    assert 0.7 < hits / 600 < 0.9, (n, hits)
    with pytest.raises(ValueError):
        n_to_resolve_mean(0.2, 0.0)


def _part(arm, scores, task="fwe", length=4096, digest="d1"):
    """A result of one part-credit cell: sample i scored scores[i]."""
    samples = [
        {"task": task, "length": length, "index": i, "score": s, "correct": s == 1.0} for i, s in enumerate(scores)
    ]
    k = sum(scores)
    cell = {
        "task": task,
        "length": length,
        "n": len(scores),
        "correct": k,
        "acc_pp": 100 * k / len(scores),
        "all_correct": sum(s == 1.0 for s in scores),
        "digest": digest,
    }
    return {"arm": arm, "step": 0, "cells": [cell], "samples": samples}, cell


def test_compare_pairs_part_credit_on_the_same_prompts():
    """fwe-like part-credit cells on the same prompts (n=100, correlated arms, true difference +10 pp): the
    paired t interval of the per-prompt differences, inside the independent one and covering the truth,
    resolved where the independent one is not; the table marks it 'paired t' (never 'indep.'), on 10 of the
    prompts unresolved with n/arm from the SD of the differences; prompts that differ stay independent; the
    gate calls the paired-mean difference paired."""
    a, b = _fwe_scores(random.Random(5), 100)
    ra, ca = _part("new", a)
    rb, cb = _part("base", b)
    d, paired = difference(ra, ca, rb, cb)
    diffs = [x - y for x, y in zip(a, b)]
    i = newcombe(ca["correct"], 100, cb["correct"], 100)
    assert paired.kind == "mean" and paired.n == 100 and paired.sd == pytest.approx(statistics.stdev(diffs))
    assert d == paired_mean_diff(diffs) and d.diff == pytest.approx(i.diff)
    assert i.lo < d.lo <= 0.1 <= d.hi < i.hi and d.resolvable and not i.resolvable
    md = markdown([rb, ra])
    # one paired cell: a family of 1, adj = p = scipy's paired t p (5.3e-06)
    p = sps.ttest_rel(a, b).pvalue
    assert d.p == pytest.approx(p, rel=1e-9)
    # before pairing: "+10.7 [-2.7, +23.5] n/arm 317 indep."
    assert f"| new@0 | +10.7* [+6.3, +15.1] p {p:.2g} adj {p:.2g} paired t |" in md
    assert "paired t interval of the per-prompt score differences" in md
    # 10 prompts: d = 0.1, sd(d) = 0.316, n = ((1.960 + 0.842) * 0.316 / 0.1)^2 = 78.5
    md = markdown([_part("base", b[:10])[0], _part("new", a[:10])[0]])
    p = sps.ttest_rel(a[:10], b[:10]).pvalue
    assert f"| new@0 | +10.0 [-12.6, +32.6] p {p:.2g} adj {p:.2g} n/arm 79 paired t |" in md
    # differences that cancel up to rounding (their mean 1.4e-17): no difference to resolve
    md = markdown([_part("base", [2 / 3, 1 / 3, 2 / 3, 2 / 3])[0], _part("new", [1 / 3, 2 / 3, 1, 1 / 3])[0]])
    assert "n/arm inf paired t |" in md
    rc, cc = _part("other", a, digest="d2")
    d2, paired2 = difference(rc, cc, rb, cb)
    assert paired2 is None and (d2.lo, d2.hi) == pytest.approx((i.lo, i.hi))
    assert "(prompts differ)" in markdown([rb, rc])
    g = check_gate(rb, ra, GateConfig(short_lengths=[4096], margin_pp=2.0))  # base fell 10 pp below "new"
    assert not g.passed and g.checks[0]["paired"] and g.message.endswith(", paired)"), g.message
