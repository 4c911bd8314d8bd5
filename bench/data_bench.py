"""Data benchmarks: tokenizer throughput and loader batches/s.

    python bench/data_bench.py tokenize --input DIR --include '*.py' [--max-bytes 8M]
    python bench/data_bench.py loader --data data_cache/demo_cl100k --tokenizer tiktoken:cl100k_base \
        --window 32768 [--mode pack] [--bucket all] [--batches 200]

Results are Markdown table rows on stdout (for experiments/speed/LOG.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cpu() -> float:
    """CPU seconds of this process (all threads) and its finished children: robust to a shared, loaded box."""
    import resource

    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def bench_tokenize(args) -> None:
    from megablu.data.build import Source, iter_documents, tokenize_stream
    from megablu.data.tokenizer import load_tokenizer, parse_tokenizer_spec

    docs = list(
        iter_documents([Source(args.input, include=args.include, exclude=args.exclude)], max_bytes=args.max_bytes)
    )
    texts = []
    for d in docs:
        try:
            texts.append(Path(d.path).read_text("utf-8"))
        except UnicodeDecodeError:
            pass
    nbytes = sum(len(t.encode()) for t in texts)
    print("| tokenizer | workers | MB of text | tokens | wall s | MB/s (wall) | CPU s | MB per CPU-s | bytes/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.tokenizer:
        cfg = parse_tokenizer_spec(spec)
        load_tokenizer(cfg)  # seed caches outside the timing
        for w in args.workers:
            from megablu.data.build import Doc

            items = [Doc(key=str(i), path="", text=t) for i, t in enumerate(texts)]
            t0, c0 = time.perf_counter(), _cpu()
            n = sum(len(ids) for _, ids, _, _ in tokenize_stream(items, cfg, w))
            dt, cpu = time.perf_counter() - t0, _cpu() - c0
            print(
                f"| {spec} | {w} | {nbytes / 1e6:.1f} | {n:,} | {dt:.2f} | {nbytes / 1e6 / dt:.2f} | "
                f"{cpu:.2f} | {nbytes / 1e6 / cpu:.2f} | {nbytes / n:.2f} |",
                flush=True,
            )


def bench_loader(args) -> None:
    from megablu.config.schema import DataConfig
    from megablu.data.loader import build_loader
    from megablu.data.tokenizer import load_tokenizer, parse_tokenizer_spec

    ident = load_tokenizer(parse_tokenizer_spec(args.tokenizer)).identity
    print("| data | bucket | mode | T | micro_batch | prefetch | batches | batches/s (wall) | CPU ms/batch |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for mode in args.mode:
        for pf in args.prefetch:
            cfg = DataConfig(
                path=args.data, window=args.window, mode=mode, bucket=args.bucket, prefetch=pf, max_epochs=1e9
            )
            L = build_loader(cfg, ident, micro_batch=args.micro_batch, dp_rank=0, dp_size=1)
            L.next_batch()  # thread start, first epoch permutation
            t0, c0 = time.perf_counter(), _cpu()
            for _ in range(args.batches):
                L.next_batch()
            dt = time.perf_counter() - t0
            L.close()
            cpu = _cpu() - c0
            print(
                f"| {Path(args.data).name} | {args.bucket} | {mode} | {args.window} | {args.micro_batch} | {pf} | "
                f"{args.batches} | {args.batches / dt:,.1f} | {1000 * cpu / args.batches:.2f} |",
                flush=True,
            )


def main(argv=None) -> None:
    from megablu.data.cli import _size

    p = argparse.ArgumentParser(prog="python bench/data_bench.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--input", required=True)
    t.add_argument("--include", action="append", default=[])
    t.add_argument("--exclude", action="append", default=[])
    t.add_argument("--max-bytes", type=_size, default=8 << 20)
    t.add_argument(
        "--tokenizer",
        action="append",
        default=None,
        help="repeatable; default byte, tiktoken_file:megablu:stdlib4k, cl100k, o200k",
    )
    t.add_argument("--workers", type=int, action="append", default=None)
    t.set_defaults(func=bench_tokenize)
    lo = sub.add_parser("loader")
    lo.add_argument("--data", required=True)
    lo.add_argument("--tokenizer", required=True)
    lo.add_argument("--window", type=int, default=32768)
    lo.add_argument("--bucket", default="all")
    lo.add_argument("--mode", action="append", default=None)
    lo.add_argument("--prefetch", type=int, action="append", default=None)
    lo.add_argument("--micro-batch", type=int, default=1)
    lo.add_argument("--batches", type=int, default=200)
    lo.set_defaults(func=bench_loader)
    import logging
    import sys

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    a = p.parse_args(argv)
    if a.cmd == "tokenize":
        a.tokenizer = a.tokenizer or [
            "byte",
            "tiktoken_file:megablu:stdlib4k",
            "tiktoken:cl100k_base",
            "tiktoken:o200k_base",
        ]
        a.workers = a.workers or [1, 2]
    else:
        a.mode = a.mode or ["pack"]
        a.prefetch = a.prefetch if a.prefetch is not None else [0, 4]
    a.func(a)


if __name__ == "__main__":
    main()
