"""What `megablu compare` prints: arms in rows and lengths in columns, one row per arm, then
each arm's difference to a baseline with its 95% interval: paired where both arms scored the same prompts
(Newcombe's for 0/1 scores with McNemar's exact p, a paired t interval and p on part-credit scores), else
Newcombe's for independent samples (with Fisher's exact p for 0/1 scores). '*' = the cell's test survives
Holm's correction over every tested difference of the compare (starred()). Then the RULER averages and the
held-out loss of every set. The results themselves: results.py.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from .results import (
    AVERAGES,
    _fmt_len,
    _label,
    cells_by,
    loss_section,
    loss_set_names,
    ruler_average,
    summarize,
)
from .stats import (
    RULER_THRESHOLD,
    Difference,
    fisher_exact_p,
    holm,
    n_to_resolve,
    n_to_resolve_mean,
    n_to_resolve_paired,
    newcombe,
    newcombe_paired,
    paired_mean_diff,
    wilson,
)

STAR_ALPHA = 0.05  # family-wise error rate of a compare's stars (Holm)


@dataclass(frozen=True)
class Pairing:
    """How difference() paired two cells scored on the same prompts (None there: independent samples).
    kind "binary": 0/1 scores, Newcombe's paired interval, table = (both right, only a, only b, neither);
    kind "mean": part-credit scores, the paired t interval of the n per-prompt differences, sd = their SD."""

    kind: str
    n: int
    table: Optional[tuple[int, int, int, int]] = None
    sd: Optional[float] = None


def _score(s: dict) -> Optional[float]:
    """A sample's score (results before part credit: its 0/1 `correct`), None when it has neither."""
    if "score" in s:
        return float(s["score"])
    return float(bool(s["correct"])) if "correct" in s else None


def difference(res_a: dict, cell_a: dict, res_b: dict, cell_b: dict) -> tuple[Difference, Optional[Pairing]]:
    """(interval for acc_a - acc_b, its Pairing or None). Paired when both cells hold the same prompts (equal
    digests and n) and both results keep every prompt's score: stats.newcombe_paired when every score is 0/1,
    else stats.paired_mean_diff of the per-prompt differences; otherwise the independent interval
    (stats.newcombe, conservative for part credit; with Fisher's exact p when both cells are 0/1 scores) and
    None."""
    if cell_a.get("digest") and cell_a.get("digest") == cell_b.get("digest") and cell_a["n"] == cell_b["n"]:
        key = (cell_a["task"], cell_a["length"])
        out_a = {s.get("index"): _score(s) for s in res_a.get("samples", []) if (s.get("task"), s.get("length")) == key}
        out_b = {s.get("index"): _score(s) for s in res_b.get("samples", []) if (s.get("task"), s.get("length")) == key}
        scores = (*out_a.values(), *out_b.values())
        if (
            len(out_a) == len(out_b) == cell_a["n"]
            and out_a.keys() == out_b.keys()
            and None not in out_a
            and None not in scores
        ):
            sa = {i: x for i, x in out_a.items() if x is not None}  # every score is kept (checked above)
            sb = {i: x for i, x in out_b.items() if x is not None}
            if all(x in (0.0, 1.0) for x in scores):
                t = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
                for i in sa:
                    t[(sa[i] == 1.0, sb[i] == 1.0)] += 1
                table = (t[(True, True)], t[(True, False)], t[(False, True)], t[(False, False)])
                return newcombe_paired(*table), Pairing("binary", cell_a["n"], table=table)
            per_prompt = [sa[i] - sb[i] for i in sa]
            return paired_mean_diff(per_prompt), Pairing(
                "mean", len(per_prompt), sd=statistics.stdev(per_prompt) if len(per_prompt) > 1 else 0.0
            )
    d = newcombe(cell_a["correct"], cell_a["n"], cell_b["correct"], cell_b["n"])
    if _binary(cell_a) and _binary(cell_b):  # 0/1 scores: Fisher's exact test beside the interval
        d = dataclasses.replace(
            d, p=fisher_exact_p(int(cell_a["correct"]), cell_a["n"], int(cell_b["correct"]), cell_b["n"])
        )
    return d, None


def _binary(c: dict) -> bool:
    """A cell of 0/1 scores: an integer count whose prompts were all fully right or wrong (all_correct ==
    correct; results before part credit have no all_correct and only 0/1 scores)."""
    k = float(c["correct"])
    return k.is_integer() and c.get("all_correct", k) == k


