"""Oracle check of megablu's RULER suite: the same model at the same lengths through megablu's own
harness (run_eval) and through lm-eval's RULER tasks (lm-eval 0.4.13, via the megablu backend,
megablu/eval/lm_eval_adapter.py), per task x length: accuracy with its 95% Wilson interval on each side
and whether the two intervals overlap.

  python bench/ruler_oracle.py --config experiments/ruler_baselines/rep_smollm2_32k.yaml --ckpt /tmp/smollm2_blu \\
      --lengths 4096 8192 --n 100 niah_single_1 niah_multikey_2 vt cwe fwe
  python bench/ruler_oracle.py ... --map ruler_vt=my_vt     # lm-eval task -> megablu task name
  python bench/ruler_oracle.py merge a.json b.json --out all.json   # runs that each did some cells
  python bench/ruler_oracle.py merge a.json --again fixed.json --out all.json   # fixed's cells replace a's

Positional arguments are megablu task names; the mapping gives the lm-eval task of each (override or
add with --map LM_EVAL_TASK=MEGABLU_TASK). It is FAITHFUL (lm-eval's niah_single_1 -> megablu's
ruler_niah_single_1, ruler_vt -> ruler_vt, ...) when megablu has its RULER-as-published tasks, else
LIKE: megablu's RULER-like presets (megablu/config/eval_tasks.py: RULER's task set, megablu's own
templates and haystacks), where disagreement is expected and is what the faithful suite fixes.

What differs between the two sides by construction (read the table with these in mind):
- length: lm-eval's max_seq_length L holds the prompt plus RULER's tokens_to_generate (128 for niah, 30
  vt, 120 cwe, 50 fwe), as megablu's ruler_* tasks do; megablu's RULER-like presets build prompts of
  exactly L tokens (+ their answer budget), longer by that much. lm-eval appends RULER's answer prefix
  (gen_prefix) to each prompt.
- essay haystack (niah_single_2/3, niah_multikey_1, multivalue, multiquery): lm-eval downloads Paul
  Graham's essays (`datasets.load_dataset("baber/paul_graham_essays")`); here it gets LOCAL prose
  instead, monkeypatched in (install_ruler_offline): --essays, by default megablu's own RULER essay
  haystack (megablu/eval/assets/ruler/essays.txt.gz) where the faithful suite has landed, else the
  Python language reference topics that ship with every Python (pydoc_data.topics); megablu's
  RULER-like presets get the same text, its ruler_* tasks always read their own asset. Without nltk's
  punkt_tab data, lm-eval's sentence split (used to place needles) is a regex split. Printed with the
  table.
- scoring: both are RULER's string_match_all (part credit per expected answer); lm-eval's n counts
  its samples, as megablu's its prompts, and both intervals are Wilson on the summed scores.

Offline: set HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1; RULER's prompts are sized with megablu's own
tokenizer (no HF tokenizer download). lm-eval's own vt (ruler_vt) sizes its worked example at 500
tokens and loops forever when even that does not fit (a byte tokenizer): use a BPE tokenizer for vt.
Writes --out (JSON: every cell's k, n, intervals); the table goes to stdout, logs to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("ruler_oracle")

# lm-eval task -> megablu task, for RULER's 11 synthetic tasks that run offline (qa_squad / qa_hotpot need
# downloads). lm-eval names the niah tasks as RULER does and prefixes vt, cwe and fwe with `ruler_`.
# megablu's RULER-like presets (its own templates and haystacks, megablu/config/eval_tasks.py):
LIKE = {
    "niah_single_1": "niah_single_1",
    "niah_single_2": "niah_single_2",
    "niah_single_3": "niah_single_3",
    "niah_multikey_1": "niah_multikey_1",
    "niah_multikey_2": "niah_multikey_2",
    "niah_multikey_3": "niah_multikey_3",
    "niah_multivalue": "niah_multivalue",
    "niah_multiquery": "niah_multiquery",
    "ruler_vt": "vt",
    "ruler_cwe": "cwe",
    "ruler_fwe": "fwe",
}
# megablu's RULER as published (`ruler_<RULER's name>`, megablu/config/ruler_tasks.py), where it exists
EXAMPLES = 3  # lm-eval answers kept per cell in --out's JSON

FAITHFUL = {lm: lm if lm.startswith("ruler_") else f"ruler_{lm}" for lm in LIKE}


def default_mapping() -> dict[str, str]:
    """FAITHFUL when this megablu has those tasks (the faithful suite landed), else LIKE."""
    from megablu.config.eval_tasks import PRESETS

    return dict(FAITHFUL) if all(t in PRESETS for t in FAITHFUL.values()) else dict(LIKE)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("tasks", nargs="*", help="megablu task names (default: every task in the mapping)")
    p.add_argument("--config", required=True, help="the run's YAML (model, rope, tokenizer, data.window)")
    p.add_argument("--ckpt", help="megablu checkpoint")
    p.add_argument("--hf", help="a transformers model dir instead of --ckpt")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override (repeatable)")
    p.add_argument(
        "--rope-override",
        action="store_true",
        help="evaluate with the config's rope although the "
        "checkpoint records another (or none), as `megablu eval --rope-override`",
    )
    p.add_argument("--lengths", type=int, nargs="+", required=True, help="lengths in tokens (both sides)")
    p.add_argument("--n", type=int, default=50, help="prompts per task and length on each side")
    p.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="LM_EVAL_TASK=MEGABLU_TASK",
        help="add or replace a mapping entry (repeatable)",
    )
    p.add_argument(
        "--essays",
        help="local prose for the essay haystack (a text file, or a dir of .txt/.md/.rst); "
        "default: Python's pydoc_data.topics",
    )
    p.add_argument("--batch-tokens", type=int, help="as `megablu eval` (default 262144 on a GPU, 16384 on a CPU)")
    p.add_argument("--out", help="write the cells as JSON here")
    p.add_argument(
        "--aligned",
        action="store_true",
        help="also run megablu's side laid out as lm-eval's port lays out its prompts where the two differ by "
        "design (lm_eval_layout: the essay haystack from its start, the answer prefix without its leading "
        "space): a cell that disagrees there points at an implementation difference, one that disagrees "
        "only as-is at a design choice, with its size",
    )
    p.add_argument(
        "--lm-eval-from",
        action="append",
        default=[],
        metavar="JSON",
        help="an earlier --out file (repeatable) whose lm-eval cells (same n, chat template and essays) stand "
        "in for running lm-eval again: its side does not depend on megablu's code, so a megablu fix re-runs "
        "megablu's side only, and a run cut short resumes where it stopped",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def mapping(extra: list[str]) -> dict[str, str]:
    m = default_mapping()
    for e in extra:
        lm, sep, mb = e.partition("=")
        if not sep or not lm or not mb:
            raise SystemExit(f"--map {e!r}: expected LM_EVAL_TASK=MEGABLU_TASK")
        m = {k: v for k, v in m.items() if v != mb}
        m[lm] = mb
    return m


def essay_docs(path: str | None) -> tuple[list[str], str]:
    """(documents, where they came from): the local stand-in for lm-eval's Paul Graham essays."""
    if path is None:
        try:  # the faithful suite's own essay haystack, where it exists: then both sides read the same text
            from megablu.eval.ruler.assets import DIR, essay_text

            return [essay_text()], f"{DIR.name}/essays.txt.gz (megablu's RULER essay haystack)"
        except ImportError:
            from pydoc_data.topics import topics

            return [topics[k] for k in sorted(topics)], "pydoc_data.topics (Python language reference, PSF licence)"
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md", ".rst")) if p.is_dir() else [p]
    if not files:
        raise SystemExit(f"--essays {path}: no .txt/.md/.rst file")
    return [f.read_text(errors="replace") for f in files], str(p)


