"""Eval results: the step_<N>.json schema, loading runs, markdown tables, the plot.

One result (one arm at one step) is a dict:
  schema, arm, step, window, created_utc, tokenizer, sp, eval (the EvalConfig),
  cells:   [{task, length, n, correct, acc_pp, ci_pp, padded_len, digest, seconds, by_depth}]
  summary: {task: {slope: {...}, effective_length, effective_length_contiguous, threshold}}
  samples: [{task, length, index, answer, got, output, correct, depth}]
  gate:    {...} when gated against a parent
`compare` tables put arms in rows and lengths in columns, like the seed's hand-off table,
then each arm's difference to a baseline with Newcombe intervals ('*' = resolvable).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from pathlib import Path
from typing import Optional, Sequence

from .prompts import EvalError, Prompt, prompt_digest
from .stats import (RULER_THRESHOLD, effective_length, effective_length_contiguous, n_to_resolve, newcombe,
                    slope_per_doubling, wilson)

SCHEMA = "megablu.eval/1"
DEPTH_BINS = 5


def cell(task: str, length: int, samples: list[dict], eval_cfg, prompts: Sequence[Prompt], seconds: float) -> dict:
    from ..config.schema import eval_padded_len

    n = len(samples)
    k = sum(s["correct"] for s in samples)
    p, lo, hi = wilson(k, n)
    bins = [[0, 0] for _ in range(DEPTH_BINS)]
    for s in samples:
        b = bins[min(int(s["depth"] * DEPTH_BINS), DEPTH_BINS - 1)]
        b[0] += 1
        b[1] += s["correct"]
    return {"task": task, "length": length, "n": n, "correct": k, "acc_pp": 100 * p, "ci_pp": [100 * lo, 100 * hi],
            "padded_len": eval_padded_len(length, eval_cfg.max_new, eval_cfg.pad),
            "digest": prompt_digest(prompts), "seconds": round(seconds, 3),
            "by_depth": [{"depth": [i / DEPTH_BINS, (i + 1) / DEPTH_BINS], "n": b[0], "correct": b[1]}
                         for i, b in enumerate(bins)]}


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


def make_result(cells, samples, *, arm: str, step: int, window: int, eval_cfg, tokenizer_identity: str, sp: int,
                extra: Optional[dict] = None, threshold: float = RULER_THRESHOLD) -> dict:
    if not cells or not samples:
        raise EvalError("no scored prompts: refusing to make an empty eval result")
    res = {"schema": SCHEMA, "arm": arm, "step": step, "window": window,
           "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "tokenizer": tokenizer_identity, "sp": sp, "eval": eval_cfg.model_dump(mode="json"),
           "cells": cells, "summary": summarize(cells, threshold), "samples": samples, "gate": None}
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


def merge_results(results: Sequence[dict]) -> list[dict]:
    """One result per arm@step: cells measured in separate runs (e.g. one length per job) are joined.

    The same (task, length) twice for one arm@step is an error unless identical."""
    merged: dict[tuple, dict] = {}
    for r in results:
        key = (r["arm"], r["step"])
        if key not in merged:
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
    for m in merged.values():
        m["cells"].sort(key=lambda c: (c["task"], c["length"]))
    return list(merged.values())


def cells_by(res: dict, task: str) -> dict[int, dict]:
    return {c["length"]: c for c in res["cells"] if c["task"] == task}


def _label(res: dict) -> str:
    return f"{res['arm']}@{res['step']}"


def _fmt_len(L: Optional[int]) -> str:
    return "-" if L is None else str(L)


def markdown(results: Sequence[dict], *, baseline: int = 0, threshold: float = RULER_THRESHOLD) -> str:
    """Per task: accuracy table (arm x length), then differences to the baseline arm."""
    tasks = list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    lines = []
    for task in tasks:
        lengths = sorted({c["length"] for r in results for c in r["cells"] if c["task"] == task})
        lines += [f"### {task}", "",
                  "| arm | " + " | ".join(str(L) for L in lengths) + " | pp/doubling [95%] | eff. length |",
                  "|---|" + "---|" * len(lengths) + "---|---|"]
        for r in results:
            cs = cells_by(r, task)
            row = [f"{cs[L]['acc_pp']:.1f}" if L in cs else "-" for L in lengths]
            summ = summarize([c for c in r["cells"] if c["task"] == task], threshold)[task]
            s = summ["slope"]
            sl = f"{s['pp_per_doubling']:+.1f} [{s['ci_pp'][0]:+.1f}, {s['ci_pp'][1]:+.1f}]" if s else "-"
            lines.append(f"| {_label(r)} | " + " | ".join(row) + f" | {sl} | {_fmt_len(summ['effective_length'])} |")
        ns = sorted({c["n"] for r in results for c in r["cells"] if c["task"] == task})
        lines += ["", f"n per cell: {', '.join(map(str, ns))}; accuracy in %; effective length = longest length "
                      f">= {threshold:g}%.", ""]
        if len(results) > 1:
            base = results[baseline]
            bc = cells_by(base, task)
            lines += [f"Difference to {_label(base)} in pp, Newcombe 95% interval; * = resolvable; "
                      f"n/arm (unresolved cells) = prompts per arm to resolve the observed difference at 80% "
                      f"power:", "",
                      "| arm | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---|" * len(lengths)]
            for j, r in enumerate(results):
                if j == baseline:
                    continue
                cs, row = cells_by(r, task), []
                for L in lengths:
                    if L not in cs or L not in bc:
                        row.append("-")
                        continue
                    a, b = cs[L], bc[L]
                    d = newcombe(a["correct"], a["n"], b["correct"], b["n"])
                    pa, pb = a["correct"] / a["n"], b["correct"] / b["n"]
                    # prompts per arm needed: only meaningful while the difference is unresolved
                    need = "" if d.resolvable else (f" n/arm {n_to_resolve(pa, pb)}" if pa != pb else " n/arm inf")
                    flag = "*" if d.resolvable else ""
                    warn = "" if a["digest"] == b["digest"] else " (prompts differ)"
                    row.append(f"{100 * d.diff:+.1f}{flag} [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]{need}{warn}")
                lines.append(f"| {_label(r)} | " + " | ".join(row) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(results: Sequence[dict], path: Path, task: Optional[str] = None) -> Path:
    """Accuracy vs log2(length), one line per arm, Wilson 95% bands. matplotlib is imported here only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise EvalError(f"plotting needs matplotlib (pip install matplotlib): {e}") from None
    tasks = [task] if task else list(dict.fromkeys(c["task"] for r in results for c in r["cells"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for r in results:
            cs = sorted(cells_by(r, t).values(), key=lambda c: c["length"])
            if not cs:
                continue
            x = [math.log2(c["length"]) for c in cs]
            line, = ax.plot(x, [c["acc_pp"] for c in cs], marker="o", label=_label(r))
            ax.fill_between(x, [c["ci_pp"][0] for c in cs], [c["ci_pp"][1] for c in cs], alpha=0.2,
                            color=line.get_color())
        ax.axhline(RULER_THRESHOLD, ls="--", lw=0.8, color="grey")
        lengths = sorted({c["length"] for r in results for c in r["cells"] if c["task"] == t})
        ax.set_xticks([math.log2(L) for L in lengths], [str(L) for L in lengths], rotation=30)
        ax.set_ylim(-2, 102)
        ax.set_xlabel("prompt length (tokens, log2 axis)")
        ax.set_ylabel("accuracy (%), Wilson 95% band")
        ax.set_title(t)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_artifacts(res: dict, out_dir: Path, step: int, plot: bool = True) -> list[Path]:
    """step_<N>.md (the table) and step_<N>.png (the plot) beside the json.

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
    except EvalError as e:
        logging.getLogger(__name__).warning("no plot for step %d: %s", step, e)
    return written


_plot = plot
