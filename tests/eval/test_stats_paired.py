"""The paired interval (stats.newcombe_paired) and compare's choice of it (report.difference):
arms scored on the same seeded prompts are paired data, and a paired interval is both valid
(coverage) and narrower when the arms agree on most prompts."""
import random

import pytest

from megablu.eval.report import difference
from megablu.eval.stats import n_to_resolve, n_to_resolve_paired, newcombe, newcombe_paired


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
            b = (u < 0.7) if rng.random() < 0.8 else (rng.random() < 0.7)   # mostly the same prompts fail
            t[(0 if a else 2) + (0 if b else 1)] += 1
        both, only1, only2, neither = t[0], t[1], t[2], t[3]
        d = newcombe_paired(both, only1, only2, neither)
        i = newcombe(both + only1, 100, both + only2, 100)
        cover += d.lo <= true <= d.hi
        cover_i += i.lo <= true <= i.hi
        width += d.hi - d.lo
        width_i += i.hi - i.lo
    assert 0.93 <= cover / sims <= 0.975, cover / sims
    assert cover_i / sims > 0.975                      # independent: too wide for paired data
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
    assert paired == (303, 14, 0, 83) and d.resolvable and d.lo > 0
    assert not i.resolvable and d.diff == pytest.approx(i.diff)
    rc, cc = _res(arm, digest="other")
    d2, paired2 = difference(rc, cc, rb, cb)
    assert paired2 is None and (d2.lo, d2.hi) == pytest.approx((i.lo, i.hi))
    # part-credit scores (not 0/1) or missing samples: independent
    ra["samples"][0]["score"] = 0.5
    assert difference(ra, ca, rb, cb)[1] is None
    del rb["samples"][-1]
    assert difference(_res(arm)[0], ca, rb, cb)[1] is None


def test_paired_sample_size():
    """McNemar's sample size (Connor 1987): with independent arms it is the independent formula's n
    (within rounding); the more the arms agree (fewer discordant prompts), the fewer prompts; and a
    simulated paired study of that size resolves the difference about `power` of the time."""
    p1, p2 = 0.8, 0.7
    indep_psi = p1 * (1 - p2) + p2 * (1 - p1)                # discordant share of independent arms
    assert abs(n_to_resolve_paired(indep_psi, p1 - p2) - n_to_resolve(p1, p2)) <= 0.03 * n_to_resolve(p1, p2)
    assert n_to_resolve_paired(0.14, 0.10) < n_to_resolve(p1, p2) / 2
    n = n_to_resolve_paired(0.14, 0.10)
    rng = random.Random(1)
    hits = 0
    for _ in range(1000):
        t = [0, 0, 0, 0]
        for _ in range(n):
            u = rng.random()
            t[0 if u < 0.68 else 1 if u < 0.80 else 2 if u < 0.82 else 3] += 1    # only1 0.12, only2 0.02
        hits += newcombe_paired(*t).resolvable
    assert 0.7 < hits / 1000 < 0.9, (n, hits)
    with pytest.raises(ValueError):
        n_to_resolve_paired(0.1, 0.0)