@dataclass(frozen=True)
class Compared:
    """One cell of a compare's difference tables: the interval and test (difference()), its Pairing, and the
    Holm-adjusted p over the compare's family (None: no test, an unpaired part-credit cell)."""

    d: Difference
    paired: Optional[Pairing]
    p_adj: Optional[float]

    @property
    def star(self) -> bool:
        return self.p_adj is not None and self.p_adj < STAR_ALPHA


def starred(results: Sequence[dict], baseline: int) -> dict[tuple[str, int, int], Compared]:
    """Every difference `compare` shows, {(task, arm index, length): Compared}: each arm's cell against the
    baseline's at the same task and length. The family is every cell with a test (a p: paired cells, and
    unpaired ones of 0/1 scores); Holm's step-down correction over it decides the stars, so the chance of
    any false star in one compare stays <= 5%."""
    base = results[baseline]
    out: dict[tuple[str, int, int], tuple[Difference, Optional[Pairing]]] = {}
    for task in dict.fromkeys(c["task"] for r in results for c in r["cells"]):
        bc = cells_by(base, task)
        for j, r in enumerate(results):
            if j == baseline:
                continue
            cs = cells_by(r, task)
            for L in sorted(set(cs) & set(bc)):
                out[(task, j, L)] = difference(r, cs[L], base, bc[L])
    tested = {k: d.p for k, (d, _) in out.items() if d.p is not None}
    adj = dict(zip(tested, holm(list(tested.values())), strict=True))
    return {k: Compared(d, paired, adj.get(k)) for k, (d, paired) in out.items()}


def _fmt_p(p: float) -> str:
    return f"{p:.2g}"


