"""Evaluation decode speed: prompts/s and ms per decode step of megablu's greedy_generate, one row per
(length, decode mode), the modes side by side in one run on the same prompts (issue 43, item 2).

  # SmolLM2-135M's shape (random weights: the speed does not depend on them), the RULER suite's lengths,
  # batches as `megablu eval` makes them on a GPU (max(1, 262144 // L) rows), 128-token answers (cwe),
  # before (eager) vs after (graph):
  python bench/eval_decode.py --lengths 8192 16384 32768 --max-new 128 --modes eager graph --json $OUT/decode.json
  # a CPU smoke run at small sizes:
  python bench/eval_decode.py --model tiny --lengths 256 1024 --max-new 16 --batches 1 --modes eager static

Modes (megablu/eval/decode.py): eager = the step as it was before the change (the model's forward over the
growing cache; the before column), static = the step with its state in device buffers, uncaptured, graph =
static captured as CUDA graphs around each layer's attention and replayed (what `megablu eval` runs on a GPU:
decode=auto). The stop id passed is outside the vocabulary (checked for as `megablu eval` checks for the
tokenizer's, never emitted), so every mode decodes all max_new tokens: ms/step is the step's own cost; "of
which attention" times the attention calls alone (one layer's, x n_layers), the part no mode changes. Prefill
is timed apart (max_new=1) and is the same code in every mode. `agree` is the share of generated tokens equal
to the first mode's (1.0: token for token the same, as tests/eval/test_decode.py asserts on a GPU).

stdout: the table (markdown); stderr: logs. --json PATH also writes the rows with the device, torch version
and the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("eval_decode")

MODELS = {  # ModelConfig fields; rope theta; YaRN (factor, original_max_position)
    "smollm2-135m": (
        dict(
            n_layers=30,
            d_model=576,
            n_heads=9,
            n_kv_heads=3,
            head_dim=64,
            ffn_dim=1536,
            vocab_size=49152,
            tie_embeddings=True,
            norm_eps=1e-5,
        ),
        100000.0,
        (4.0, 8192),
    ),
    "tiny": (dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512), 10000.0, (4.0, 256)),
}


def build_model(name: str, beyond: bool, device: torch.device, dtype: torch.dtype):
    from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
    from megablu.model.decoder import BluModel

    fields, theta, (factor, orig) = MODELS[name]
    yarn = YarnConfig(factor=factor, original_max_position=orig, apply="beyond_original" if beyond else "always")
    model = BluModel(ModelConfig(**fields), RopeConfig(theta=theta, yarn=yarn), seed=0)
    return model.to(device=device, dtype=dtype).eval()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def attention_ms(model, B: int, L: int, dev, dtype, reps: int = 20) -> float:
    """ms per decode step spent in attention alone: one layer's LocalAttention call for a one-token query over
    L cached keys (views of a preallocated buffer, as StaticKVCache hands them), timed, x n_layers."""
    cfg = model.cfg
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    q = torch.randn(B, 1, H, D, device=dev, dtype=dtype)
    kb = torch.randn(B, L + 1, Hkv, D, device=dev, dtype=dtype)
    vb = torch.randn(B, L + 1, Hkv, D, device=dev, dtype=dtype)
    local = model.layers[0].self_attn.core
    local._plain(q, kb[:, :L], vb[:, :L])
    dt, _ = timed(lambda: [local._plain(q, kb[:, :L], vb[:, :L]) for _ in range(reps)], dev)
    return 1e3 * dt / reps * cfg.n_layers


def run(args) -> list[dict]:
    from megablu.eval.generate import greedy_generate

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    model = build_model(args.model, args.beyond_original, dev, dtype)
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (0 if dev.type == "cuda" else 2048)
    vocab = model.cfg.vocab_size
    rows = []
    batch_tokens = args.batch_tokens or (262144 if dev.type == "cuda" else 16384)
    for L in args.lengths:
        B = args.batch or max(1, batch_tokens // L)
        attn = attention_ms(model, B, L, dev, dtype)
        gen = torch.Generator().manual_seed(L)
        batches = [torch.randint(0, vocab, (B, L), generator=gen) for _ in range(args.batches + 1)]

        def generate(x, max_new, mode):
            # a stop id that never comes (outside the vocabulary), as `megablu eval` passes the tokenizer's: the
            # steps check for it as they do there (eager: on the host at every step)
            return greedy_generate(model, x, max_new, prefill_chunk=chunk, decode=mode, stop_ids=(vocab,))

        first = None
        for mode in args.modes:
            generate(batches[0], args.max_new, mode)  # warm-up: lazy inits, kernels picked
            t_pre, t_all, outs = 0.0, 0.0, []
            for x in batches[1:]:
                t_pre += timed(lambda: generate(x, 1, mode), dev)[0]
                dt, out = timed(lambda: generate(x, args.max_new, mode), dev)
                t_all += dt
                outs.append(out.cpu())
            out = torch.cat(outs)
            first = out if first is None else first
            n = B * args.batches
            step_ms = 1e3 * (t_all - t_pre) / (args.batches * max(1, args.max_new - 1))
            rows.append(
                {
                    "length": L,
                    "batch": B,
                    "max_new": args.max_new,
                    "mode": mode,
                    "prompts": n,
                    "prompts_per_s": n / t_all,
                    "prefill_ms": 1e3 * t_pre / args.batches,
                    "decode_ms_per_step": step_ms,
                    "attention_ms_per_step": attn,
                    "agree": float((out == first).float().mean()),
                }
            )
            log.info("L=%d B=%d %s: %.2f prompts/s, %.2f ms/step", L, B, mode, rows[-1]["prompts_per_s"], step_ms)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["length"]: r for r in reversed(rows)}  # each length's first mode
    lines = [
        "| length | batch | mode | prompts/s | prefill ms/batch | decode ms/step | of which attention | "
        "step speed-up | agree |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        up = base[r["length"]]["decode_ms_per_step"] / max(r["decode_ms_per_step"], 1e-9)
        lines.append(
            f"| {r['length']} | {r['batch']} | {r['mode']} | {r['prompts_per_s']:.2f} | "
            f"{r['prefill_ms']:.1f} | {r['decode_ms_per_step']:.3f} | {r['attention_ms_per_step']:.3f} | "
            f"{up:.2f}x | {r['agree']:.4f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m", help="the shape (random weights)")
    p.add_argument(
        "--beyond-original",
        action="store_true",
        help="rope.yarn.apply=beyond_original (the rope picked per sequence from its length)",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="prompt lengths")
    p.add_argument("--max-new", type=int, default=128, help="tokens generated per prompt (cwe's answer: 128)")
    p.add_argument("--batch", type=int, help="rows per batch (default: max(1, batch-tokens // length))")
    p.add_argument(
        "--batch-tokens", type=int, help="default: `megablu eval`'s, 262144 on a GPU (8 prompts of 32k), 16384 on a CPU"
    )
    p.add_argument("--batches", type=int, default=3, help="timed batches per (length, mode), after one warm-up")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["eager", "graph"],
        choices=["eager", "static", "graph", "auto"],
        help="decode modes, the first is the baseline",
    )
    p.add_argument("--prefill-chunk", type=int, help="default: the whole prompt on a GPU, 2048 on a CPU")
    p.add_argument("--device", help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--json", help="also write the rows, device and versions here")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    rows = run(args)
    print(table(rows))
    if args.json:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
        Path(args.json).write_text(
            json.dumps(
                {"command": " ".join(sys.argv), "device": dev, "torch": torch.__version__, "rows": rows}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
