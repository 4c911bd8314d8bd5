"""The quick start's own pieces (examples/quickstart/quickstart.sh): retrieval training documents, the summary.

    python3 examples/quickstart/quickstart.py passkey-docs --tokenizer SPEC --out DIR --lengths 90-255 --docs 6000 \
        --seed 1 --digits 1
    python3 examples/quickstart/quickstart.py summary --parent-run RUN --ext-run RUN --parent-eval JSON \
        --untrained-eval JSON --ext-eval JSON [--gate FILE]

A small model pretrained for minutes on code never learns to copy a number it read 200 tokens
earlier, and without that skill a passkey evaluation of its YaRN extension measures nothing
(0% for every arm). So the quick start mixes passkey documents into its training data: the
eval's own template (megablu.eval.passkey), other keys and depths (their own seed and name),
the answer written after the question. What the quick start then measures is whether that
skill, learnt inside the parent's window, carries beyond it: the parent with YaRN and no
training against the extension, with intervals (docs/EVAL.md#statistics).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)


def passkey_docs(
    out,
    tok_spec: str,
    *,
    lengths: tuple[int, int],
    docs: int,
    seed: int,
    digits: int = 5,
    depth: tuple[float, float] = (0.0, 1.0),
) -> dict:
    """`docs` passkey documents of uniformly drawn lengths in [lo, hi] tokens, answer included:
    the eval's prompt (megablu.eval.passkey: its instruction, filler, needle and question) of
    (length - answer) tokens, then " <key>." The needle sits at a uniform depth in `depth` of the
    filler (0 = first): (0, 0.5) puts every answer at least half a document away from its key.
    Written as a megablu dataset (all train: the eval builds its own prompts, from its own seed
    and task name). A dataset already at `out` with the same recipe and tokenizer (and intact) is
    kept; any other is replaced."""
    from megablu.data.shards import DataError, DatasetWriter, read_manifest, verify_dataset
    from megablu.data.tokenizer import load_tokenizer, parse_tokenizer_spec
    from megablu.eval.passkey import NEEDLE, PasskeyBuilder
    from megablu.eval.prompts import repeat_to, rng_for

    tok_cfg = parse_tokenizer_spec(tok_spec)
    tok = load_tokenizer(tok_cfg)
    lo, hi = lengths
    recipe = {"seed": seed, "docs": docs, "lengths": [lo, hi], "digits": digits, "depth": list(depth)}
    if (Path(out) / "manifest.json").exists():
        try:
            m = read_manifest(out)
            if (
                m.get("passkey_docs") == recipe
                and m["tokenizer"]["identity"] == tok.identity
                and not verify_dataset(out, tok.identity, check_hash=False)
            ):
                log.info("%s: up to date (%d documents)", out, docs)
                return m
        except (DataError, KeyError, OSError, ValueError):
            pass
    b = PasskeyBuilder(tok, seed, docs, digits=digits)
    b.task = "passkey-docs"  # keys and depths of their own, never the eval's
    tail = len(tok.encode(f" {'9' * digits}."))
    if lo - tail < b.min_length() or hi < lo:
        raise ValueError(
            f"--lengths {lo}-{hi}: a passkey document of {digits} digit(s) needs at least "
            f"{b.min_length() + tail} tokens, and lo <= hi"
        )
    if not 0.0 <= depth[0] <= depth[1] <= 1.0:
        raise ValueError(f"--depth {depth[0]}-{depth[1]}: need 0 <= lo <= hi <= 1")
    u = len(b.unit)
    tok_info = {
        "identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "config": tok_cfg.model_dump(exclude_none=True),
    }
    with DatasetWriter(
        Path(out), tok_info, split_info={"val_fraction": 0.0, "seed": 0, "rule": "all train"}, overwrite=True
    ) as w:
        for i in range(docs):
            r = rng_for(seed, "passkey-docs", i)
            L, key = r.randint(lo, hi) - tail, b.key(i)
            needle = tok.encode(NEEDLE.format(key=key))
            n_fill = L - len(b.head) - len(needle) - len(b.question)
            # as PasskeyBuilder.build: the needle at a filler-sentence boundary, the filler cut at the end
            before = min(round(r.uniform(*depth) * n_fill / u) * u, (n_fill // u) * u)
            ids = (
                b.head
                + repeat_to(b.unit, before)
                + needle
                + repeat_to(b.unit, n_fill - before, before)
                + b.question
                + tok.encode(f" {key}.")
            )
            w.add(
                np.asarray(ids, dtype=np.int64),
                "train",
                {
                    "source": "passkey-docs",
                    "license": "generated (megablu.eval.passkey template)",
                    "key": f"passkey/{seed}/{i}",
                    "n_tokens": len(ids),
                    "provenance": f"megablu.quickstart passkey-docs seed={seed} doc={i}",
                },
            )
        return w.finish({"passkey_docs": recipe})


# --------------------------------------------------------------------------- summary
def _cells(res: dict, task: str) -> dict:
    return {c["length"]: c for c in res["cells"] if c["task"] == task}


def _loss(res: dict) -> dict:
    return {c["length"]: c for c in (res.get("loss") or {}).get("by_length", [])}


def paired_loss_diff(a: dict, b: dict, conf: float = 0.95):
    """Loss of arm a minus arm b at one length over the same sequences (same digest): (mean of the
    per-sequence differences, lo, hi, p), a t interval and its two-sided p (the paired t test); None when
    the sequences differ.

    A sequence drawn twice (the val stream's sequences start at a document start, so a small val
    split repeats some) counts once: an identical pair of losses in both arms is the same sequence."""
    import math

    from megablu.eval.stats import t_quantile, t_test_p

    if a.get("digest") != b.get("digest"):
        return None
    pairs = list(dict.fromkeys(zip(a.get("per_seq", []), b.get("per_seq", []), strict=False)))
    if len(pairs) < 2:
        return None
    d = [x - y for x, y in pairs]
    m = sum(d) / len(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(len(d))
    half = t_quantile(conf, len(d) - 1) * se
    return m, m - half, m + half, t_test_p(m, se, len(d) - 1)


def claims(parent: dict, untrained: dict, ext: dict, window: int) -> dict:
    """What the quick start shows, from the three eval results: per task and length the retrieval
    difference extension - untrained (Newcombe's paired interval and McNemar's exact p: both scored the
    same prompts), per length the loss difference (paired t interval and p), each cell's Holm-adjusted p
    over all of them (`p_adj`) and its `star` (p_adj < 0.05, as `compare` stars), and `better_beyond`:
    every starred gain of the extension at a length beyond the parent's window, with `long_context`:
    whether it exceeds the best gain of the same measure inside the window (an equal gain everywhere is
    extra training)."""
    from megablu.eval.report import STAR_ALPHA, difference
    from megablu.eval.stats import holm

    out = {"window": window, "retrieval": {}, "loss": {}}
    for task in dict.fromkeys(c["task"] for c in ext["cells"]):
        e, u = _cells(ext, task), _cells(untrained, task)
        for L in sorted(set(e) & set(u)):
            d, _ = difference(ext, e[L], untrained, u[L])
            out["retrieval"].setdefault(task, {})[L] = {
                "ext": e[L]["acc_pp"],
                "untrained": u[L]["acc_pp"],
                "n": e[L]["n"],
                "p": None,
                **d.as_dict(),
            }
    le, lu = _loss(ext), _loss(untrained)
    for L in sorted(set(le) & set(lu)):
        d = paired_loss_diff(le[L], lu[L])
        # the difference over the distinct sequences (paired_loss_diff), else of the two means
        out["loss"][L] = {
            "ext": le[L]["loss"],
            "untrained": lu[L]["loss"],
            "diff": le[L]["loss"] - lu[L]["loss"] if d is None else d[0],
            "n": le[L]["n"],
            "ci": None if d is None else [d[1], d[2]],
            "resolvable": d is not None and (d[1] > 0 or d[2] < 0),
            "p": None if d is None else d[3],
        }
    # the summary's stars: Holm over every difference it shows that has a test (all but unpaired part credit)
    cells = [x for by in out["retrieval"].values() for x in by.values()] + list(out["loss"].values())
    tested = [x for x in cells if x["p"] is not None]
    for x, q in zip(tested, holm([x["p"] for x in tested]), strict=True):
        x["p_adj"] = q
    for x in cells:
        x.setdefault("p_adj", None)
        x["star"] = x["p_adj"] is not None and x["p_adj"] < STAR_ALPHA
    # a gain beyond the window is a long-context gain only when it exceeds every gain of the same
    # measure inside the window: an equal gain at every length is extra training, not longer context
    better = []
    for task, by in out["retrieval"].items():
        inside = max([d["diff_pp"] for L, d in by.items() if L <= window] + [0.0])  # no gain: 0
        better += [
            {
                "what": task,
                "length": L,
                "diff": d["diff_pp"],
                "ci": d["ci_pp"],
                "inside_best": inside,
                "long_context": d["diff_pp"] > inside,
            }
            for L, d in by.items()
            if L > window and d["star"] and d["diff_pp"] > 0
        ]
    inside = min([d["diff"] for L, d in out["loss"].items() if L <= window] + [0.0])
    better += [
        {
            "what": "loss",
            "length": L,
            "diff": d["diff"],
            "ci": d["ci"],
            "inside_best": inside,
            "long_context": d["diff"] < inside,
        }
        for L, d in out["loss"].items()
        if L > window and d["star"] and d["diff"] < 0
    ]
    out["better_beyond"] = better
    return out


def verdict(c: dict, factor: float) -> str:
    """One line: where the extension is resolvably better than untrained YaRN beyond the parent's
    window (a starred difference: it survives Holm's correction, claims()) by more than inside it (a
    long-context gain), where only by as much as inside (extra training), where not at all, and what the
    same comparison gives inside the window."""
    W = c["window"]
    long_ctx = {(b["what"], b["length"]): b["long_context"] for b in c["better_beyond"]}
    good, same, rest = [], [], []
    for task, by in c["retrieval"].items():
        for L, d in by.items():
            if L <= W:
                continue
            txt = (
                f"{task}@{L} {d['ext']:.0f}% vs {d['untrained']:.0f}% ({d['diff_pp']:+.0f} pp "
                f"[{d['ci_pp'][0]:+.0f}, {d['ci_pp'][1]:+.0f}])"
            )
            lc = long_ctx.get((task, L))
            (rest if lc is None else good if lc else same).append(txt)
    for L, d in c["loss"].items():
        if L <= W:
            continue
        ci = f" [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" if d["ci"] else ""
        lc = long_ctx.get(("loss", L))
        (rest if lc is None else good if lc else same).append(f"loss@{L} {d['diff']:+.3f} nats/token{ci}")
    inside = [f"loss@{L} {d['diff']:+.3f}" for L, d in c["loss"].items() if L <= W]
    inside += [f"{t}@{L} {d['diff_pp']:+.0f} pp" for t, by in c["retrieval"].items() for L, d in by.items() if L <= W]
    head = f"In one line: beyond the parent's window ({W} tokens), the YaRN x{factor:g} extension is "
    if good:
        line = (
            head + "resolvably better than the parent with untrained YaRN, by more than inside the window "
            "(a long-context gain), on " + "; ".join(good)
        )
        if same:
            line += (
                "; also better there, but by no more than inside the window (extra training, not longer "
                "context): " + "; ".join(same)
            )
    elif same:
        line = (
            head + "resolvably better than the parent with untrained YaRN only by as much as inside the window "
            "(extra training, not longer context), on " + "; ".join(same)
        )
    else:
        line = head + "NOT resolvably better than the parent with untrained YaRN"
    if rest:
        line += "; not resolved or worse: " + "; ".join(rest)
    if inside:
        line += "; inside the window the same comparison gives " + ", ".join(inside)
    return line + "."


def _train_loss(s: dict) -> str:
    """'training loss 8.41 -> 1.20 (means of the first and last 10 steps)' from the run's metrics.csv
    (a single step's loss swings with its batch: a passkey batch is near 0, a code batch near 4)."""
    from megablu.train.runs_cli import SMOOTH, _rows

    rows = _rows(Path(s["run_dir"]))
    if not rows:
        return f"loss {s['first_loss']:.2f} -> {s['last_loss']:.2f} (single steps)"
    first, last = [r["loss"] for r in rows[:SMOOTH]], [r["loss"] for r in rows[-SMOOTH:]]
    return (
        f"training loss {sum(first) / len(first):.2f} -> {sum(last) / len(last):.2f} (means of the first and "
        f"last {SMOOTH} steps)"
    )


def _fmt_cell(c: Optional[dict]) -> str:
    if c is None:
        return "-"
    lo, hi = c["ci_pp"]
    return f"{c['acc_pp']:.0f} [{lo:.0f}, {hi:.0f}]"


def summary_text(
    *,
    parent: dict,
    untrained: dict,
    ext: dict,
    window: int,
    factor: float,
    parent_run: dict,
    ext_run: dict,
    gate: str = "",
    device: str = "CPU",
) -> str:
    """The quick start's printed summary (examples/quickstart/quickstart.sh's stdout)."""
    c = claims(parent, untrained, ext, window)
    names = [("parent", parent), (f"parent + YaRN x{factor:g}, untrained", untrained), ("extension", ext)]
    w = max(len(n) for n, _ in names) + 2
    lines = [
        f"megablu quick start ({device}): a parent at window {window}, its YaRN x{factor:g} extension to "
        f"window {int(window * factor)}",
        "",
    ]
    for label, s in (("parent   ", parent_run), ("extension", ext_run)):
        lines.append(
            f"  {label} {s['run_dir']}: {s['steps']} steps, {s['tokens_seen']:,} tokens, "
            f"{_train_loss(s)}, {s['mean_tokens_per_s']:,.0f} tokens/s, "
            f"{(s.get('world') or '').split(',')[0]}"
        )
    for task in dict.fromkeys(x["task"] for x in ext["cells"]):
        lengths = sorted({x["length"] for _, r in names for x in r["cells"] if x["task"] == task})
        ns = sorted({x["n"] for _, r in names for x in r["cells"] if x["task"] == task})
        lines += [
            "",
            f"{task}: % of prompts answered exactly [95% Wilson interval], n = "
            f"{', '.join(map(str, ns))} per cell; the parent's window is {window}",
            " " * w + "".join(f"{L:>17}" for L in lengths),
        ]
        for n, r in names:
            cs = _cells(r, task)
            lines.append(f"  {n:<{w - 2}}" + "".join(f"{_fmt_cell(cs.get(L)):>17}" for L in lengths))
        row = []
        for L in lengths:
            d = c["retrieval"].get(task, {}).get(L)
            row.append(
                "-"
                if d is None
                else f"{d['diff_pp']:+.0f}{'*' if d['star'] else ''} [{d['ci_pp'][0]:+.0f}, {d['ci_pp'][1]:+.0f}]"
            )
        lines.append(f"  {'extension - untrained':<{w - 2}}" + "".join(f"{x:>17}" for x in row))
    if c["loss"]:
        lengths = sorted({L for _, r in names for L in _loss(r)})
        n = sorted({x["n"] for _, r in names for x in _loss(r).values()})
        lines += [
            "",
            f"held-out loss, nats/token: mean over {', '.join(map(str, n))} val sequences of exactly L "
            f"tokens, [95% paired interval] of the difference",
            " " * w + "".join(f"{L:>24}" for L in lengths),
        ]
        for nm, r in names:
            lo = _loss(r)
            lines.append(
                f"  {nm:<{w - 2}}" + "".join(f"{lo[L]['loss']:>24.3f}" if L in lo else f"{'-':>24}" for L in lengths)
            )
        row = []
        for L in lengths:
            d = c["loss"].get(L)
            row.append(
                "-"
                if d is None
                else f"{d['diff']:+.3f}{'*' if d['star'] else ''}"
                + (f" [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]" if d["ci"] else "")
            )
        lines.append(f"  {'extension - untrained':<{w - 2}}" + "".join(f"{x:>24}" for x in row))
    m = sum(x["p_adj"] is not None for by in (*c["retrieval"].values(), c["loss"]) for x in by.values())
    lines += [
        "",
        f"* = the difference survives Holm's correction over the {m} tested differences above (adjusted p "
        f"< 0.05; exact McNemar for retrieval, paired t over the same sequences for loss); the intervals "
        f"are unadjusted 95% (Newcombe paired, paired t)",
    ]
    if gate:
        lines += ["", "short-context gate (megablu compare --gate-parent <parent>):"] + [
            f"  {g}" for g in gate.strip().splitlines()
        ]
    lines += ["", verdict(c, factor)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 examples/quickstart/quickstart.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("passkey-docs", help="passkey training documents (the eval's template, another seed)")
    d.add_argument("--tokenizer", required=True, help="tokenizer spec, as `megablu data build --tokenizer`")
    d.add_argument(
        "--out",
        required=True,
        help="dataset directory to write (kept when it already holds this recipe, replaced otherwise)",
    )
    d.add_argument("--lengths", required=True, help="LO-HI: document lengths in tokens, drawn uniformly")
    d.add_argument("--docs", type=int, required=True, help="number of documents")
    d.add_argument(
        "--seed",
        type=int,
        required=True,
        help="key and depth seed (the eval's prompts are seeded by eval.seed and the task's name: never these)",
    )
    d.add_argument("--digits", type=int, default=5, help="digits of the key, as the eval task's `digits`")
    d.add_argument(
        "--depth",
        default="0-1",
        help="LO-HI: where the needle sits in the filler, uniformly (0 = "
        "first, 1 = last); 0-0.5 keeps every answer at least half a document away from its key",
    )
    m = sub.add_parser("summary", help="the quick start's summary from its runs and eval results (stdout)")
    m.add_argument("--parent-run", required=True, help="the parent's run dir (its summary.json)")
    m.add_argument("--ext-run", required=True, help="the extension's run dir")
    m.add_argument("--parent-eval", required=True, help="the parent's eval result (step_<N>.json or its dir)")
    m.add_argument("--untrained-eval", required=True, help="the parent evaluated with the extension's YaRN")
    m.add_argument("--ext-eval", required=True, help="the extension's eval result")
    m.add_argument("--gate", default=None, help="a file with the gate lines of `megablu compare --gate-parent`")
    m.add_argument("--device", default="CPU", help="shown in the title")
    m.add_argument("--json", default=None, help="also write the claims (claims()) as JSON to this file")
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "passkey-docs":
        lo, hi = (int(x) for x in args.lengths.split("-"))
        d0, d1 = (float(x) for x in args.depth.split("-"))
        m = passkey_docs(
            args.out,
            args.tokenizer,
            lengths=(lo, hi),
            docs=args.docs,
            seed=args.seed,
            digits=args.digits,
            depth=(d0, d1),
        )
        print(json.dumps({"out": args.out, "documents": sum(s["documents"] for s in m["shards"])}))
        return 0
    from megablu.eval.report import load_result

    res = {k: load_result(getattr(args, k)) for k in ("parent_eval", "untrained_eval", "ext_eval")}
    runs = {k: json.loads((Path(getattr(args, k)) / "summary.json").read_text()) for k in ("parent_run", "ext_run")}
    window = int(res["parent_eval"]["window"])
    factor = res["ext_eval"]["window"] / window
    gate = Path(args.gate).read_text() if args.gate and Path(args.gate).exists() else ""
    print(
        summary_text(
            parent=res["parent_eval"],
            untrained=res["untrained_eval"],
            ext=res["ext_eval"],
            window=window,
            factor=factor,
            parent_run=runs["parent_run"],
            ext_run=runs["ext_run"],
            gate=gate,
            device=args.device,
        )
    )
    if args.json:
        c = claims(res["parent_eval"], res["untrained_eval"], res["ext_eval"], window)
        Path(args.json).write_text(json.dumps(c, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