def run_megablu(
    model, tok, cfg, tasks: list[str], lengths: list[int], n: int, docs: list[str], batch_tokens: int
) -> dict:
    """{(task, L): (k, n)} from megablu's run_eval, the essay tasks on `docs`."""
    from megablu.eval.harness import run_eval

    eval_cfg = type(cfg.eval).model_validate(
        {**cfg.eval.model_dump(), "tasks": tasks, "lengths": lengths, "n": n, "loss": {}, "gate": {}, "string": None}
    )
    with tempfile.TemporaryDirectory() as d:
        res = run_eval(
            model,
            tok,
            eval_cfg,
            cfg.data.window,
            step=0,
            out_dir=Path(d),
            rank=0,
            haystack=docs,
            plot=False,
            batch_tokens=batch_tokens,
            arm="oracle",
        )
    return {(c["task"], c["length"]): (c["correct"], c["n"]) for c in res["cells"]}


class _FromStart:
    """An rng whose every offset is 0: the essay haystack from its start (RULER: haystack[:num_haystack])."""

    def randrange(self, n):
        return 0


@contextlib.contextmanager
def lm_eval_layout(haystack: bool = True, prefix: bool = True):
    """megablu's RULER prompts laid out as lm-eval 0.4.13's port lays out its own where the two differ by
    design (docs/EVAL.md), while the block runs. haystack: the essay haystack from its first word in every
    prompt (RULER's niah.py and lm-eval take haystack[:num_haystack]; megablu draws a window per
    prompt, so that a second eval.seed is a second sample). prefix: under a chat template, the answer
    prefix without its leading space (lm-eval strips gen_prefix; RULER sends the model template + " The
    special magic ...", as megablu does). Still megablu's: the prompt length (lm-eval grows the essay in
    500-word steps and stops short of L), cwe's worked example, vt's noise lines."""
    from unittest import mock

    from megablu.eval.ruler.common import RulerBuilder
    from megablu.eval.ruler.niah import RulerNiah

    rng, frame = RulerNiah.rng, RulerBuilder.frame

    def from_start(self, tag, *key):
        return _FromStart() if tag == "offset" else rng(self, tag, *key)

    def stripped(self, user_before, user_after, answer_prefix, turns=()):
        return frame(self, user_before, user_after, answer_prefix.lstrip() if self.chat.on else answer_prefix, turns)

    with (
        mock.patch.object(RulerNiah, "rng", from_start if haystack else rng),
        mock.patch.object(RulerBuilder, "frame", stripped if prefix else frame),
    ):
        yield


