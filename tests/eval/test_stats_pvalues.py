"""The tests behind compare's stars (stats.mcnemar_exact_p, stats.paired_mean_diff's p, stats.fisher_exact_p,
stats.holm) against scipy and R, and report.starred / markdown: a star is a difference whose Holm-adjusted
p < 0.05 over every tested difference of one compare."""

import random

import pytest
from scipy import stats as sps

from megablu.eval.report import markdown, starred
from megablu.eval.stats import (
    fisher_exact_p,
    holm,
    mcnemar_exact_p,
    newcombe,
    newcombe_paired,
    paired_mean_diff,
    t_test_p,
)


@pytest.mark.parametrize(
    "b,c",
    [
        (0, 1),
        (1, 0),
        (0, 5),
        (2, 12),
        (12, 2),
        (7, 0),
        (5, 5),
        (6, 5),
        (14, 0),
        (1, 7),
        (6, 16),
        (40, 62),
        (300, 260),
        (1000, 1100),
        (3, 9),
    ],
)
def test_mcnemar_exact_matches_scipy_binomtest(b, c):
    """Two-sided exact McNemar = the binomial test of b successes in b + c trials at 1/2."""
    assert mcnemar_exact_p(b, c) == pytest.approx(sps.binomtest(b, b + c, 0.5).pvalue, rel=1e-12, abs=1e-300)


def test_mcnemar_exact_edge_cases():
    """No discordant prompt: nothing to test, p = 1 (binomtest refuses n = 0); the paper's sputum table
    (12 vs 2 discordant) gives R's binom.test(2, 14) p = 0.012939453125; negative counts are an error."""
    assert mcnemar_exact_p(0, 0) == 1.0
    assert newcombe_paired(20, 12, 2, 16).p == 0.012939453125
    with pytest.raises(ValueError, match="only1=-1"):
        mcnemar_exact_p(-1, 3)


def test_interval_and_exact_test_can_disagree():
    """Why the star follows the test: Newcombe's paired interval excludes 0 for Bentur et al.'s (1, 1, 7, 12)
    and Cavo et al.'s (59, 6, 16, 80) while the exact McNemar p is 0.070 and 0.052 (the audit's five
    stars that failed it were such cells)."""
    for t, p in (((1, 1, 7, 12), 0.0703125), ((59, 6, 16, 80), 0.052478790283203125)):
        d = newcombe_paired(*t)
        assert d.resolvable and d.p == pytest.approx(p, rel=1e-12) and d.p > 0.05


@pytest.mark.parametrize(
    "k1,n1,k2,n2",
    [
        (30, 50, 18, 50),
        (10, 50, 40, 50),
        (45, 50, 45, 50),
        (0, 10, 0, 20),
        (10, 10, 0, 10),
        (3, 7, 1, 9),
        (100, 100, 81, 100),
        (0, 1, 1, 1),
        (56, 70, 48, 80),
        (5, 56, 0, 29),
        (250, 400, 700, 1000),
    ],
)
def test_fisher_exact_matches_scipy(k1, n1, k2, n2):
    ref = sps.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]]).pvalue
    assert fisher_exact_p(k1, n1, k2, n2) == pytest.approx(ref, rel=1e-9, abs=1e-300)
    assert fisher_exact_p(k2, n2, k1, n1) == pytest.approx(ref, rel=1e-9, abs=1e-300)  # symmetric


def test_fisher_exact_refuses_part_credit():
    with pytest.raises(ValueError, match="k=2.5"):
        fisher_exact_p(2.5, 10, 3, 10)


@pytest.mark.parametrize("n,seed", [(2, 0), (3, 1), (10, 2), (30, 3), (100, 4), (400, 5)])
def test_paired_t_p_matches_scipy_ttest_rel(n, seed):
    rng = random.Random(seed)
    for shift in (0.0, 0.05, 0.3):
        a = [rng.randint(0, 3) / 3 for _ in range(n)]
        b = [min(1.0, max(0.0, x - shift + rng.choice((-1, 0, 0, 1)) / 3)) for x in a]
        if max(x - y for x, y in zip(a, b)) - min(x - y for x, y in zip(a, b)) < 1e-9:
            continue  # all equal: the exact bound's p (below)
        d = paired_mean_diff([x - y for x, y in zip(a, b)])
        ref = sps.ttest_rel(a, b).pvalue
        assert d.p == pytest.approx(ref, rel=1e-9, abs=1e-14), (n, shift)
        assert (d.p < 0.05) == d.resolvable  # the same statistic as the interval


def test_t_test_p_matches_scipy():
    for t, v in ((0.5, 1), (2.0, 3), (2.6, 10), (4.0, 23), (1.96, 1000)):
        assert t_test_p(t, 1.0, v) == pytest.approx(2 * sps.t.sf(t, v), rel=1e-9)
    assert t_test_p(0.0, 0.0, 5) == 1.0 and t_test_p(-0.2, 0.0, 5) == 0.0  # a point interval


