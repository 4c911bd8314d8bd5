"""Eval results: the step_<N>.json schema, loading runs, markdown tables, the plot.

One result (one arm at one step) is a dict:
  schema, arm, step, window, created_utc, tokenizer, sp, eval (the EvalConfig),
  cells:   [{task, length, n, correct, acc_pp, ci_pp, padded_len, digest, seconds, by_depth,
             all_correct, max_new, prompts_per_s}]
           correct = the sum of the prompts' scores (RULER part credit: fractional for tasks
           with several answers), acc_pp = 100 correct / n, all_correct = prompts with every
           answer; by_depth counts answers (found / n) per depth bin of the context
  summary: {task: {slope: {...}, effective_length, effective_length_contiguous, threshold}}
  ruler:   {lengths, tasks, by_length: [{length, acc_pp, ci_pp}], effective_length}: RULER's
           average over its tasks (ruler_*) present at every length (when any), the effective
           length on that average
  megablu_suite: the same over megablu's RULER-like tasks (niah_*, vt, cwe, fwe; not RULER's)
  loss:    {data, by_length: [{length, n, tokens, loss, ppl, tail_loss, per_seq, digest}],
            short: {range, n_docs, tokens, loss, ppl, per_doc, digest}} with eval.loss.data
  loss_sets: {name: the same as loss} with eval.loss.sets (held-out text besides eval.loss.data)
  samples: [{task, length, index, answer, got, output, correct, score, depth[, answers, found, depths]}]
  gate:    {...} when gated against a parent
Results written before the suite (cells without all_correct, 5 depth bins) load and merge
unchanged.
`compare` tables put arms in rows and lengths in columns, like the seed's hand-off table,
then each arm's difference to a baseline with its 95% interval: paired where both arms scored the same
prompts (Newcombe's for 0/1 scores with McNemar's exact p, a paired t interval and p on part-credit scores),
else Newcombe's for independent samples (with Fisher's exact p for 0/1 scores). '*' = the cell's test
survives Holm's correction over every tested difference of the compare (starred()).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..config.eval_tasks import MEGABLU_SUITE, RULER_SUITE
from .prompts import EvalError, Prompt, prompt_digest
from .stats import (
    RULER_THRESHOLD,
    Difference,
    effective_length,
    effective_length_contiguous,
    fisher_exact_p,
    holm,
    mean_interval,
    n_to_resolve,
    n_to_resolve_mean,
    n_to_resolve_paired,
    newcombe,
    newcombe_paired,
    paired_mean_diff,
    slope_per_doubling,
    wilson,
)

SCHEMA = "megablu.eval/1"
DEPTH_BINS = 10
STAR_ALPHA = 0.05       # family-wise error rate of a compare's stars (Holm)


def cell(task: str, length: int, samples: list[dict], eval_cfg, prompts: Sequence[Prompt], seconds: float) -> dict:
    """One (task, length): mean score with its Wilson interval (see stats.wilson on part credit)."""
    from ..config.schema import eval_padded_len

    n = len(samples)
    k = sum(s.get("score", float(s["correct"])) for s in samples)
    k = int(k) if float(k).is_integer() else round(k, 6)
    p, lo, hi = wilson(k, n)
    bins = [[0, 0] for _ in range(DEPTH_BINS)]
    for s in samples:
        pairs = zip(s["depths"], s["found"]) if "depths" in s else [(s["depth"], s["correct"])]
        for d, ok in pairs:
            if d is None:
                continue
            b = bins[min(int(d * DEPTH_BINS), DEPTH_BINS - 1)]
            b[0] += 1
            b[1] += bool(ok)
    max_new = eval_cfg.task_max_new(task) if task in eval_cfg.tasks else eval_cfg.max_new
    return {"task": task, "length": length, "n": n, "correct": k, "acc_pp": 100 * p, "ci_pp": [100 * lo, 100 * hi],
            "all_correct": sum(bool(s["correct"]) for s in samples), "max_new": max_new,
            "padded_len": eval_padded_len(eval_cfg.task_prompt_len(task, length) if task in eval_cfg.tasks else length,
                                          max_new, eval_cfg.pad),
            "digest": prompt_digest(prompts), "seconds": round(seconds, 3),
            "prompts_per_s": round(n / seconds, 3) if seconds > 0 else None,
            "by_depth": [{"depth": [i / DEPTH_BINS, (i + 1) / DEPTH_BINS], "n": b[0], "correct": b[1]}
                         for i, b in enumerate(bins)] if any(b[0] for b in bins) else []}


def summarize(cells: list[dict], threshold: float = RULER_THRESHOLD) -> dict:
    out = {}
    for task in dict.fromkeys(c["task"] for c in cells):
        cs = sorted((c for c in cells if c["task"] == task), key=lambda c: c["length"])
        acc = {c["length"]: c["acc_pp"] for c in cs}
        s = None
        if len(cs) >= 2:
            s = slope_per_doubling([c["length"] for c in cs], [c["correct"] for c in cs],
                                   [c["n"] for c in cs]).as_dict()
        out[task] = {"slope": s, "threshold": threshold, "effective_length": effective_length(acc, threshold),
                     "effective_length_contiguous": effective_length_contiguous(acc, threshold)}
    return out


# the averages a report shows: (result key, title, tasks); RULER's only over RULER's own tasks (ruler_*)
AVERAGES = (("ruler", "RULER average", RULER_SUITE),
            ("megablu_suite", "megablu suite average (RULER-like tasks, not comparable to RULER)", MEGABLU_SUITE))


def ruler_average(cells: list[dict], threshold: float = RULER_THRESHOLD,
                  suite: Sequence[str] = RULER_SUITE) -> Optional[dict]:
    """RULER's headline: the mean accuracy over the suite's tasks at each length, and the
    effective length on that mean (the threshold applies to the average, never per task). Only
    tasks present at every length of the result count (an average over different task sets would
    not be comparable across lengths); None when no suite task is there. The interval is
    stats.mean_interval over the tasks' cells. suite=MEGABLU_SUITE: the same for megablu's
    RULER-like tasks (its own average)."""
    by = {}
    for c in cells:
        if c["task"] in suite:
            by.setdefault(c["task"], {})[c["length"]] = c
    if not by:
        return None
    lengths = sorted({L for cs in by.values() for L in cs})
    tasks = [t for t in suite if t in by and all(L in by[t] for L in lengths)]
    if not tasks:
        return None
    rows = []
    for L in lengths:
        m, lo, hi = mean_interval([(by[t][L]["correct"], by[t][L]["n"]) for t in tasks])
        rows.append({"length": L, "acc_pp": 100 * m, "ci_pp": [100 * lo, 100 * hi]})
    acc = {r["length"]: r["acc_pp"] for r in rows}
    return {"tasks": tasks, "lengths": lengths, "by_length": rows, "threshold": threshold,
            "effective_length": effective_length(acc, threshold),
            "effective_length_contiguous": effective_length_contiguous(acc, threshold),
            "left_out": sorted(set(by) - set(tasks))}


def make_result(cells, samples, *, arm: str, step: int, window: int, eval_cfg, tokenizer_identity: str, sp: int,
                extra: Optional[dict] = None, threshold: float = RULER_THRESHOLD) -> dict:
    if not cells or not samples:
        raise EvalError("no scored prompts: refusing to make an empty eval result")
    res = {"schema": SCHEMA, "arm": arm, "step": step, "window": window,
           "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "tokenizer": tokenizer_identity, "sp": sp, "eval": eval_cfg.model_dump(mode="json"),
           "cells": cells, "summary": summarize(cells, threshold),
           **{key: ruler_average(cells, threshold, suite) for key, _, suite in AVERAGES},
           "samples": samples, "gate": None}
    res.update(extra or {})
    return res


def write_result(res: dict, path: Path) -> Path:
    """Atomic write (tmp + rename): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)
    return path