# lm-eval's RULER sample generators, each called with num_samples=500 by its task's dataset function
GENERATORS = {
    "prepare_niah": "generate_samples",
    "cwe_utils": "sys_word_pair_random",
    "fwe_utils": "sys_kwext",
    "vt_utils": "sys_vartrack_w_noise_random",
}


@contextlib.contextmanager
def capped_samples(n: int, built: dict):
    """lm-eval's RULER generators build at most n samples a call instead of 500: --limit n scores only n,
    and building the other 500 - n costs minutes per task at 16k-32k (each sample is tokenized whole, its
    haystack searched for the size that fits). Their code runs unchanged, sample after sample from the same
    seeds; a task built alone gets the first n of its 500, and the tasks after a capped one start from
    another random state (another draw from the same generators, which is all an unpaired comparison
    needs). built: filled with {module.function: samples built}."""
    import functools
    import importlib
    import inspect

    from megablu.eval.lm_eval_adapter import _patch_ruler_modules

    originals = []
    for mod_name, fn_name in GENERATORS.items():
        home = importlib.import_module(f"lm_eval.tasks.ruler.{mod_name}")
        orig = getattr(home, fn_name)
        sig = inspect.signature(orig)

        def capped(*a, _orig=orig, _sig=sig, _key=f"{mod_name}.{fn_name}", **kw):
            b = _sig.bind(*a, **kw)
            b.apply_defaults()
            b.arguments["num_samples"] = min(int(b.arguments["num_samples"]), n)
            res = _orig(*b.args, **b.kwargs)
            built[_key] = built.get(_key, 0) + len(res)
            return res

        _patch_ruler_modules(fn_name, functools.wraps(orig)(capped), home)
        originals.append((fn_name, orig, home))
    try:
        yield built
    finally:
        for fn_name, orig, home in originals:
            _patch_ruler_modules(fn_name, orig, home)