def test_paired_ties_p_agrees_with_the_exact_bound():
    """Every difference equal to c: p = (1 + |c|)^-n, and p < alpha exactly when the 1 - alpha exact bound
    excludes 0 (c = 0.5: 2 prompts p = 0.44, 8 prompts p = 0.039)."""
    assert paired_mean_diff([0.0] * 50).p == 1.0
    assert paired_mean_diff([0.5] * 2).p == pytest.approx(1.5**-2)
    assert paired_mean_diff([0.5] * 8).p == pytest.approx(1.5**-8)
    for c in (0.5, -0.5, 0.1, 1.0, -1 / 3):
        for n in range(1, 40):
            d = paired_mean_diff([c] * n)
            for conf in (0.9, 0.95, 0.99):
                if abs(d.p - (1 - conf)) > 1e-9:  # away from the boundary itself
                    assert (d.p < 1 - conf) == paired_mean_diff([c] * n, conf).resolvable, (c, n, conf)


# R 4.2.2 p.adjust(p, "holm") on the same vectors
HOLM_R = [
    ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
    (
        [0.0131, 0.0703, 0.625, 5.6e-06, 0.0525, 1, 0.0002, 0.0002, 0.9, 0.049],
        [0.0917, 0.294, 1.0, 0.000056, 0.294, 1.0, 0.0018, 0.0018, 1.0, 0.294],
    ),
]


@pytest.mark.parametrize("p,adj", HOLM_R)
def test_holm_matches_r_p_adjust(p, adj):
    assert holm(p) == pytest.approx(adj, rel=1e-12)


def test_holm_edge_cases_and_family_wise_error():
    """One test: unchanged; none: empty; a p outside [0, 1] is an error. 2,000 families of 20 true nulls
    (independent uniform p): some adjusted p < 0.05 in 3-6.5% of them (Holm: <= 5%, near 1 - 0.95^(1)
    ... at most alpha), where unadjusted p < 0.05 somewhere happens in ~64% (1 - 0.95^20)."""
    assert holm([0.03]) == [0.03] and holm([]) == []
    with pytest.raises(ValueError, match="1.2"):
        holm([0.1, 1.2])
    rng = random.Random(7)
    any_holm = any_raw = 0
    for _ in range(2000):
        p = [rng.random() for _ in range(20)]
        any_holm += min(holm(p)) < 0.05
        any_raw += min(p) < 0.05
    assert 0.03 <= any_holm / 2000 <= 0.065, any_holm
    assert 0.58 <= any_raw / 2000 <= 0.70, any_raw


def _res(arm, outcomes_by_cell, digest="d"):
    """A result with 0/1 cells {(task, length): outcomes}: every prompt's outcome kept, so arms pair."""
    cells, samples = [], []
    for (task, L), out in outcomes_by_cell.items():
        cells.append(
            {
                "task": task,
                "length": L,
                "n": len(out),
                "correct": sum(out),
                "acc_pp": 100 * sum(out) / len(out),
                "digest": f"{digest}{task}{L}",
            }
        )
        samples += [{"task": task, "length": L, "index": i, "correct": bool(x)} for i, x in enumerate(out)]
    return {"arm": arm, "step": 0, "cells": cells, "samples": samples}


def _outcomes(both, only_a, only_b, neither):
    """Arm a's and arm b's outcomes on the same prompts from a paired 2x2 table."""
    a = [1] * both + [1] * only_a + [0] * only_b + [0] * neither
    b = [1] * both + [0] * only_a + [1] * only_b + [0] * neither
    return a, b


