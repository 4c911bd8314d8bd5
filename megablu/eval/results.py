"""Eval results: the step_<N>.json schema, making, writing and loading one, what model it scored
(identity), and joining the results of one arm@step (merge_results).

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
unchanged. The tables are compare.py's, the plots plots.py's; megablu.eval.report re-exports all three.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from ..config.eval_tasks import MEGABLU_SUITE, RULER_SUITE
from .prompts import EvalError, Prompt, prompt_digest
from .stats import (
    RULER_THRESHOLD,
    effective_length,
    effective_length_contiguous,
    mean_interval,
    slope_per_doubling,
    wilson,
)

SCHEMA = "megablu.eval/1"
DEPTH_BINS = 10


def cell(task: str, length: int, samples: list[dict], eval_cfg, prompts: Sequence[Prompt], seconds: float) -> dict:
    """One (task, length): mean score with its Wilson interval (see stats.wilson on part credit)."""
    from ..config.schema import eval_padded_len

    n = len(samples)
    k = sum(s.get("score", float(s["correct"])) for s in samples)
    k = int(k) if float(k).is_integer() else round(k, 6)
    p, lo, hi = wilson(k, n)
    bins = [[0, 0] for _ in range(DEPTH_BINS)]
    for s in samples:
        pairs = zip(s["depths"], s["found"], strict=True) if "depths" in s else [(s["depth"], s["correct"])]
        for d, ok in pairs:
            if d is None:
                continue
            b = bins[min(int(d * DEPTH_BINS), DEPTH_BINS - 1)]
            b[0] += 1
            b[1] += bool(ok)
    max_new = eval_cfg.task_max_new(task) if task in eval_cfg.tasks else eval_cfg.max_new
    return {
        "task": task,
        "length": length,
        "n": n,
        "correct": k,
        "acc_pp": 100 * p,
        "ci_pp": [100 * lo, 100 * hi],
        "all_correct": sum(bool(s["correct"]) for s in samples),
        "max_new": max_new,
        "padded_len": eval_padded_len(
            eval_cfg.task_prompt_len(task, length) if task in eval_cfg.tasks else length, max_new, eval_cfg.pad
        ),
        "digest": prompt_digest(prompts),
        "seconds": round(seconds, 3),
        "prompts_per_s": round(n / seconds, 3) if seconds > 0 else None,
        "by_depth": [
            {"depth": [i / DEPTH_BINS, (i + 1) / DEPTH_BINS], "n": b[0], "correct": b[1]} for i, b in enumerate(bins)
        ]
        if any(b[0] for b in bins)
        else [],
    }


def summarize(cells: list[dict], threshold: float = RULER_THRESHOLD) -> dict:
    out = {}
    for task in dict.fromkeys(c["task"] for c in cells):
        cs = sorted((c for c in cells if c["task"] == task), key=lambda c: c["length"])
        acc = {c["length"]: c["acc_pp"] for c in cs}
        s = None
        if len(cs) >= 2:
            s = slope_per_doubling(
                [c["length"] for c in cs], [c["correct"] for c in cs], [c["n"] for c in cs]
            ).as_dict()
        out[task] = {
            "slope": s,
            "threshold": threshold,
            "effective_length": effective_length(acc, threshold),
            "effective_length_contiguous": effective_length_contiguous(acc, threshold),
        }
    return out


# the averages a report shows: (result key, title, tasks); RULER's only over RULER's own tasks (ruler_*)
AVERAGES = (
    ("ruler", "RULER average", RULER_SUITE),
    ("megablu_suite", "megablu suite average (RULER-like tasks, not comparable to RULER)", MEGABLU_SUITE),
)


def ruler_average(
    cells: list[dict], threshold: float = RULER_THRESHOLD, suite: Sequence[str] = RULER_SUITE
) -> Optional[dict]:
    """RULER's headline: the mean accuracy over the suite's tasks at each length, and the
    effective length on that mean (the threshold applies to the average, never per task). Only
    tasks present at every length of the result count (an average over different task sets would
    not be comparable across lengths); None when no suite task is there. The interval is
    stats.mean_interval over the tasks' cells. suite=MEGABLU_SUITE: the same for megablu's
    RULER-like tasks (its own average)."""
    by: dict[str, dict[int, dict]] = {}
    for c in cells:
        if c["task"] in suite:
            by.setdefault(c["task"], {})[c["length"]] = c
    if not by:
        return None
    lengths = sorted({L for cs in by.values() for L in cs})
    tasks = [t for t in suite if t in by and all(L in by[t] for L in lengths)]
    if not tasks:
        return None
    rows: list[dict] = []
    for L in lengths:
        m, lo, hi = mean_interval([(by[t][L]["correct"], by[t][L]["n"]) for t in tasks])
        rows.append({"length": L, "acc_pp": 100 * m, "ci_pp": [100 * lo, 100 * hi]})
    acc: dict[int, float] = {r["length"]: r["acc_pp"] for r in rows}
    return {
        "tasks": tasks,
        "lengths": lengths,
        "by_length": rows,
        "threshold": threshold,
        "effective_length": effective_length(acc, threshold),
        "effective_length_contiguous": effective_length_contiguous(acc, threshold),
        "left_out": sorted(set(by) - set(tasks)),
    }


def make_result(
    cells,
    samples,
    *,
    arm: str,
    step: int,
    window: int,
    eval_cfg,
    tokenizer_identity: str,
    sp: int,
    extra: Optional[dict] = None,
    threshold: float = RULER_THRESHOLD,
) -> dict:
    if not cells or not samples:
        raise EvalError("no scored prompts: refusing to make an empty eval result")
    res = {
        "schema": SCHEMA,
        "arm": arm,
        "step": step,
        "window": window,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tokenizer": tokenizer_identity,
        "sp": sp,
        "eval": eval_cfg.model_dump(mode="json"),
        "cells": cells,
        "summary": summarize(cells, threshold),
        **{key: ruler_average(cells, threshold, suite) for key, _, suite in AVERAGES},
        "samples": samples,
        "gate": None,
    }
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
    return {
        "weights": res.get("weights"),
        "model": res.get("model"),
        "rope": res.get("rope"),
        "string": string_setting(res) or ("off" if "eval" in res else None),
        "tokenizer": res.get("tokenizer"),
    }


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
        parts.append(
            f"rope theta {r.get('theta'):g}" + (f" yarn x{y['factor']:g}" if y else " plain") if r else "rope ?"
        )
    if "weights" in fields:
        parts.append(f"weights {res['weights'][:8]}")
    parts += [f for f in fields if f not in ("rope", "weights", "string")]  # string: _label shows it already
    return ", ".join(parts)


def merge_results(results: Sequence[dict]) -> list[dict]:
    """One result per arm@step and identity: cells measured in separate runs (e.g. one length per job) are
    joined; results of the same arm@step that scored different models (identity_differences: other weights,
    another rope, STRING, another tokenizer) stay separate rows, labelled by what differs.

    The same (task, length) twice for one arm@step and identity is an error unless identical."""
    merged: dict[tuple, dict] = {}
    for r in results:
        key = next(
            (k for k in merged if k[:2] == (r["arm"], r["step"]) and not identity_differences(merged[k], r)), None
        )
        if key is None:
            key = (r["arm"], r["step"], len(merged))
            merged[key] = {**r, "cells": list(r["cells"]), "samples": list(r.get("samples", []))}
            continue
        m = merged[key]
        have = {(c["task"], c["length"]): c for c in m["cells"]}
        for c in r["cells"]:
            old = have.get((c["task"], c["length"]))
            if old is not None and old != c:
                raise EvalError(
                    f"{r['arm']}@{r['step']}: two different results for {c['task']}@{c['length']} "
                    f"({m.get('_path')} and {r.get('_path')})"
                )
            if old is None:
                m["cells"].append(c)
        m["samples"] += r.get("samples", [])
        if r.get("loss"):  # held-out loss measured per length in separate runs: join its lengths too
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
    s += (
        f",W={st['local']}"
        + (f",af={st['attention_factor']:.4g}" if st["attention_factor"] != 1 else "")
        + (f",>{st['beyond']}" if st["beyond"] else "")
    )
    return f"{base} +string({s})"


def _fmt_len(L: Optional[int]) -> str:
    return "-" if L is None else str(L)