def _validate(res: dict, src: str) -> dict:
    if res.get("schema") != SCHEMA:
        raise EvalError(f"{src}: not a megablu eval result (schema {res.get('schema')!r}, expected {SCHEMA!r})")
    if not res.get("cells"):
        raise EvalError(f"{src}: eval result has no cells (an empty report is never valid)")
    return res


def find_results(run_or_json: str | Path) -> list[Path]:
    """All step_<N>.json of a run dir (or of its eval/ dir), sorted by step; a json path as is."""
    p = Path(run_or_json)
    if p.is_file():
        return [p]
    for d in (p / "eval", p):
        if d.is_dir():
            files = [f for f in d.glob("step_*.json") if re.fullmatch(r"step_\d+\.json", f.name)]
            if files:
                return sorted(files, key=lambda f: int(f.stem.split("_")[1]))
    raise EvalError(f"{run_or_json}: no eval results (expected a step_<N>.json, or a run dir with eval/step_<N>.json)")


def load_result(spec: str | Path) -> dict:
    """A result from a json path, a run dir (its latest step), or 'RUN_DIR@STEP'."""
    spec = str(spec)
    step = None
    m = re.fullmatch(r"(.+)@(\d+)", spec)
    if m and not Path(spec).exists():
        spec, step = m.group(1), int(m.group(2))
    files = find_results(spec)
    if step is not None:
        files = [f for f in files if f.name == f"step_{step}.json"]
        if not files:
            raise EvalError(f"{spec}: no eval/step_{step}.json")
    path = files[-1]
    try:
        res = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EvalError(f"{path}: unreadable eval result ({e})") from None
    res = _validate(res, str(path))
    res.setdefault("_path", str(path))
    return res