def test_compare_stars_only_what_survives_holm():
    """One compare, 2 tasks x 3 lengths of paired 0/1 cells: the star is Holm's decision over all six exact
    McNemar p (scipy's binomtest), not the interval's. t1@300 (9 vs 1 discordant, p = 0.021) keeps its star
    alone and loses it among five more (adj = 3 x 0.021 = 0.064) though its interval excludes 0; the three
    cells at p = 0.0078-0.012 keep theirs (adj 0.047); (1, 1, 7, 12) has an interval that excludes 0 and
    p = 0.070, never a star; the table prints raw and adjusted p. Unpaired 0/1 cells (other prompts) join the
    family with Fisher's exact p; unpaired part-credit cells have no test: no p, no star, not in the family."""
    tables = {
        ("t1", 100): (80, 10, 1, 9),
        ("t1", 200): (70, 8, 0, 22),
        ("t1", 300): (60, 9, 1, 30),
        ("t2", 100): (1, 1, 7, 12),
        ("t2", 200): (50, 3, 3, 44),
        ("t2", 300): (40, 8, 0, 52),
    }
    ab = {k: _outcomes(*t) for k, t in tables.items()}
    ra, rb = _res("new", {k: v[0] for k, v in ab.items()}), _res("base", {k: v[1] for k, v in ab.items()})
    got = starred([rb, ra], 0)
    raw = {k: sps.binomtest(t[1], t[1] + t[2], 0.5).pvalue for k, t in tables.items()}
    # Holm by its definition: the i-th smallest of m = 6 times (6 - i + 1), running maximum
    order = sorted(raw, key=raw.get)
    want, run = {}, 0.0
    for i, k in enumerate(order):
        run = max(run, min(1.0, (6 - i) * raw[k]))
        want[k] = run
    for (task, L), p in raw.items():
        c = got[(task, 1, L)]
        assert c.d.p == pytest.approx(p, rel=1e-12) and c.p_adj == pytest.approx(want[(task, L)], rel=1e-12)
        assert c.star == (want[(task, L)] < 0.05)
    assert got[("t2", 1, 100)].d.resolvable and not got[("t2", 1, 100)].star  # interval says yes, test no
    assert got[("t1", 1, 300)].d.resolvable and got[("t1", 1, 300)].d.p < 0.05  # raw p < 0.05 ...
    assert not got[("t1", 1, 300)].star and got[("t1", 1, 300)].p_adj > 0.05  # ... adjusted not
    assert all(got[(t, 1, L)].star for t, L in (("t1", 100), ("t1", 200), ("t2", 300)))
    md = markdown([rb, ra])
    k = ("t2", 300)
    d = newcombe_paired(*tables[k])
    assert (f"+8.0* [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}] p {raw[k]:.2g} adj {want[k]:.2g} |") in md
    assert "Holm-adjusted over the 6 tested differences of this compare" in md
    # alone, the t1@300 cell keeps its star: a family of 1
    k = ("t1", 300)
    alone = starred([_res("base", {k: ab[k][1]}), _res("new", {k: ab[k][0]})], 0)
    assert alone[("t1", 1, 300)].star and alone[("t1", 1, 300)].p_adj == pytest.approx(raw[k])
    # an arm on other prompts: its 0/1 cells are unpaired, tested by Fisher's exact test (scipy's fisher_exact)
    # and join the family: Holm over 12
    rc = _res("other", {k: v[0] for k, v in ab.items()}, digest="x")
    got3 = starred([rb, ra, rc], 0)
    fisher = {k: sps.fisher_exact([[sum(x), len(x) - sum(x)] for x in ab[k]]).pvalue for k in tables}
    raw12 = {**{(t, 1, L): raw[(t, L)] for t, L in tables}, **{(t, 2, L): fisher[(t, L)] for t, L in tables}}
    want12, run = {}, 0.0
    for i, k in enumerate(sorted(raw12, key=raw12.get)):
        run = max(run, min(1.0, (12 - i) * raw12[k]))
        want12[k] = run
    assert {k: c.d.p for k, c in got3.items()} == pytest.approx(raw12, rel=1e-9)
    assert {k: c.p_adj for k, c in got3.items()} == pytest.approx(want12, rel=1e-9)
    assert {k for k, c in got3.items() if c.star} == {k for k, q in want12.items() if q < 0.05}
    md3 = markdown([rb, ra, rc])
    assert "Holm-adjusted over the 12 tested differences of this compare" in md3
    rows = [ln for ln in md3.splitlines() if ln.startswith("| other@0 | ") and "(prompts differ)" in ln]
    k = ("t1", 100)
    assert len(rows) == 2 and rows[0].startswith(
        f"| other@0 | +9.0 [-0.9, +18.9] p {fisher[k]:.2g} adj "
        f"{want12[('t1', 2, 100)]:.2g} n/arm 237 (prompts differ) |"
    )
    # part credit on other prompts: no test (Newcombe's interval with the summed scores is only conservative),
    # no star even where the interval excludes 0, and not in the family
    part = {
        "arm": "part",
        "step": 0,
        "samples": [],
        "cells": [
            {"task": "t1", "length": 100, "n": 100, "correct": 97.5, "all_correct": 95, "acc_pp": 97.5, "digest": "y"}
        ],
    }
    got4 = starred([rb, part], 0)
    c4 = got4[("t1", 1, 100)]
    assert c4.d.resolvable and c4.d.p is None and c4.p_adj is None and not c4.star
    md4 = markdown([rb, part])
    i = newcombe(97.5, 100, 81, 100)
    assert f"| part@0 | +16.5 [{100 * i.lo:+.1f}, {100 * i.hi:+.1f}] (prompts differ) | - | - |" in md4
    assert "over the 0 tested differences" in md4
    # an integer sum of part credit (90 = 85 prompts fully right + 10 halves) is still not 0/1: no Fisher p
    part["cells"][0].update(correct=90, all_correct=85, acc_pp=90.0)
    assert starred([rb, part], 0)[("t1", 1, 100)].d.p is None