def reused_lm_eval(paths: list[str], n: int, chat: bool, essays: str) -> tuple[dict, dict, dict]:
    """lm-eval's cells from earlier --out files -> ({(lm-eval task, L): (score, samples)}, {(task, L):
    examples}, {"task@L": path}). A file scored with another n, chat template or essay haystack is refused
    (its cells measured another thing); the same cell in two files too, unless the same score (a run that
    reused it carries it on)."""
    cells: dict = {}
    examples: dict = {}
    where: dict = {}
    for path in paths:
        rec = json.loads(Path(path).read_text())
        differs = [
            f"{k} {rec.get(k)!r} (this run: {v!r})"
            for k, v in (("n", n), ("chat_template", chat), ("essays", essays))
            if rec.get(k) != v
        ]
        if differs:
            why = "; ".join(differs)
            raise SystemExit(f"ruler_oracle --lm-eval-from {path}: its lm-eval cells differ from this run: {why}")
        for r in rec["cells"]:
            key, name, kn = (
                (r["lm_eval_task"], r["length"]),
                f"{r['lm_eval_task']}@{r['length']}",
                tuple(r["lm_eval"][:2]),
            )
            if cells.get(key) == kn:
                continue  # the same cell carried by a later run that reused it: one measurement
            if key in cells:
                raise SystemExit(f"ruler_oracle --lm-eval-from: {name} is in both {where[name]} and {path}")
            cells[key], where[name] = kn, path
            ex = (rec.get("lm_eval_examples") or {}).get(name)
            if ex is not None:
                examples[key] = ex
    return cells, examples, where


def run_lm_eval(
    lm,
    lm_tasks: list[str],
    lengths: list[int],
    n: int,
    chat: bool = False,
    examples: dict | None = None,
    built: dict | None = None,
    on_cell=None,
    have: dict | None = None,
) -> dict:
    """{(lm-eval task, L): (summed score, samples)}: one lm-eval run per task and length, its generators
    capped at n samples (capped_samples; --limit n scores them). chat: lm-eval's apply_chat_template, on
    where megablu's side wraps its prompts in the tokenizer's chat template. examples: filled with {(task,
    L): the first EXAMPLES samples' target, response and score}; built: with the samples each generator
    built; on_cell(out): called after each cell, with the cells so far (a run cut short keeps them)."""
    examples = {} if examples is None else examples
    built = {} if built is None else built

    import time

    import lm_eval
    from lm_eval.tasks import TaskManager

    out: dict = {k: v for k, v in (have or {}).items() if k[0] in lm_tasks and k[1] in lengths}
    with capped_samples(n, built):
        for L in lengths:
            if all((t, L) in out for t in lm_tasks):
                continue
            tm = TaskManager(metadata={"max_seq_lengths": [L]})  # indexes lm-eval's task folders once per length
            for t in lm_tasks:
                if (t, L) in out:
                    continue
                t0 = time.perf_counter()
                # lm-eval's RULER code prints progress on stdout (nltk's download notice, vt's noise search):
                # stdout is this script's table
                with contextlib.redirect_stdout(sys.stderr):
                    res = lm_eval.simple_evaluate(
                        model=lm,
                        tasks=[t],
                        limit=n,
                        log_samples=True,
                        task_manager=tm,
                        bootstrap_iters=0,
                        apply_chat_template=chat,
                    )
                samples = res["samples"][t]
                scores = [s[str(L)] for s in samples]
                out[(t, L)] = (sum(scores), len(scores))
                # the first few answers beside their targets: what a 0% (or a disagreement) looks like
                examples[(t, L)] = [
                    {"target": s["target"], "response": s["filtered_resps"][0], "score": s[str(L)]}
                    for s in samples[:EXAMPLES]
                ]
                log.info(
                    "lm-eval %s@%d: %.1f%% of %d in %.1fs",
                    t,
                    L,
                    100 * sum(scores) / max(1, len(scores)),
                    len(scores),
                    time.perf_counter() - t0,
                )
                if on_cell is not None:
                    on_cell(out)
    return out