# What a result measured, besides its prompts: the weights (harness.weights_fingerprint, where the eval
# recorded it), the architecture, the rope the eval ran (a --rope-override'n rope included), the
# inference-time settings (STRING) and the tokenizer. Two results that differ in any of these scored two
# different models: they never share a compare row, and an eval never merges cells into the other's file.
IDENTITY = ("weights", "model", "rope", "string", "tokenizer")
# And what decides the prompts and the scoring of a (task, length) besides the task's name and length.
_EVAL_NOT_IDENTITY = ("lengths", "tasks", "suite", "at_steps", "final", "gate", "loss", "string")


def identity(res: dict) -> dict:
    """The model a result scored (IDENTITY); None = not recorded (results of older versions, or an eval that
    could not fingerprint its weights), which matches any value."""
    return {"weights": res.get("weights"), "model": res.get("model"), "rope": res.get("rope"),
            "string": string_setting(res) or ("off" if "eval" in res else None), "tokenizer": res.get("tokenizer")}


def identity_differences(a: dict, b: dict, with_eval: bool = False) -> list[str]:
    """Fields of identity() (and with_eval, the eval settings that decide the prompts) where two results
    differ, both recorded; [] when they may share a row (or a file)."""
    ia, ib = identity(a), identity(b)
    out = [f for f in IDENTITY if ia[f] is not None and ib[f] is not None and ia[f] != ib[f]]
    if with_eval:
        ea, eb = ({k: v for k, v in (r.get("eval") or {}).items() if k not in _EVAL_NOT_IDENTITY} for r in (a, b))
        out += [f"eval.{k}" for k in sorted(set(ea) | set(eb)) if k in ea and k in eb and ea[k] != eb[k]]
    return out


def _identity_note(res: dict, fields: list[str]) -> str:
    """A short label of what tells `res` apart from the other results of its arm@step (fields differ)."""
    parts = []
    if "rope" in fields:
        r = res.get("rope") or {}
        y = r.get("yarn")
        parts.append(f"rope theta {r.get('theta'):g}" + (f" yarn x{y['factor']:g}" if y else " plain")
                     if r else "rope ?")
    if "weights" in fields:
        parts.append(f"weights {res['weights'][:8]}")
    parts += [f for f in fields if f not in ("rope", "weights", "string")]   # string: _label shows it already
    return ", ".join(parts)


