"""Statistics that decide whether an arm is better: intervals, differences, slope, effective length.

All accuracies are fractions in [0, 1] inside the functions; reports show percentage points.
- Wilson score interval (Wilson 1927), no continuity correction.
- Difference of two independent proportions: Newcombe's hybrid score interval (Newcombe
  1998, "Interval estimation for the difference between independent proportions",
  method 10), built from the two Wilson intervals. "Resolvable" = the interval excludes 0.
- Difference of two proportions measured on the SAME prompts (two arms, one seeded prompt
  set): Newcombe's interval for paired data (Newcombe 1998, "Improved confidence intervals for
  the difference between binomial proportions based on paired data", Stat Med 17:2635-2650,
  method 10; recommended by Fagerland, Lydersen & Laake 2014): the two marginal Wilson intervals
  combined with a corrected phi correlation of the 2x2 table (a, b, c, d) = (both right, arm 1 only,
  arm 2 only, neither), n = a + b + c + d. With A = ad - bc: phi = (A - n/2) / sqrt(efgh) when
  A > n/2 (e..h the four margins), 0 when 0 <= A <= n/2, A / sqrt(efgh) when A < 0 (a negative
  correlation is kept: it widens the interval), and 0 when a margin is 0 (then A = 0 anyway). The
  n/2 is a continuity correction of the numerator only; without it (method 8) the interval is a
  little too narrow. With phi = 0 it is the independent interval; with the positive correlation
  two arms have on one prompt set it is narrower, so a real difference resolves with fewer
  prompts. Only for 0/1 scores.
- The test beside the paired interval: McNemar's exact (conditional) test, two-sided: given the
  b + c prompts the arms disagree on, b ~ Binomial(b + c, 1/2) under "no difference";
  p = min(1, 2 P(X <= min(b, c))). Not the mid-p version: the exact p never exceeds the level, and
  a star (compare.py) is a claim made after a multiplicity correction, so it should not rest on a
  test that can be liberal.
- Two independent samples of 0/1 scores (other prompts): Fisher's exact test, two-sided (the
  probability of every split of the successes no more likely than the one seen), beside Newcombe's
  independent interval.
- Difference of two mean part-credit scores on the SAME prompts: the paired t interval of the
  per-prompt differences d_i = s_1,i - s_2,i, mean(d) +- t_{n-1} sd(d) / sqrt(n) (Student's t, exact
  quantile below; d_i in [-1, 1] so the mean is near normal for the n of an eval). Like Newcombe's paired
  interval it gains from the arms' agreement on a prompt; like any Wald-type interval it is somewhat
  liberal when only a handful of prompts differ at all (4 of 100 moving by the same amount resolve, where
  a sign test would not). When every d_i is equal the t interval is a point; we give the exact bound
  instead: having seen no prompt of n differ from c, the share of prompts that could is at most
  q = 1 - (1 - conf)^(1/n) (Clopper-Pearson, the "rule of three" 3/n), each by at most the range of d, so
  the mean is in [c - q (c + 1), c + q (1 - c)]: 100 ties at c = 0 give +-3 pp, never resolvable, and
  c = 0.5 on 2 prompts is not resolved while on 8 it is (a sign test: 6).
  Its test: the two-sided p of the paired t statistic mean(d) / (sd(d) / sqrt(n)) on n - 1 dof
  (scipy.stats.ttest_rel); for equal d_i = c the p at which the exact bound just excludes 0,
  (1 + |c|)^-n (1 when c = 0), so p < 1 - conf exactly when the interval excludes 0.
- Holm's step-down correction (Holm 1979) of the p values of one family of tests: sorted
  ascending, p_(i) is adjusted to max_{j <= i} min(1, (m - j + 1) p_(j)); rejecting where the
  adjusted p < alpha keeps the chance of any false rejection <= alpha under any dependence
  between the tests (compare.py: the cells one `megablu compare` stars).
- Slope in pp per doubling: ordinary least squares of accuracy (pp) on log2(length). Its
  sampling interval propagates each point's binomial variance through the OLS weights
  (with the Agresti-Coull p~ = (k+2)/(n+4) so 0/n and n/n points are not certain); with
  >= 3 lengths a second, t-based interval from the fit residuals is given too.
- Effective length (RULER, Hsieh et al. 2024): the longest length whose accuracy is >= the
  threshold (85.6 = Llama2-7B at 4k).
- Part credit (RULER's string_match_all: a prompt with several answers scores the fraction
  found): k is the sum of the scores, a real number. A score X in [0, 1] with mean p has
  Var(X) <= p (1 - p), the Bernoulli variance, so the Wilson interval (and Newcombe's) with
  this k and n = prompts is conservative, never too narrow; for 0/1 scores it is the usual one.
- RULER-style average over tasks: the mean of the tasks' accuracies, its normal interval from
  the sum of the tasks' binomial variances (Agresti-Coull p~ per task, as for the slope), the
  tasks' prompts being independent draws.
- Sample size per arm to resolve a difference: normal approximation for two proportions,
  n = (z_{1-a/2} + z_{power})^2 (p1 q1 + p2 q2) / (p1 - p2)^2; for paired 0/1 outcomes McNemar's
  (Connor 1987); for paired part-credit means n = ((z_{1-a/2} + z_{power}) sd(d) / diff)^2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional

RULER_THRESHOLD = 85.6
_TIE = 1e-9  # per-prompt differences closer than this are equal (2/3 - 1/3 and 1 - 2/3 differ in the last bit)


def z_of(conf: float = 0.95) -> float:
    return NormalDist().inv_cdf(0.5 + conf / 2)


def wilson(k: float, n: int, conf: float = 0.95) -> tuple[float, float, float]:
    """(p, lo, hi) for k successes in n trials (k may be a sum of part-credit scores, see above)."""
    if n <= 0:
        raise ValueError(f"wilson: n={n} must be > 0")
    if not 0 <= k <= n:
        raise ValueError(f"wilson: k={k} outside 0..n={n}")
    z = z_of(conf)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return p, max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Difference:
    diff: float  # p1 - p2
    lo: float
    hi: float
    p: Optional[float] = None  # two-sided p of the paired test (exact McNemar, paired t); None: no test

    @property
    def resolvable(self) -> bool:
        """The interval excludes zero: the sign of the difference is resolved at this confidence."""
        return self.lo > 0 or self.hi < 0

    def as_dict(self) -> dict:
        return {
            "diff_pp": 100 * self.diff,
            "ci_pp": [100 * self.lo, 100 * self.hi],
            "resolvable": self.resolvable,
            **({"p": self.p} if self.p is not None else {}),
        }


def newcombe(k1: int, n1: int, k2: int, n2: int, conf: float = 0.95) -> Difference:
    """Interval for p1 - p2 (Newcombe 1998, method 10)."""
    p1, l1, u1 = wilson(k1, n1, conf)
    p2, l2, u2 = wilson(k2, n2, conf)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return Difference(d, lo, hi)


def newcombe_phi(both: int, only1: int, only2: int, neither: int) -> float:
    """Newcombe's corrected phi of a paired 2x2 table (1998, method 10; module docstring): the numerator
    A = ad - bc shrunk towards 0 by n/2 when positive, kept when negative, 0 when a margin is 0."""
    n = both + only1 + only2 + neither
    margins = (both + only1) * (only2 + neither) * (both + only2) * (only1 + neither)  # e f g h, exact int
    if margins == 0:  # a margin of 0 empties two cells, one in each product: A = 0
        return 0.0
    a = both * neither - only1 * only2
    if a > n / 2:
        return (a - n / 2) / math.sqrt(margins)
    return a / math.sqrt(margins) if a < 0 else 0.0


def newcombe_paired(both: int, only1: int, only2: int, neither: int, conf: float = 0.95) -> Difference:
    """Interval for p1 - p2 from paired 0/1 outcomes: `both` prompts right in arm 1 and arm 2,
    `only1` right in arm 1 only, `only2` in arm 2 only, `neither` (Newcombe 1998, paired, method 10,
    with its corrected phi), and McNemar's exact p (mcnemar_exact_p)."""
    n = both + only1 + only2 + neither
    p1, l1, u1 = wilson(both + only1, n, conf)
    p2, l2, u2 = wilson(both + only2, n, conf)
    phi = newcombe_phi(both, only1, only2, neither)
    d = p1 - p2
    # delta^2 and epsilon^2 of the paper: the Wilson distances combined with -2 phi (|phi| <= 1: >= 0)
    lo = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    hi = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    return Difference(d, d - math.sqrt(max(lo, 0.0)), d + math.sqrt(max(hi, 0.0)), mcnemar_exact_p(only1, only2))