def _task_tables(results: Sequence[dict], baseline: int, threshold: float) -> list[str]:
    """Per task: accuracy table (arm x length), Wilson intervals, then differences to the baseline arm, starred
    over the whole compare (starred())."""
    tasks = list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    diffs = starred(results, baseline) if len(results) > 1 else {}
    n_family = sum(c.p_adj is not None for c in diffs.values())
    lines = []
    for task in tasks:
        lengths = sorted({c["length"] for r in results for c in r["cells"] if c["task"] == task})
        lines += [
            f"### {task}",
            "",
            "| arm | " + " | ".join(str(L) for L in lengths) + " | pp/doubling [95%] | eff. length |",
            "|---|" + "---|" * len(lengths) + "---|---|",
        ]
        for r in results:
            cs = cells_by(r, task)
            row = [f"{cs[L]['acc_pp']:.1f}" if L in cs else "-" for L in lengths]
            summ = summarize([c for c in r["cells"] if c["task"] == task], threshold).get(task) or {
                "slope": None,
                "effective_length": None,
            }  # an arm without this task: a row of '-'
            s = summ["slope"]
            sl = f"{s['pp_per_doubling']:+.1f} [{s['ci_pp'][0]:+.1f}, {s['ci_pp'][1]:+.1f}]" if s else "-"
            lines.append(f"| {_label(r)} | " + " | ".join(row) + f" | {sl} | {_fmt_len(summ['effective_length'])} |")
        ns = sorted({c["n"] for r in results for c in r["cells"] if c["task"] == task})
        part = any(
            "all_correct" in c and c["all_correct"] != c["correct"]
            for r in results
            for c in r["cells"]
            if c["task"] == task
        )
        lines += [
            "",
            f"n per cell: {', '.join(map(str, ns))}; accuracy in % ("
            + ("mean part-credit score, RULER's string_match_all" if part else "exact")
            + f"); effective length = longest length >= "
            f"{threshold:g}%. Wilson 95% intervals:",
            "",
            "| arm | " + " | ".join(str(L) for L in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for r in results:
            cs = cells_by(r, task)
            row = [_ci(cs[L]) if L in cs else "-" for L in lengths]
            lines.append(f"| {_label(r)} | " + " | ".join(row) + " |")
        lines.append("")
        if len(results) > 1:
            base = results[baseline]
            lines += [
                f"Difference to {_label(base)} in pp, 95% interval: where both arms scored the same "
                f"prompts, paired -- Newcombe's for paired data (0/1 scores, no mark) or a paired t interval "
                f"of the per-prompt score differences (part credit, marked 'paired t'); else Newcombe's for "
                f"independent samples, marked '(prompts differ)', or 'indep.' for the same prompts without "
                f"per-prompt scores to pair. p = the two-sided p of the cell's test (paired: exact McNemar for "
                f"0/1 scores, paired t for part credit; unpaired 0/1 scores: Fisher's exact), adj = "
                f"Holm-adjusted over the {n_family} tested differences of this compare; * = adj < "
                f"{STAR_ALPHA:g} (unpaired part-credit cells have no test and no star; the intervals are not "
                f"adjusted); n/arm (intervals that include 0) = prompts per arm to "
                f"resolve the observed difference at 80% power (paired: McNemar's from the observed "
                f"agreement, or from the SD of the score differences):",
                "",
                "| arm | " + " | ".join(str(L) for L in lengths) + " |",
                "|---|" + "---|" * len(lengths),
            ]
            for j, r in enumerate(results):
                if j == baseline:
                    continue
                row = []
                for L in lengths:
                    if (task, j, L) not in diffs:
                        row.append("-")
                        continue
                    a, b = cells_by(r, task)[L], cells_by(base, task)[L]
                    cmp_ = diffs[(task, j, L)]
                    d, paired = cmp_.d, cmp_.paired
                    pa, pb = a["correct"] / a["n"], b["correct"] / b["n"]
                    # prompts per arm needed: only meaningful while the difference is unresolved
                    if d.resolvable:
                        need = ""
                    elif paired is not None and paired.kind == "binary":  # the 2x2 table: discordant share, diff
                        n, t = paired.n, paired.table
                        assert t is not None  # kind binary carries its table
                        psi, delta = (t[1] + t[2]) / n, (t[1] - t[2]) / n
                        need = f" n/arm {n_to_resolve_paired(psi, delta)}" if delta else " n/arm inf"
                    elif paired is not None:  # a mean of fractions that cancel can miss 0 by rounding
                        sd = paired.sd
                        assert sd is not None  # kind mean carries its SD
                        need = f" n/arm {n_to_resolve_mean(sd, d.diff)}" if abs(d.diff) > 1e-9 else " n/arm inf"
                    else:
                        need = f" n/arm {n_to_resolve(pa, pb)}" if pa != pb else " n/arm inf"
                    flag = "*" if cmp_.star else ""
                    # p_adj: Holm's, for a tested difference only
                    test = (
                        f" p {_fmt_p(d.p)} adj {_fmt_p(cmp_.p_adj)}"
                        if cmp_.p_adj is not None and d.p is not None
                        else ""
                    )
                    warn = (
                        ("" if paired.kind == "binary" else " paired t")
                        if paired is not None
                        else " indep."
                        if a["digest"] == b["digest"]
                        else " (prompts differ)"
                    )
                    row.append(f"{100 * d.diff:+.1f}{flag} [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]{test}{need}{warn}")
                lines.append(f"| {_label(r)} | " + " | ".join(row) + " |")
            lines.append("")
    return lines


def _ci(c: dict) -> str:
    ci = c.get("ci_pp")
    if ci is None:
        _, lo, hi = wilson(c["correct"], c["n"])
        ci = [100 * lo, 100 * hi]
    return f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def _ruler_tables(results: Sequence[dict], baseline: int, threshold: float) -> list[str]:
    out = []
    for _, title, suite in AVERAGES:
        out += _average_table(results, threshold, title, suite)
    return out


def _average_table(results: Sequence[dict], threshold: float, title: str, suite) -> list[str]:
    avgs = [ruler_average(r["cells"], threshold, suite) for r in results]
    if not any(avgs):
        return []
    lengths = sorted({L for a in avgs if a for L in a["lengths"]})
    lines = [
        f"### {title}",
        "",
        "| arm | tasks | " + " | ".join(str(L) for L in lengths) + " | eff. length |",
        "|---|---|" + "---|" * len(lengths) + "---|",
    ]
    for r, a in zip(results, avgs, strict=True):
        if not a:
            continue
        acc = {x["length"]: x for x in a["by_length"]}
        row = [
            f"{acc[L]['acc_pp']:.1f} [{acc[L]['ci_pp'][0]:.1f}, {acc[L]['ci_pp'][1]:.1f}]" if L in acc else "-"
            for L in lengths
        ]
        lines.append(
            f"| {_label(r)} | {len(a['tasks'])} | " + " | ".join(row) + f" | {_fmt_len(a['effective_length'])} |"
        )
    notes = sorted({t for a in avgs if a for t in a["left_out"]})
    lines += [
        "",
        f"Mean of the suite's tasks present at every length (normal 95% interval from the tasks' binomial "
        f"variances); effective length = longest length whose mean >= {threshold:g}% (RULER's threshold, "
        f"on the average)." + (f" Left out (not at every length): {', '.join(notes)}." if notes else ""),
        "",
    ]
    return lines


def _loss_tables(results: Sequence[dict], baseline: int) -> list[str]:
    return [x for name in loss_set_names(results) for x in _loss_table(results, baseline, name)]


def _loss_table(results: Sequence[dict], baseline: int, name: Optional[str]) -> list[str]:
    have = [r for r in results if loss_section(r, name)]
    if not have:
        return []
    sec = {id(r): loss_section(r, name) or {} for r in results}  # {}: this result has none
    lengths = sorted({c["length"] for r in have for c in sec[id(r)]["by_length"]})
    lines = [
        "### held-out loss" + (f": {name} (eval.loss.sets)" if name else ""),
        "",
        "| arm | " + " | ".join(str(L) for L in lengths) + " | short docs |",
        "|---|" + "---|" * len(lengths) + "---|",
    ]
    for r in have:
        by = {c["length"]: c for c in sec[id(r)]["by_length"]}
        row = [f"{by[L]['loss']:.3f} ({by[L]['tail_loss']:.3f})" if L in by else "-" for L in lengths]
        sh = sec[id(r)].get("short")
        lines.append(
            f"| {_label(r)} | "
            + " | ".join(row)
            + " | "
            + (f"{sh['loss']:.3f} ({sh['n_docs']} docs)" if sh else "-")
            + " |"
        )
    data = sorted({str(sec[id(r)].get("data")) for r in have})
    lines += [
        "",
        f"Validation loss in nats per token on {', '.join(data)} (val split): all positions of n sequences "
        f"of exactly L tokens (in brackets: positions >= L/2 only); short docs: whole val documents "
        f"pooled per token (what the gate compares, as a relative change).",
        "",
    ]
    base = results[baseline]
    if sec[id(base)] and len(have) > 1:
        bb = {c["length"]: c for c in sec[id(base)]["by_length"]}
        lines += [
            f"Relative change to {_label(base)} (short docs: paired 95% interval over the same documents):",
            "",
            "| arm | " + " | ".join(str(L) for L in lengths) + " | short docs |",
            "|---|" + "---|" * len(lengths) + "---|",
        ]
        for r in have:
            if r is base:
                continue
            by = {c["length"]: c for c in sec[id(r)]["by_length"]}
            row = [
                f"{100 * (by[L]['loss'] / bb[L]['loss'] - 1):+.1f}%" if L in by and L in bb else "-" for L in lengths
            ]
            d = short_loss_change(r, base, name)
            ci = f" [{100 * d['ci_rel'][0]:+.1f}, {100 * d['ci_rel'][1]:+.1f}]" if d and d["ci_rel"] else ""
            sh = "-" if d is None else f"{100 * d['rel']:+.1f}%{ci}"
            lines.append(f"| {_label(r)} | " + " | ".join(row) + f" | {sh} |")
        lines.append("")
    return lines


def short_loss_change(res: dict, parent: dict, name: Optional[str] = None) -> Optional[dict]:
    """The arm's short-document loss against the parent's on one held-out set (name None: eval.loss.data; else
    eval.loss.sets[name]): {arm, parent, rel, ci_rel}, or None when either lacks it. ci_rel: a paired t
    interval of the per-document differences over the parent's loss, when both scored the same documents (same
    digest), else None."""
    a = (loss_section(res, name) or {}).get("short")
    b = (loss_section(parent, name) or {}).get("short")
    if not a or not b:
        return None
    out = {
        "arm": a["loss"],
        "parent": b["loss"],
        "rel": a["loss"] / b["loss"] - 1,
        "ci_rel": None,
        "paired": a.get("digest") == b.get("digest"),
    }
    if out["paired"] and len(a["per_doc"]) >= 2:
        from .stats import t_quantile

        # per-token pooled difference = sum_d w_d (l_ad - l_bd), w_d = tokens_d / tokens; its
        # variance from the per-document terms (a ratio estimator around the pooled mean)
        tot = sum(n for n, _ in a["per_doc"])
        terms = [n / tot * (la - lb) for (n, la), (_, lb) in zip(a["per_doc"], b["per_doc"], strict=True)]
        m = sum(terms)
        D = len(terms)
        var = D / (D - 1) * sum((t - m / D) ** 2 for t in terms)
        half = t_quantile(0.95, D - 1) * math.sqrt(var)
        out["ci_rel"] = [(m - half) / b["loss"], (m + half) / b["loss"]]
    return out


def markdown(results: Sequence[dict], *, baseline: int = 0, threshold: float = RULER_THRESHOLD) -> str:
    """Per task: accuracy (arm x length), Wilson intervals, differences to the baseline arm; then
    the RULER average with its effective length, and the held-out loss, when present."""
    lines = _task_tables(results, baseline, threshold)
    lines += _ruler_tables(results, baseline, threshold)
    lines += _loss_tables(results, baseline)
    return "\n".join(lines)