def merge_results(results: Sequence[dict]) -> list[dict]:
    """One result per arm@step and identity: cells measured in separate runs (e.g. one length per job) are
    joined; results of the same arm@step that scored different models (identity_differences: other weights,
    another rope, STRING, another tokenizer) stay separate rows, labelled by what differs.

    The same (task, length) twice for one arm@step and identity is an error unless identical."""
    merged: dict[tuple, dict] = {}
    for r in results:
        key = next((k for k in merged if k[:2] == (r["arm"], r["step"])
                    and not identity_differences(merged[k], r)), None)
        if key is None:
            key = (r["arm"], r["step"], len(merged))
            merged[key] = {**r, "cells": list(r["cells"]), "samples": list(r.get("samples", []))}
            continue
        m = merged[key]
        have = {(c["task"], c["length"]): c for c in m["cells"]}
        for c in r["cells"]:
            old = have.get((c["task"], c["length"]))
            if old is not None and old != c:
                raise EvalError(f"{r['arm']}@{r['step']}: two different results for {c['task']}@{c['length']} "
                                f"({m.get('_path')} and {r.get('_path')})")
            if old is None:
                m["cells"].append(c)
        m["samples"] += r.get("samples", [])
        if r.get("loss"):   # held-out loss measured per length in separate runs: join its lengths too
            m["loss"] = _join_loss(m.get("loss"), r["loss"])
        for name, sec in (r.get("loss_sets") or {}).items():
            m["loss_sets"] = {**(m.get("loss_sets") or {}), name: _join_loss((m.get("loss_sets") or {}).get(name), sec)}
    for m in merged.values():
        m["cells"].sort(key=lambda c: (c["task"], c["length"]))
        twins = [o for o in merged.values() if o is not m and (o["arm"], o["step"]) == (m["arm"], m["step"])]
        if twins:
            m["_identity_note"] = _identity_note(m, sorted({f for o in twins for f in identity_differences(m, o)}))
    return list(merged.values())


def _join_loss(have: Optional[dict], new: dict) -> dict:
    """A held-out set's section `have` with `new`'s lengths it lacks (and its short documents when it has none)."""
    lo = have or {"data": new.get("data"), "by_length": [], "short": None}
    lengths = {c["length"] for c in lo["by_length"]}
    by = lo["by_length"] + [c for c in new["by_length"] if c["length"] not in lengths]
    return {**lo, "by_length": sorted(by, key=lambda c: c["length"]), "short": lo.get("short") or new.get("short")}


def loss_section(res: dict, name: Optional[str] = None) -> Optional[dict]:
    """A result's held-out loss on one set: eval.loss.data's (name None) or eval.loss.sets[name]'s; None if absent."""
    return res.get("loss") if name is None else (res.get("loss_sets") or {}).get(name)


def loss_set_names(results: Sequence[dict]) -> list:
    """The held-out sets any of the results measured: None (eval.loss.data) first, then the named ones."""
    named = sorted({k for r in results for k in (r.get("loss_sets") or {})})
    return ([None] if any(r.get("loss") for r in results) else []) + named


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
        if len(out_a) == len(out_b) == cell_a["n"] and out_a.keys() == out_b.keys() and None not in out_a \
                and None not in scores:
            if all(x in (0.0, 1.0) for x in scores):
                t = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
                for i in out_a:
                    t[(out_a[i] == 1.0, out_b[i] == 1.0)] += 1
                table = (t[(True, True)], t[(True, False)], t[(False, True)], t[(False, False)])
                return newcombe_paired(*table), Pairing("binary", cell_a["n"], table=table)
            d = [out_a[i] - out_b[i] for i in out_a]
            return paired_mean_diff(d), Pairing("mean", len(d), sd=statistics.stdev(d) if len(d) > 1 else 0.0)
    d = newcombe(cell_a["correct"], cell_a["n"], cell_b["correct"], cell_b["n"])
    if _binary(cell_a) and _binary(cell_b):           # 0/1 scores: Fisher's exact test beside the interval
        d = dataclasses.replace(d, p=fisher_exact_p(int(cell_a["correct"]), cell_a["n"],
                                                    int(cell_b["correct"]), cell_b["n"]))
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
    family = [k for k, (d, _) in out.items() if d.p is not None]
    adj = dict(zip(family, holm([out[k][0].p for k in family])))
    return {k: Compared(d, paired, adj.get(k)) for k, (d, paired) in out.items()}


def _fmt_p(p: float) -> str:
    return f"{p:.2g}"


# eval.string's fields at what results written before them ran: STRING at every length (beyond 0), megablu's fixed
# shift without a factor (the variant field came with the authors' variant, now the default)
_STRING_BEFORE = {"beyond": 0, "variant": "fixed_shift", "shift_ratio": None, "attention_factor": 1.0}


def string_setting(res: dict) -> Optional[dict]:
    """A result's eval.string, with the fields results written before they existed at the values those results
    ran (_STRING_BEFORE), so equal settings compare equal across versions and the two variants never do."""
    st = (res.get("eval") or {}).get("string")
    return {**_STRING_BEFORE, **st} if st else None