def compare(
    mb: dict, lm: dict, pairs: list[tuple[str, str]], lengths: list[int], aligned: dict | None = None
) -> list[dict]:
    """A row per (task, length): each side's accuracy with its Wilson interval, and megablu - lm-eval with
    Newcombe's interval for two independent samples (the two sides draw their own needles and keys: the
    prompts are not paired). agree: that interval holds 0. aligned: megablu's cells under lm_eval_layout(),
    the same against lm-eval (megablu_aligned, aligned_diff, aligned_agree)."""
    from megablu.eval.stats import newcombe, wilson

    rows = []
    for lm_task, task in pairs:
        for L in lengths:
            if (lm_task, L) not in lm:  # a run cut short: the cells lm-eval finished
                continue
            (k1, n1), (k2, n2) = mb[(task, L)], lm[(lm_task, L)]
            d = newcombe(k1, n1, k2, n2)
            row = {
                "task": task,
                "lm_eval_task": lm_task,
                "length": L,
                "megablu": [k1, n1, *wilson(k1, n1)],
                "lm_eval": [k2, n2, *wilson(k2, n2)],
                "diff": [d.diff, d.lo, d.hi],
                "agree": d.lo <= 0 <= d.hi,
            }
            if aligned is not None:
                ka, na = aligned[(task, L)]
                da = newcombe(ka, na, k2, n2)
                row |= {
                    "megablu_aligned": [ka, na, *wilson(ka, na)],
                    "aligned_diff": [da.diff, da.lo, da.hi],
                    "aligned_agree": da.lo <= 0 <= da.hi,
                }
            rows.append(row)
    return rows


def summary(rows: list[dict], lengths: list[int]) -> list[dict]:
    """Per length, the mean over tasks on each side and their difference with a normal 95% interval from
    the cells' binomial variances (as the RULER average's, megablu.eval.stats.mean_interval): the suite's
    verdict, narrower than any one cell's."""
    from megablu.eval.stats import mean_variance, z_of

    out = []
    for L in lengths:
        at = [r for r in rows if r["length"] == L]
        if not at:
            continue
        sides = {}
        for side in ("megablu", "lm_eval", "megablu_aligned"):
            if all(side in r for r in at):
                cells = [(r[side][0], r[side][1]) for r in at]
                sides[side] = (sum(k / n for k, n in cells) / len(cells), mean_variance(cells))

        def diff(side):
            d = sides[side][0] - sides["lm_eval"][0]
            half = z_of() * (sides[side][1] + sides["lm_eval"][1]) ** 0.5
            return [d, d - half, d + half], d - half <= 0 <= d + half

        m = {"length": L, "tasks": len(at), "megablu": sides["megablu"][0], "lm_eval": sides["lm_eval"][0]}
        m["diff"], m["agree"] = diff("megablu")
        if "megablu_aligned" in sides:  # every cell of the length has its aligned twin
            m["megablu_aligned"] = sides["megablu_aligned"][0]
            m["aligned_diff"], m["aligned_agree"] = diff("megablu_aligned")
        out.append(m)
    return out


