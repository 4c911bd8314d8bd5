"""Helpers of experiments/replication/run.sh (issue 8): find checkpoints, write the report.

    python dev/rep_tools.py newest WORK/runs rep_pretrain     # newest verified checkpoint of that run
    python dev/rep_tools.py report WORK OUT/report.md --scale h200

Results on stdout, diagnostics on stderr; exit 1 when the thing asked for does not exist.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import statistics
import sys
from pathlib import Path


def run_dir(runs: Path, name: str):
    """The newest run dir `<name>-NNNN` under runs (None if there is none)."""
    cands = sorted(
        p for p in Path(runs).glob(f"{name}-*") if p.is_dir() and re.fullmatch(rf"{re.escape(name)}-\d+", p.name)
    )
    return cands[-1] if cands else None


def newest(runs: Path, name: str):
    from megablu.checkpoint import newest_verified

    d = run_dir(runs, name)
    return newest_verified(d) if d is not None else None


def _metrics(path: Path) -> dict:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {}
    tps = [float(r["tokens_per_s"]) for r in rows[3:]] or [float(r["tokens_per_s"]) for r in rows]
    return {
        "steps": int(rows[-1]["step"]),
        "tokens": int(rows[-1]["tokens_seen"]),
        "first_loss": float(rows[0]["loss"]),
        "last_loss": float(rows[-1]["loss"]),
        "tok_s": statistics.median(tps),
        "train_s": sum(float(r["step_time_s"]) for r in rows),
        "max_mem_gb": max(float(r["max_mem_gb"] or 0) for r in rows),
    }


def _loader_line(err: Path) -> str:
    """The loader's 'data ... documents, ... padding' line from a run's stderr, shortened."""
    if not err.is_file():
        return ""
    for line in err.read_text(errors="replace").splitlines():
        m = re.search(r"INFO megablu\.data\.loader: data \S+ (bucket=.*)$", line)
        if m:
            return m.group(1)
    return ""


def report(work: Path, out: Path, scale: str) -> None:
    work = Path(work)
    lines = [f"# Issue 8 replication ({scale} scale)", ""]
    env = work / "env.txt"
    if env.is_file():
        lines += ["```", env.read_text().strip(), "```", ""]
    lines += [
        "## Timeline (seconds since the script started)",
        "",
        "| phase | start s | end s | exit |",
        "|---|---:|---:|---|",
    ]
    tl = work / "timeline.tsv"
    if tl.is_file():
        for row in tl.read_text().splitlines():
            parts = row.split("\t")
            if len(parts) == 4:
                lines.append("| " + " | ".join(parts) + " |")
    lines += [
        "",
        "exit 124/137 = cut by the phase's time guard (its newest checkpoint is used).",
        "",
        "## Training runs",
        "",
        "| run | steps | tokens | loss first -> last | tokens/s (median after step 3) | train s | max mem GB | data |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for name in ("rep_pretrain", "rep_ext_fit", "rep_ext_trunc"):
        d = run_dir(work / "runs", name)
        m = _metrics(d / "metrics.csv") if d is not None and (d / "metrics.csv").is_file() else {}
        if not m:
            lines.append(f"| {name} | - | - | - | - | - | - | not run or no step finished |")
            continue
        lines.append(
            f"| {d.name} | {m['steps']} | {m['tokens']:,} | {m['first_loss']:.3f} -> {m['last_loss']:.3f} | "
            f"{m['tok_s']:,.0f} | {m['train_s']:.0f} | {m['max_mem_gb']:.1f} | "
            f"{_loader_line(work / 'logs' / f'{name}.err')} |"
        )
    cmp_md = work / "compare.md"
    lines += ["", "## Evaluation (`megablu compare`; baseline = the parent)", ""]
    lines += [cmp_md.read_text().strip()] if cmp_md.is_file() else ["(no comparison: see the timeline and logs)"]
    cmp_err = work / "logs" / "compare.err"
    if cmp_err.is_file():
        gate = [ln for ln in cmp_err.read_text(errors="replace").splitlines() if "gate" in ln.lower()]
        if gate:
            lines += ["", "### Short-context gate against the parent", ""] + [f"- {g}" for g in gate]
    lines += ["", "## Eval cells (seconds per cell)", ""]
    for res in sorted((work / "eval").glob("*/step_*.json")):
        try:
            r = json.loads(res.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        cells = ", ".join(
            f"{c['task']}@{c['length']} {c['correct']}/{c['n']} ({c['seconds']:.0f}s)" for c in r["cells"]
        )
        lines.append(f"- {r['arm']}@{r['step']}: {cells}")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


def merge(eval_dir: Path, arm: str, out: Path) -> int:
    """The cells of one arm measured in separate `megablu eval` jobs, as one result (compare's join)."""
    from megablu.eval.report import load_result, merge_results, write_result

    found = [load_result(f) for f in sorted(eval_dir.glob("*/step_*.json"))]
    mine = [r for r in found if r.get("arm") == arm]
    if not mine:
        print(f"no results of arm {arm!r} under {eval_dir}/*/", file=sys.stderr)
        return 1
    (res,) = merge_results(mine)
    write_result(res, out)
    print(f"{out}: {len(res['cells'])} cells of {arm}")
    return 0


def prompts_match(eval_dir: Path, tokenizer: str, haystack, prune: bool) -> int:
    """Rebuild every stored result's prompts (its eval config, today's code, this tokenizer and
    haystack) and compare digests per cell: results evaluated in an earlier session are reusable
    (paired with new cells) only when every cell matches. --prune removes the dirs that do not."""
    import shutil

    from megablu.config.schema import EvalConfig, TokenizerConfig
    from megablu.data.haystack import haystack_source
    from megablu.data.tokenizer import load_tokenizer
    from megablu.eval.harness import build_prompts
    from megablu.eval.prompts import prompt_digest

    kind, _, path = tokenizer.partition(":")
    tok = load_tokenizer(TokenizerConfig(kind=kind, path=path) if path else TokenizerConfig(kind="tiktoken", name=kind))
    hs = haystack_source(haystack, tok) if haystack else None
    bad_dirs = 0
    for run in sorted(p for p in eval_dir.iterdir() if p.is_dir() and any(p.glob("step_*.json"))):
        differ = []
        for f in sorted(run.glob("step_*.json")):  # a dir is reusable only when every result in it is
            d = json.loads(f.read_text())
            fields = {k: v for k, v in d["eval"].items() if k in EvalConfig.model_fields and k != "haystack"}
            cfg = EvalConfig(**fields)
            for c in d["cells"]:
                one = cfg.model_copy(update={"tasks": [c["task"]], "lengths": [c["length"]], "n": c["n"]})
                try:
                    got = prompt_digest(build_prompts(one, tok, haystack=hs)[(c["task"], c["length"])])
                except Exception as e:  # noqa: BLE001 - a cell that cannot be rebuilt is not reusable
                    got = f"error: {e}"
                if got != c["digest"]:
                    differ.append(f"{c['task']}@{c['length']}")
        print(f"{run.name}: {'same prompts' if not differ else 'DIFFERENT prompts: ' + ', '.join(differ)}")
        if differ:
            bad_dirs += 1
            if prune:
                shutil.rmtree(run)
    return 1 if bad_dirs and not prune else 0


def positions(files: list, bin_tokens: int, task: str) -> int:
    """Per result and length: correct/n per bin of the needle's position, depth x length (the
    sample's depth is its share of the filler, so this is the position to within the prompt's
    head, needle and question: tens of tokens); 'back' = length - position, the distance to the
    question. The heatmap's depth rows in tokens, to tell a distance effect (the same 'back' fails
    at every length) from a position one."""
    for f in files:
        d = json.loads(Path(f).read_text())
        samples = [x for x in d.get("samples", []) if x["task"] == task and x.get("depth") is not None]
        for L in sorted({x["length"] for x in samples}):
            bins: dict[int, list] = {}
            for x in samples:
                if x["length"] == L:
                    b = bins.setdefault(int(x["depth"] * L // bin_tokens), [0, 0])
                    b[0] += int(bool(x["correct"]))
                    b[1] += 1
            print(f"{d.get('arm')}@{d.get('step')} {task} {L}")
            fmt = (lambda t: f"{t / 1024:>6.1f}k") if bin_tokens >= 1024 else (lambda t: f"{t:>7d}")
            print("  at     " + " ".join(fmt(b * bin_tokens) for b in sorted(bins)))
            print("  back   " + " ".join(fmt(L - b * bin_tokens) for b in sorted(bins)))  # from the bin's start
            print("  found  " + " ".join(f"{c:>3}/{n:<3}" for c, n in (bins[b] for b in sorted(bins))))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("newest", help="newest verified checkpoint of the newest run NAME-NNNN under RUNS")
    n.add_argument("runs")
    n.add_argument("name")
    r = sub.add_parser("report", help="write the markdown report of a replication work dir")
    r.add_argument("work")
    r.add_argument("out")
    r.add_argument("--scale", default="h200")
    e = sub.add_parser("env", help="one line per fact about this machine (python, torch, GPU)")
    e.add_argument("out")
    m = sub.add_parser("merge", help="one result json of all cells of ARM found under EVAL_DIR/*/ (a gate parent)")
    m.add_argument("eval_dir")
    m.add_argument("arm")
    m.add_argument("out")
    q = sub.add_parser("prompts-match", help="are the stored results under EVAL_DIR/*/ today's prompts? (digests)")
    q.add_argument("eval_dir")
    q.add_argument("--tokenizer", required=True, help="KIND:PATH as in a config, e.g. hf:DIR/tokenizer.json")
    q.add_argument("--haystack", default=None, help="the eval.haystack the results used (DIR@bucket)")
    q.add_argument("--prune", action="store_true", help="remove the result dirs whose prompts differ (exit 0)")
    o = sub.add_parser("positions", help="correct/n per bin of the needle's position in result JSONs (samples)")
    o.add_argument("results", nargs="+")
    o.add_argument("--bin", type=int, default=2048, help="bin width in tokens")
    o.add_argument("--task", default="passkey")
    a = p.parse_args(argv)
    if a.cmd == "positions":
        return positions(a.results, a.bin, a.task)
    if a.cmd == "prompts-match":
        return prompts_match(Path(a.eval_dir), a.tokenizer, a.haystack, a.prune)
    if a.cmd == "merge":
        return merge(Path(a.eval_dir), a.arm, Path(a.out))
    if a.cmd == "newest":
        ck = newest(Path(a.runs), a.name)
        if ck is None:
            print(f"no verified checkpoint of a run {a.name}-* under {a.runs}", file=sys.stderr)
            return 1
        print(ck)
        return 0
    if a.cmd == "report":
        report(Path(a.work), Path(a.out), a.scale)
        return 0
    import torch

    facts = [f"host {platform.node()} python {platform.python_version()} torch {torch.__version__}"]
    try:
        import deepspeed

        facts[0] += f" deepspeed {deepspeed.__version__}"
    except ImportError:
        pass
    import importlib.util

    facts.append(
        "importable: "
        + ", ".join(
            f"{m} {'yes' if importlib.util.find_spec(m) else 'NO'}"
            for m in ("tiktoken", "matplotlib", "transformers", "gguf")
        )
    )
    if torch.cuda.is_available():
        pr = torch.cuda.get_device_properties(0)
        facts.append(f"GPU {pr.name}, {pr.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible")
    else:
        facts.append("no GPU (CPU rehearsal)")
    Path(a.out).write_text("\n".join(facts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