def cells_by(res: dict, task: str) -> dict[int, dict]:
    return {c["length"]: c for c in res["cells"] if c["task"] == task}


def _label(res: dict) -> str:
    """arm@step, and the eval-time STRING setting when the result used one (it is part of the arm)."""
    st = string_setting(res)
    note = res.get("_identity_note")
    base = f"{res['arm']}@{res['step']}" + (f" [{note}]" if note else "")
    if not st:
        return base
    # the authors' S follows the length (S=0.33L); megablu's fixed shift keeps its label (S in tokens)
    s = f"authors,S={st['shift_ratio']:g}L" if st["variant"] == "authors" else f"S={st['shift']}"
    s += f",W={st['local']}" + (f",af={st['attention_factor']:.4g}" if st["attention_factor"] != 1 else "") \
        + (f",>{st['beyond']}" if st["beyond"] else "")
    return f"{base} +string({s})"


def _fmt_len(L: Optional[int]) -> str:
    return "-" if L is None else str(L)


def _task_tables(results: Sequence[dict], baseline: int, threshold: float) -> list[str]:
    """Per task: accuracy table (arm x length), Wilson intervals, then differences to the baseline arm, starred
    over the whole compare (starred())."""
    tasks = list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    diffs = starred(results, baseline) if len(results) > 1 else {}
    n_family = sum(c.p_adj is not None for c in diffs.values())
    lines = []
    for task in tasks:
        lengths = sorted({c["length"] for r in results for c in r["cells"] if c["task"] == task})
        lines += [f"### {task}", "",
                  "| arm | " + " | ".join(str(L) for L in lengths) + " | pp/doubling [95%] | eff. length |",
                  "|---|" + "---|" * len(lengths) + "---|---|"]
        for r in results:
            cs = cells_by(r, task)
            row = [f"{cs[L]['acc_pp']:.1f}" if L in cs else "-" for L in lengths]
            summ = summarize([c for c in r["cells"] if c["task"] == task], threshold).get(task) \
                or {"slope": None, "effective_length": None}    # an arm without this task: a row of '-'
            s = summ["slope"]
            sl = f"{s['pp_per_doubling']:+.1f} [{s['ci_pp'][0]:+.1f}, {s['ci_pp'][1]:+.1f}]" if s else "-"
            lines.append(f"| {_label(r)} | " + " | ".join(row) + f" | {sl} | {_fmt_len(summ['effective_length'])} |")
        ns = sorted({c["n"] for r in results for c in r["cells"] if c["task"] == task})
        part = any("all_correct" in c and c["all_correct"] != c["correct"]
                   for r in results for c in r["cells"] if c["task"] == task)
        lines += ["", f"n per cell: {', '.join(map(str, ns))}; accuracy in % (" + ("mean part-credit score, RULER's "
                      "string_match_all" if part else "exact") + f"); effective length = longest length >= "
                      f"{threshold:g}%. Wilson 95% intervals:", "",
                  "| arm | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for r in results:
            cs = cells_by(r, task)
            row = [_ci(cs[L]) if L in cs else "-" for L in lengths]
            lines.append(f"| {_label(r)} | " + " | ".join(row) + " |")
        lines.append("")
        if len(results) > 1:
            base = results[baseline]
            lines += [f"Difference to {_label(base)} in pp, 95% interval: where both arms scored the same "
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
                      "| arm | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---|" * len(lengths)]
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
                    elif paired is not None and paired.kind == "binary":   # the 2x2 table: discordant share, diff
                        n, t = paired.n, paired.table
                        psi, delta = (t[1] + t[2]) / n, (t[1] - t[2]) / n
                        need = f" n/arm {n_to_resolve_paired(psi, delta)}" if delta else " n/arm inf"
                    elif paired is not None:   # a mean of fractions that cancel can miss 0 by rounding
                        need = f" n/arm {n_to_resolve_mean(paired.sd, d.diff)}" if abs(d.diff) > 1e-9 else " n/arm inf"
                    else:
                        need = f" n/arm {n_to_resolve(pa, pb)}" if pa != pb else " n/arm inf"
                    flag = "*" if cmp_.star else ""
                    test = f" p {_fmt_p(d.p)} adj {_fmt_p(cmp_.p_adj)}" if cmp_.p_adj is not None else ""
                    warn = ("" if paired.kind == "binary" else " paired t") if paired is not None else \
                        " indep." if a["digest"] == b["digest"] else " (prompts differ)"
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
    lines = [f"### {title}", "",
             "| arm | tasks | " + " | ".join(str(L) for L in lengths) + " | eff. length |",
             "|---|---|" + "---|" * len(lengths) + "---|"]
    for r, a in zip(results, avgs):
        if not a:
            continue
        acc = {x["length"]: x for x in a["by_length"]}
        row = [f"{acc[L]['acc_pp']:.1f} [{acc[L]['ci_pp'][0]:.1f}, {acc[L]['ci_pp'][1]:.1f}]" if L in acc else "-"
               for L in lengths]
        lines.append(f"| {_label(r)} | {len(a['tasks'])} | " + " | ".join(row)
                     + f" | {_fmt_len(a['effective_length'])} |")
    notes = sorted({t for a in avgs if a for t in a["left_out"]})
    lines += ["", f"Mean of the suite's tasks present at every length (normal 95% interval from the tasks' binomial "
                  f"variances); effective length = longest length whose mean >= {threshold:g}% (RULER's threshold, "
                  f"on the average)."
              + (f" Left out (not at every length): {', '.join(notes)}." if notes else ""), ""]
    return lines


def _loss_tables(results: Sequence[dict], baseline: int) -> list[str]:
    return [x for name in loss_set_names(results) for x in _loss_table(results, baseline, name)]


def _loss_table(results: Sequence[dict], baseline: int, name: Optional[str]) -> list[str]:
    have = [r for r in results if loss_section(r, name)]
    if not have:
        return []
    sec = {id(r): loss_section(r, name) for r in results}
    lengths = sorted({c["length"] for r in have for c in sec[id(r)]["by_length"]})
    lines = ["### held-out loss" + (f": {name} (eval.loss.sets)" if name else ""), "",
             "| arm | " + " | ".join(str(L) for L in lengths) + " | short docs |",
             "|---|" + "---|" * len(lengths) + "---|"]
    for r in have:
        by = {c["length"]: c for c in sec[id(r)]["by_length"]}
        row = [f"{by[L]['loss']:.3f} ({by[L]['tail_loss']:.3f})" if L in by else "-" for L in lengths]
        sh = sec[id(r)].get("short")
        lines.append(f"| {_label(r)} | " + " | ".join(row) + " | "
                     + (f"{sh['loss']:.3f} ({sh['n_docs']} docs)" if sh else "-") + " |")
    data = sorted({str(sec[id(r)].get("data")) for r in have})
    lines += ["", f"Validation loss in nats per token on {', '.join(data)} (val split): all positions of n sequences "
                  f"of exactly L tokens (in brackets: positions >= L/2 only); short docs: whole val documents "
                  f"pooled per token (what the gate compares, as a relative change).", ""]
    base = results[baseline]
    if sec[id(base)] and len(have) > 1:
        bb = {c["length"]: c for c in sec[id(base)]["by_length"]}
        lines += [f"Relative change to {_label(base)} (short docs: paired 95% interval over the same documents):", "",
                  "| arm | " + " | ".join(str(L) for L in lengths) + " | short docs |",
                  "|---|" + "---|" * len(lengths) + "---|"]
        for r in have:
            if r is base:
                continue
            by = {c["length"]: c for c in sec[id(r)]["by_length"]}
            row = [f"{100 * (by[L]['loss'] / bb[L]['loss'] - 1):+.1f}%" if L in by and L in bb else "-"
                   for L in lengths]
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
    out = {"arm": a["loss"], "parent": b["loss"], "rel": a["loss"] / b["loss"] - 1, "ci_rel": None,
           "paired": a.get("digest") == b.get("digest")}
    if out["paired"] and len(a["per_doc"]) >= 2:
        from .stats import t_quantile

        # per-token pooled difference = sum_d w_d (l_ad - l_bd), w_d = tokens_d / tokens; its
        # variance from the per-document terms (a ratio estimator around the pooled mean)
        tot = sum(n for n, _ in a["per_doc"])
        terms = [n / tot * (la - lb) for (n, la), (_, lb) in zip(a["per_doc"], b["per_doc"])]
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


def _mpl():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise EvalError(f"plotting needs matplotlib (pip install matplotlib): {e}") from None
    return plt


_MARKERS = "osD^vP*X<>"
_STYLES = ("-", "--", "-.", ":")


def _offsets(k: int, step: float = 0.06) -> list[float]:
    """x offsets (log2 units) that set k arms side by side at one length, so none hides another."""
    return [(j - (k - 1) / 2) * step for j in range(k)]


def panel_x(lengths_by_arm: dict[int, list[int]]) -> dict[int, list[float]]:
    """x of each point in one panel: log2(length) plus a sideways offset shared out among the arms
    that have points in this panel only (a panel where 2 of 9 arms have cells sets those 2 side by
    side at the length, not at the two ends of nine arms' spread)."""
    offs = _offsets(len(lengths_by_arm))
    return {j: [math.log2(L) + o for L in Ls] for (j, Ls), o in zip(lengths_by_arm.items(), offs)}


def panel_xlim(lengths: Sequence[int], k: int) -> tuple[float, float]:
    """x limits around a panel's lengths (log2) with room for k arms' offsets, at least half a
    doubling each side, so a one-length panel has its points over its tick, centred."""
    pad = max(0.5, abs(_offsets(k)[0]) + 0.25) if k else 0.5
    return math.log2(lengths[0]) - pad, math.log2(lengths[-1]) + pad


def _n_note(cells: list[dict]) -> Optional[str]:
    ns = sorted({c["n"] for c in cells})
    return f"n={ns[0]} per cell" if len(ns) == 1 else None


def plot(results: Sequence[dict], path: Path, task: Optional[str] = None) -> Path:
    """Accuracy vs log2(length), one line per arm (offset sideways, own marker and dash), Wilson
    95% bands; the RULER threshold line labelled; n per cell in the title (or at each point when
    it varies). Panels: each task, the RULER average, the held-out loss. matplotlib imported here."""
    plt = _mpl()
    tasks = [task] if task else list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    have = [(t, s) for _, t, s in AVERAGES if any(ruler_average(r["cells"], suite=s) for r in results)]
    avg_title, avg_suite = have[0] if have else AVERAGES[0][1:]
    avgs = [ruler_average(r["cells"], suite=avg_suite) for r in results] if not task else [None] * len(results)
    panels = [("task", t) for t in tasks] + ([("ruler", None)] if any(avgs) else []) \
        + ([("loss", None)] if not task and any(r.get("loss") for r in results) else [])
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax, (kind, t) in zip(axes.flat, panels):
        series = {}                       # arm index -> its points in this panel
        for j, r in enumerate(results):
            if kind == "task":
                pts = [(c["length"], c["acc_pp"], c["ci_pp"][0], c["ci_pp"][1], c["n"])
                       for c in sorted(cells_by(r, t).values(), key=lambda c: c["length"])]
            elif kind == "ruler":
                a = avgs[j]
                pts = [(x["length"], x["acc_pp"], x["ci_pp"][0], x["ci_pp"][1], None)
                       for x in (a["by_length"] if a else [])]
            else:
                lo = r.get("loss") or {}
                pts = [(c["length"], c["loss"], c["loss"], c["loss"], c["n"]) for c in lo.get("by_length", [])]
            if pts:
                series[j] = pts
        xs = panel_x({j: [p[0] for p in pts] for j, pts in series.items()})
        lengths = {p[0] for pts in series.values() for p in pts}
        for j, pts in series.items():
            r, x = results[j], xs[j]
            sty = dict(marker=_MARKERS[j % len(_MARKERS)], ls=_STYLES[j % len(_STYLES)], label=_label(r), ms=5)
            line, = ax.plot(x, [p[1] for p in pts], **sty)
            if kind != "loss":
                ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], alpha=0.15, color=line.get_color())
            if kind == "task" and _n_note([cells_by(r, t)[p[0]] for p in pts]) is None:
                for xi, p in zip(x, pts):
                    ax.annotate(f"n={p[4]}", (xi, p[1]), fontsize=6, xytext=(2, 3), textcoords="offset points")
        if lengths:
            ax.set_xlim(*panel_xlim(sorted(lengths), len(series)))
        ls = sorted(lengths)
        ax.set_xticks([math.log2(L) for L in ls], [str(L) for L in ls], rotation=30)
        ax.set_xlabel("prompt length (tokens, log2 axis)")
        if kind == "loss":
            ax.set_ylabel("validation loss (nats/token)")
            ax.set_title("held-out loss per length")
        else:
            ax.axhline(RULER_THRESHOLD, ls="--", lw=0.8, color="grey")
            ax.annotate(f"RULER threshold {RULER_THRESHOLD:g}%", (0.01, RULER_THRESHOLD), xycoords=("axes fraction",
                        "data"), fontsize=7, color="grey", xytext=(0, 2), textcoords="offset points")
            ax.set_ylim(-2, 102)
            ax.set_ylabel("accuracy (%), 95% band")
            cs = [c for r in results for c in r["cells"] if kind == "task" and c["task"] == t]
            note = _n_note(cs) if kind == "task" else "mean over tasks"
            ax.set_title(f"{t if kind == 'task' else avg_title.split(' (')[0]}" + (f" ({note})" if note else ""))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmap(results: Sequence[dict], path: Path, task: str) -> Optional[Path]:
    """Depth x length heatmap of one task, one panel per arm: the fraction of answers found per
    depth bin of the context (rows) at each length (columns), the count of answers in each box.
    None when no arm has depth bins for the task (cwe/fwe have no needle depth)."""
    have = [(r, sorted(cells_by(r, task).values(), key=lambda c: c["length"])) for r in results]
    have = [(r, cs) for r, cs in have if any(c.get("by_depth") for c in cs)]
    if not have:
        return None
    plt = _mpl()
    import matplotlib.colors as mcolors

    w = 1.0 * max(len(cs) for _, cs in have) + 1.2
    fig, axes = plt.subplots(1, len(have), figsize=(w * len(have) + 1.8, 4.4), squeeze=False, layout="constrained")
    norm, cmap = mcolors.Normalize(0, 100), plt.get_cmap("RdYlGn")
    for ax, (r, cs) in zip(axes[0], have):
        for xi, c in enumerate(cs):
            for b in c.get("by_depth") or []:
                lo, hi = b["depth"]
                if b["n"] == 0:
                    ax.add_patch(plt.Rectangle((xi, lo), 1, hi - lo, color="lightgrey"))
                    continue
                acc = 100 * b["correct"] / b["n"]
                ax.add_patch(plt.Rectangle((xi, lo), 1, hi - lo, color=cmap(norm(acc))))
                if hi - lo >= 0.05:
                    ax.text(xi + 0.5, (lo + hi) / 2, f"{acc:.0f}\n({b['n']})", ha="center", va="center", fontsize=6)
        ax.set_xlim(0, len(cs))
        ax.set_ylim(1, 0)   # depth 0 (start of the context) at the top
        ax.set_xticks([i + 0.5 for i in range(len(cs))], [str(c["length"]) for c in cs], rotation=30)
        ax.set_xlabel("prompt length (tokens)")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth in the context (0 = start)")
        ax.set_title(f"{task}: {_label(r)}", fontsize=9)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=list(axes[0]), label="answers found (%), (count)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmaps(results: Sequence[dict], prefix: Path) -> list[Path]:
    """<prefix>_<task>.png for every task with depth bins."""
    tasks = list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    out = [heatmap(results, Path(f"{prefix}_{t}.png"), t) for t in tasks]
    return [p for p in out if p]


def write_artifacts(res: dict, out_dir: Path, step: int, plot: bool = True) -> list[Path]:
    """step_<N>.md (the tables), step_<N>.png (the plot) and step_<N>_depth_<task>.png (the depth x
    length heatmap of each task with needles) beside the json.

    The json is the result; a missing matplotlib costs only the picture (logged), never the eval."""
    import logging

    out_dir = Path(out_dir)
    md = out_dir / f"step_{step}.md"
    md.write_text(markdown([res]) + "\n")
    written = [md]
    if not plot:
        return written
    try:
        written.append(_plot([res], out_dir / f"step_{step}.png"))
        written += heatmaps([res], out_dir / f"step_{step}_depth")
    except EvalError as e:
        logging.getLogger(__name__).warning("no plot for step %d: %s", step, e)
    return written


_plot = plot