def table(rows: list[dict], means: list[dict] | None = None) -> str:
    def fmt(k, n, p, lo, hi):
        return f"{100 * p:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] (n={n})"

    def pp(d, lo, hi):
        return f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"

    al = any("megablu_aligned" in r for r in rows)

    def yes(ok):
        return "yes" if ok else "NO"

    out = [
        "| task | lm-eval task | length | megablu % [95% Wilson] | lm-eval % [95% Wilson] | megablu - lm-eval pp "
        "[95% Newcombe] | agree |"
        + (" megablu aligned % [95% Wilson] | aligned - lm-eval pp [95% Newcombe] | agree (aligned) |" if al else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|---|" if al else ""),
    ]

    def aligned(x, pct):  # the aligned columns of a row or a mean row, "-" where it has none
        if not al:
            return ""
        if "megablu_aligned" not in x:
            return " - | - | - |"
        return f" {pct(x['megablu_aligned'])} | {pp(*x['aligned_diff'])} | {yes(x['aligned_agree'])} |"

    for r in rows:
        extra = aligned(r, lambda v: fmt(*v))
        out.append(
            f"| {r['task']} | {r['lm_eval_task']} | {r['length']} | {fmt(*r['megablu'])} | "
            f"{fmt(*r['lm_eval'])} | {pp(*r['diff'])} | {yes(r['agree'])} |" + extra
        )
    for m in means or []:
        extra = aligned(m, lambda v: f"{100 * v:.1f}")
        out.append(
            f"| **mean of {m['tasks']}** | | {m['length']} | {100 * m['megablu']:.1f} | {100 * m['lm_eval']:.1f} | "
            f"{pp(*m['diff'])} | {yes(m['agree'])} |" + extra
        )
    return "\n".join(out)


def _cells_of(paths: list[str]) -> dict:
    """{(task, length): (row, path)} of --out files, each cell from exactly one of them."""
    seen: dict = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["cells"]:
            key = (r["task"], r["length"])
            if key in seen:
                raise SystemExit(f"ruler_oracle merge: {key[0]}@{key[1]} is in both {seen[key][1]} and {path}")
            seen[key] = (r, path)
    return seen


def merge(paths: list[str], out: str | None = None, again: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """The cells of several --out files (runs cut short, then the cells they left: ORACLE_TASKS_<L> in
    experiments/ruler_baselines/run.sh) as one table: each (task, length) from exactly one file, the mean
    rows recomputed over them all. again: files of cells measured again (after a fix to megablu's side),
    which replace the same cells of `paths` (listed in the JSON as measured_again). -> (rows, means); out:
    written as one JSON."""
    first, new = _cells_of(paths), _cells_of(again or [])
    replaced = sorted(f"{t}@{L}" for t, L in first if (t, L) in new)
    rows = [r for r, _ in {**first, **new}.values()]
    lengths = sorted({r["length"] for r in rows})
    order = {t: i for i, t in enumerate(FAITHFUL.values())}
    rows.sort(key=lambda r: (r["length"], order.get(r["task"], len(order)), r["task"]))
    means = summary(rows, lengths)
    if out:
        record = {"merged_from": list(paths), "cells": rows, "means": means}
        if again:
            record |= {"measured_again_in": list(again), "measured_again": replaced}
        Path(out).write_text(json.dumps(record, indent=1))
    return rows, means


def main(argv=None, model=None, tok=None, cfg=None) -> int:
    """model/tok/cfg: an already-built model (the CPU test's); else loaded from --config/--ckpt.
    `merge A.json B.json [--out M.json]`: merge()'s table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        mp = argparse.ArgumentParser(prog="ruler_oracle.py merge", description=merge.__doc__)
        mp.add_argument("files", nargs="+")
        mp.add_argument(
            "--again", action="append", default=[], metavar="JSON", help="cells measured again (repeatable)"
        )
        mp.add_argument("--out")
        margs = mp.parse_args(argv[1:])
        print(table(*merge(margs.files, margs.out, margs.again)))
        return 0
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    from megablu.eval.lm_eval_adapter import LM_EVAL_MISSING, MegabluLM, install_ruler_offline, load_for_eval

    if LM_EVAL_MISSING is not None:
        print(
            f"ruler_oracle: lm-eval is not installed ({LM_EVAL_MISSING}); pip install lm-eval==0.4.13 wonderwords",
            file=sys.stderr,
        )
        return 2
    m = mapping(args.map)
    # megablu's RULER-like names always resolve, the active mapping's (and --map's) too
    back = {**{v: k for k, v in LIKE.items()}, **{v: k for k, v in m.items()}}
    tasks = args.tasks or list(m.values())
    unknown = [t for t in tasks if t not in back]
    if unknown:
        print(
            f"ruler_oracle: no lm-eval task mapped to {unknown}; known: {sorted(back)} (add --map "
            f"LM_EVAL_TASK=MEGABLU_TASK)",
            file=sys.stderr,
        )
        return 2
    if model is None:
        from megablu.eval.lm_eval_adapter import AdapterError

        try:
            model, tok, cfg, _ = load_for_eval(args.config, args.ckpt, args.hf, args.set, args.rope_override)
        except AdapterError as e:
            print(f"ruler_oracle: {e}", file=sys.stderr)
            return 2
    docs, source = essay_docs(args.essays)
    with contextlib.redirect_stdout(sys.stderr):  # importing lm-eval's RULER code prints nltk's download notice
        replaced = install_ruler_offline("\n\n".join(docs))
    on_gpu = next(model.parameters()).device.type == "cuda"
    bt = args.batch_tokens or (262144 if on_gpu else 16384)
    from megablu.eval.prompts import EvalError

    try:
        mb = run_megablu(model, tok, cfg, tasks, args.lengths, args.n, docs, bt)
        aligned = None
        if args.aligned:
            with lm_eval_layout():
                aligned = run_megablu(model, tok, cfg, tasks, args.lengths, args.n, docs, bt)
    except EvalError as e:  # a length the window cannot hold, an unknown task: megablu's own message
        print(f"ruler_oracle: megablu eval: {e}", file=sys.stderr)
        return 2
    lm = MegabluLM(model=model, tokenizer=tok, window=cfg.data.window, batch_size="auto", batch_tokens=bt)
    pairs = [(back[t], t) for t in tasks]
    # both sides in or out of the chat template: megablu's eval.chat_template (auto: on for a tokenizer
    # that has one) decides, and lm-eval gets the same through apply_chat_template
    from megablu.eval.ruler.chat import Chat

    chat = Chat(tok, cfg.eval.chat_template, "oracle").on
    have, examples, reused = reused_lm_eval(args.lm_eval_from, args.n, chat, source)
    built: dict = {}

    def write(lm_cells: dict, complete: bool) -> tuple[list, list]:
        rows = compare(mb, lm_cells, pairs, args.lengths, aligned)
        means = summary(rows, args.lengths)
        if args.out:  # after every lm-eval cell: a run cut short keeps what finished
            record = {
                "lengths": args.lengths,
                "n": args.n,
                "complete": complete,
                "essays": source,
                "lm_eval_offline": replaced,
                "chat_template": chat,
                "cells": rows,
                "means": means,
                "megablu_cells": [[t, L, k, m] for (t, L), (k, m) in mb.items()],
                "megablu_aligned_cells": [[t, L, k, m] for (t, L), (k, m) in (aligned or {}).items()],
                "lm_eval_examples": {f"{t}@{L}": ex for (t, L), ex in examples.items() if (t, L) in lm_cells},
                "lm_eval_samples_built": built,
                "lm_eval_reused_from": {f"{t}@{L}": reused[f"{t}@{L}"] for t, L in lm_cells if f"{t}@{L}" in reused},
            }
            tmp = Path(str(args.out) + ".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(args.out)
        return rows, means

    lmres = run_lm_eval(
        lm,
        [p[0] for p in pairs],
        args.lengths,
        args.n,
        chat=chat,
        examples=examples,
        built=built,
        on_cell=lambda cells: write(cells, False),
        have=have,
    )
    rows, means = write(lmres, True)
    print(table(rows, means))
    kind = (
        "megablu's RULER as published (ruler_*)"
        if all(t in FAITHFUL.values() for t in tasks)
        else "megablu's RULER-like presets (its own templates: disagreement expected)"
    )
    print(
        f"\nessay haystack: {source}; lm-eval: {replaced['essay_haystack']}, sentence split: "
        f"{replaced['sentences']}. megablu tasks: {kind}. Chat template: {'on' if chat else 'off'} (both sides)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