def mcnemar_exact_p(only1: int, only2: int) -> float:
    """Two-sided exact McNemar p: only1 ~ Binomial(only1 + only2, 1/2) given the discordant prompts,
    p = min(1, 2 P(X <= min(only1, only2))) (module docstring); 1 when the arms never disagree."""
    if only1 < 0 or only2 < 0:
        raise ValueError(f"mcnemar_exact_p: counts must be >= 0, got only1={only1}, only2={only2}")
    m = only1 + only2
    tail = sum(math.comb(m, i) for i in range(min(only1, only2) + 1))  # exact integers: no underflow
    return min(1.0, 2 * tail / 2**m)


def fisher_exact_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p of Fisher's exact test of k1/n1 against k2/n2 (independent samples of 0/1 scores): given
    the K = k1 + k2 successes, k1 is hypergeometric; p = the total probability of every split no more
    likely than the one seen (scipy.stats.fisher_exact's two-sided definition), in exact integers."""
    for k, n in ((k1, n1), (k2, n2)):
        if not (0 <= k <= n and int(k) == k and int(n) == n):
            raise ValueError(f"fisher_exact_p: need integer 0 <= k <= n, got k={k}, n={n}")
    k1, n1, k2, n2 = int(k1), int(n1), int(k2), int(n2)
    K = k1 + k2
    # weights C(n1, x) C(n2, K - x), each proportional to P(k1 = x); the constant C(n1 + n2, K) cancels
    w = {x: math.comb(n1, x) * math.comb(n2, K - x) for x in range(max(0, K - n2), min(K, n1) + 1)}
    return min(1.0, sum(v for v in w.values() if v <= w[k1]) / sum(w.values()))


def t_test_p(mean: float, se: float, dof: int) -> float:
    """Two-sided p of t = mean / se on `dof` degrees of freedom; se 0: 1 for a zero mean, else 0 (the
    t interval is the point `mean`)."""
    if se <= 0:
        return 1.0 if mean == 0 else 0.0
    return max(0.0, 1.0 - _t_central(abs(mean) / se, int(dof)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p values (step-down, Holm 1979), in the order given: the i-th smallest of m becomes
    max over j <= i of min(1, (m - j + 1) p_(j)). Reject where the adjusted p < alpha (family-wise error
    <= alpha under any dependence)."""
    m = len(pvalues)
    for q in pvalues:
        if not 0 <= q <= 1:
            raise ValueError(f"holm: p value {q} outside [0, 1]")
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda k: pvalues[k])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))  # monotone: never below a smaller p's
        out[i] = running
    return out


def paired_mean_diff(diffs: Sequence[float], conf: float = 0.95) -> Difference:
    """Interval for the mean of per-prompt score differences d_i in [-1, 1] of two arms on the same prompts:
    Student's t, or the exact bound when every d_i is equal (module docstring); clipped to [-1, 1]; with the
    two-sided p of the paired t test (or of the exact bound)."""
    n = len(diffs)
    if n == 0:
        raise ValueError("paired_mean_diff: no differences")
    m = sum(diffs) / n
    if max(diffs) - min(diffs) <= _TIE:  # sd 0 (or one prompt): the t interval would be the point m
        q = 1 - (1 - conf) ** (1 / n)
        lo, hi = m - q * (m + 1), m + q * (1 - m)
        # the level at which this bound just excludes 0: q = |m| / (1 + |m|) <=> 1 - conf = (1 + |m|)^-n
        p = 1.0 if abs(m) <= _TIE else (1 + abs(m)) ** -n
    else:
        se = math.sqrt(sum((x - m) ** 2 for x in diffs) / (n - 1) / n)
        half = t_quantile(conf, n - 1) * se
        lo, hi = m - half, m + half
        p = t_test_p(m, se, n - 1)
    return Difference(m, max(-1.0, lo), min(1.0, hi), p)


@dataclass(frozen=True)
class Slope:
    pp_per_doubling: float
    ci_pp: tuple[float, float]  # binomial sampling interval
    fit_ci_pp: Optional[tuple[float, float]]  # t-interval from residuals (>= 3 lengths)
    intercept_pp: float  # accuracy (pp) at log2(length) = 0

    def as_dict(self) -> dict:
        return {
            "pp_per_doubling": self.pp_per_doubling,
            "ci_pp": list(self.ci_pp),
            "fit_ci_pp": list(self.fit_ci_pp) if self.fit_ci_pp else None,
        }


def slope_per_doubling(lengths: Sequence[int], correct: Sequence[int], n: Sequence[int], conf: float = 0.95) -> Slope:
    """OLS slope of accuracy (pp) on log2(length), with intervals (see module docstring)."""
    if len(lengths) < 2 or len(set(lengths)) < 2:
        raise ValueError(f"slope needs >= 2 distinct lengths, got {list(lengths)}")
    x = [math.log2(L) for L in lengths]
    y = [100 * k / m for k, m in zip(correct, n, strict=True)]
    xb, yb = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((xi - xb) ** 2 for xi in x)
    c = [(xi - xb) / sxx for xi in x]  # slope = sum(c_i * y_i)
    b = sum(ci * yi for ci, yi in zip(c, y, strict=True))
    a = yb - b * xb
    # Var(y_i) in pp^2 from the binomial, with Agresti-Coull p~ so extremes keep a variance
    var = sum(
        ci * ci * 1e4 * ((k + 2) / (m + 4)) * (1 - (k + 2) / (m + 4)) / m
        for ci, k, m in zip(c, correct, n, strict=True)
    )
    z = z_of(conf)
    ci = (b - z * math.sqrt(var), b + z * math.sqrt(var))
    fit = None
    dof = len(x) - 2
    if dof >= 1:
        rss = sum((yi - (a + b * xi)) ** 2 for xi, yi in zip(x, y, strict=True))
        se = math.sqrt(rss / dof / sxx)
        tq = t_quantile(conf, dof)
        fit = (b - tq * se, b + tq * se)
    return Slope(b, ci, fit, a)


def _t_central(t: float, v: int) -> float:
    """P(|T| < t) for Student's t with integer v dof (Abramowitz & Stegun 26.7.3-4, exact series)."""
    th = math.atan(t / math.sqrt(v))
    c2 = math.cos(th) ** 2
    total, term = 1.0, 1.0
    if v % 2:
        for k in range(1, (v - 3) // 2 + 1):
            term *= 2 * k / (2 * k + 1) * c2
            total += term
        return 2 / math.pi * (th + (math.sin(th) * math.cos(th) * total if v > 1 else 0.0))
    for k in range(1, (v - 2) // 2 + 1):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return math.sin(th) * total


def t_quantile(conf: float, v: int) -> float:
    """t such that P(|T| < t) = conf (two-sided), by bisection on the exact central probability.

    Pure Python so the stats need no scipy at run time (importing scipy.stats costs seconds)."""
    if v < 1 or int(v) != v:
        raise ValueError(f"t_quantile: dof={v} must be a positive integer")
    lo, hi = 0.0, 1.0
    while _t_central(hi, int(v)) < conf:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_central(mid, int(v)) < conf:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def effective_length(acc_pp_by_length: dict[int, float], threshold: float = RULER_THRESHOLD) -> Optional[int]:
    """The longest length whose accuracy (pp) is >= threshold; None if no length reaches it."""
    ok = [L for L, a in acc_pp_by_length.items() if a >= threshold]
    return max(ok) if ok else None


def effective_length_contiguous(
    acc_pp_by_length: dict[int, float], threshold: float = RULER_THRESHOLD
) -> Optional[int]:
    """The longest length L such that every length <= L reaches the threshold (stricter)."""
    best = None
    for L in sorted(acc_pp_by_length):
        if acc_pp_by_length[L] < threshold:
            break
        best = L
    return best


def mean_variance(cells: Sequence[tuple[float, int]]) -> float:
    """The variance of the mean accuracy of T tasks (k_t, n_t), from each task's binomial variance at the
    Agresti-Coull estimate (k + 2) / (n + 4) (module docstring)."""
    if not cells:
        raise ValueError("mean_variance: no cells")
    return sum(((k + 2) / (n + 4)) * (1 - (k + 2) / (n + 4)) / n for k, n in cells) / len(cells) ** 2


def mean_interval(cells: Sequence[tuple[float, int]], conf: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi) of the accuracies k_t / n_t of T tasks (module docstring)."""
    if not cells:
        raise ValueError("mean_interval: no cells")
    m = sum(k / n for k, n in cells) / len(cells)
    half = z_of(conf) * math.sqrt(mean_variance(cells))
    return m, max(0.0, m - half), min(1.0, m + half)


def n_to_resolve_paired(discordant: float, diff: float, conf: float = 0.95, power: float = 0.8) -> int:
    """Prompts (scored by both arms) so a true paired difference `diff` = P(only arm 1 right) -
    P(only arm 2 right), with `discordant` = their sum, is resolved with the given power (Connor
    1987, the sample size of McNemar's test): n = (z_a sqrt(psi) + z_b sqrt(psi - diff^2))^2 / diff^2.
    With the arms independent it is the independent formula's n; the more the arms agree, the
    fewer prompts."""
    if diff == 0:
        raise ValueError("n_to_resolve_paired: diff == 0, no finite sample resolves a zero difference")
    if not abs(diff) <= discordant <= 1:
        raise ValueError(f"n_to_resolve_paired: need |diff| <= discordant <= 1, got {diff}, {discordant}")
    za, zb = z_of(conf), NormalDist().inv_cdf(power)
    n = (za * math.sqrt(discordant) + zb * math.sqrt(discordant - diff * diff)) ** 2 / diff**2
    return max(1, math.ceil(n - 1e-9))


def n_to_resolve_mean(sd: float, diff: float, conf: float = 0.95, power: float = 0.8) -> int:
    """Prompts (scored by both arms) so a true mean paired difference `diff` of part-credit scores, whose
    per-prompt differences have standard deviation `sd`, is resolved with the given power (the paired t
    test's normal approximation): n = ((z_a + z_b) sd / diff)^2. sd 0: the smallest n whose exact bound
    (paired_mean_diff) excludes 0, n > ln(1/(1 - conf)) / ln(1 + |diff|)."""
    if diff == 0:
        raise ValueError("n_to_resolve_mean: diff == 0, no finite sample resolves a zero difference")
    if sd <= _TIE:
        return math.floor(math.log(1 / (1 - conf)) / math.log(1 + abs(diff))) + 1
    za, zb = z_of(conf), NormalDist().inv_cdf(power)
    n = ((za + zb) * sd / diff) ** 2
    return max(2, math.ceil(n - 1e-9))


def n_to_resolve(p1: float, p2: float, conf: float = 0.95, power: float = 0.8) -> int:
    """Prompts per arm so a true difference p1 - p2 is resolved with the given power."""
    if p1 == p2:
        raise ValueError("n_to_resolve: p1 == p2, no finite sample resolves a zero difference")
    za, zb = z_of(conf), NormalDist().inv_cdf(power)
    n = (za + zb) ** 2 * (p1 * (1 - p1) + p2 * (1 - p2)) / (p1 - p2) ** 2
    return max(1, math.ceil(n - 1e-9))
