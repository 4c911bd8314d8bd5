"""Eval speed: prompts per second per task and length through megablu's own run_eval (issue 15,
item 4), and the generation path before this change (torch.cat KV cache, 2048-token prefill
chunks, 16k-token batches, no EOT stop) on one cell, side by side.

  # SmolLM2-135M (a dir with config.json + BluModel-named model.safetensors, e.g. the output of
  # `dev/smollm2_pieces.py convert`), YaRN x4 from the config, at 4k and 32k:
  python bench/eval_bench.py --config experiments/ruler_baselines/rep_smollm2_32k.yaml \\
      --ckpt /tmp/smollm2_blu --arm smollm2
  # blu-0.5b's shape with random weights (speed does not depend on the weights; EOT never comes):
  python bench/eval_bench.py --config configs/base.yaml --random --set data.window=32768 \\
      --set 'rope.yarn={factor: 2.0, original_max_position: 16384}' --arm blu-0.5b

Haystack for the real-text tasks: the Python stdlib sources of the machine (the text does not
change the speed). Writes $OUT/eval_bench_<arm>.md and .json (OUT defaults to /tmp/eval_bench);
the table goes to stdout, logs to stderr. --n prompts per cell (the headline cell, --cell, gets
--n-cell). Budget (H200, SmolLM2): ~3-4 min with the defaults; blu-0.5b ~4-5 min.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("eval_bench")
STDLIB_DOCS = (
    "difflib.py",
    "textwrap.py",
    "argparse.py",
    "inspect.py",
    "pydoc.py",
    "typing.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "fractions.py",
    "string.py",
    "shlex.py",
    "heapq.py",
    "bisect.py",
)


def haystack_docs() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text() for f in STDLIB_DOCS if (root / f).is_file()]


def load_model(cfg, args, tok):
    from megablu.model.decoder import BluModel

    model = BluModel(cfg.model, cfg.rope, seed=0 if args.random else None)
    if not args.random:
        from megablu.checkpoint import load_weights

        load_weights(model, args.ckpt, tokenizer=tok.identity)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return model.to(device=dev, dtype=dtype).eval(), dev


def legacy_generation():
    """Context: the generation path as it was (plain KVCache with torch.cat, no EOT stop)."""
    import contextlib

    from megablu.eval import generate
    from megablu.model.decoder import KVCache

    @contextlib.contextmanager
    def ctx():
        new_cache, greedy = generate.new_cache, generate.greedy_generate
        generate.new_cache = lambda model, capacity, rope_len, seq_sharded=False: KVCache(
            model.cfg.n_layers, seq_sharded=seq_sharded
        )

        def no_stop(*a, **k):
            k["stop_ids"] = ()
            return greedy(*a, **k)

        import megablu.eval.harness as h

        old_h = h.greedy_generate
        h.greedy_generate = no_stop
        try:
            yield
        finally:
            generate.new_cache, h.greedy_generate = new_cache, old_h

    return ctx()


def run(args) -> int:
    from megablu.config import load_config
    from megablu.data.tokenizer import load_tokenizer
    from megablu.eval.harness import run_eval

    cfg = load_config(args.config, args.set)
    tok = load_tokenizer(cfg.tokenizer)
    model, dev = load_model(cfg, args, tok)
    out = Path(os.environ.get("OUT", "/tmp/eval_bench"))
    out.mkdir(parents=True, exist_ok=True)
    docs = haystack_docs()
    window = cfg.data.window
    rows = []

    def cell(task, L, n, legacy=False, **kw):
        e = cfg.eval.model_copy(
            update={
                "tasks": [task],
                "lengths": [L],
                "n": n,
                "gate": cfg.eval.gate.model_copy(update={"parent": None}),
                "loss": cfg.eval.loss.model_copy(update={"data": None}),
                "haystack": None,
            }
        )
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        bt = kw.pop("batch_tokens", args.batch_tokens)
        pc = kw.pop("prefill_chunk", args.prefill_chunk)
        run_eval(
            model,
            tok,
            e,
            window,
            step=0,
            out_dir=out / "runs" / f"{task}_{L}_{int(legacy)}",
            rank=0,
            haystack=docs,
            batch_tokens=bt,
            prefill_chunk=pc,
            plot=False,
            arm=args.arm,
        )
        dt = time.perf_counter() - t0
        r = {
            "task": task,
            "length": L,
            "n": n,
            "seconds": round(dt, 2),
            "prompts_per_s": round(n / dt, 3),
            "path": "before (cat cache, 2k chunks, 16k batch, no EOT stop)" if legacy else "now",
            "batch_tokens": bt,
            "prefill_chunk": pc,
            "max_new": e.task_max_new(task),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev.type == "cuda" else None,
        }
        rows.append(r)
        log.info("%s", r)
        (out / f"eval_bench_{args.arm}.json").write_text(json.dumps(rows, indent=1))
        return r

    t_start = time.perf_counter()
    lengths = [L for L in args.lengths if L + 256 <= window] or [min(args.lengths)]
    # warm-up (CUDA context, kernels) on a tiny cell, not timed in the table
    cell(args.tasks[0], min(lengths), 2)
    rows.clear()
    for L in lengths:
        for task in args.tasks:
            if time.perf_counter() - t_start > args.budget_s:
                log.warning("budget %ds spent: skipping the rest", args.budget_s)
                break
            cell(task, L, args.n_cell if (task, L) == (args.cell_task, max(lengths)) else args.n)
    if args.legacy_n and time.perf_counter() - t_start < args.budget_s:
        with legacy_generation():
            cell(args.cell_task, max(lengths), args.legacy_n, legacy=True, batch_tokens=16384, prefill_chunk=2048)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    md = [
        f"### eval speed: {args.arm} ({cfg.model.n_layers} layers, d={cfg.model.d_model}, "
        f"{'random weights' if args.random else args.ckpt}), {gpu}",
        "",
        "| task | length | n | max_new | path | s | prompts/s | 200-prompt cell (min) | peak GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['task']} | {r['length']} | {r['n']} | {r['max_new']} | {r['path']} | {r['seconds']} | "
            f"{r['prompts_per_s']} | {200 / r['prompts_per_s'] / 60:.1f} | {r['peak_gb']} |"
        )
    md += [
        "",
        f"batch_tokens {args.batch_tokens}, prefill_chunk {args.prefill_chunk} (0 = whole prompt), "
        f"{next(model.parameters()).dtype}, greedy; building the prompts (CPU) is included in the time.",
    ]
    text = "\n".join(md)
    (out / f"eval_bench_{args.arm}.md").write_text(text + "\n")
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--ckpt", help="weights: a dir with model.safetensors (+ config.json) or a megablu checkpoint")
    g.add_argument("--random", action="store_true", help="random weights of the config's shape")
    p.add_argument("--arm", default="model")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32000])
    p.add_argument(
        "--tasks",
        nargs="+",
        default=["passkey", "niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multivalue", "vt", "cwe", "fwe"],
    )
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--cell-task", default="niah_single_1")
    p.add_argument("--n-cell", type=int, default=200, help="prompts of the headline cell (cell-task at the longest)")
    p.add_argument("--legacy-n", type=int, default=16, help="prompts of the before-this-change cell (0 = skip)")
    p.add_argument("--batch-tokens", type=int, default=262144)
    p.add_argument("--prefill-chunk", type=int, default=0)
    p.add_argument("--budget-s", type=int, default=420)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
