"""Speed of document-causal attention (data.doc_mask) against plain causal SDPA, fwd+bwd, on one GPU.

    python bench/doc_mask_bench.py                      # T 32768, 16384, 65536; heads 9/3 and 16/4
    python bench/doc_mask_bench.py --T 32768 --heads 16/4 --budget 60

Shapes: B=1, d=64, bf16; heads 9/3 (SmolLM2-135M) and 16/4 (blu-0.5b). Document mixes of a
row of T tokens (seeded): `one` (a single T-token document: the kernel's overhead over plain
causal), `60/40` (60% of the tokens in one long document, 40% in 1-4k documents, ProLong's
mix), `short` (all documents 1-4k). Kernels: megablu.ops.doc_attention's `flex` (compiled
FlexAttention, the training default on CUDA) and `varlen` (FA2 varlen via
torch.nn.attention.varlen), against F.scaled_dot_product_attention(is_causal=True) -- what
LocalAttention runs when doc_mask is off -- with the default backend and with cuDNN and flash
forced. Per row: fwd ms, fwd+bwd ms (median of 3 x `--iters` calls), speedup over causal SDPA
(fwd+bwd), effective TF/s of the document-causal work (2 L^2 H D flops per document forward,
fwd+bwd = 3x fwd as experiments/speed/LOG.md), the DocMask build time per step (block mask / cu_seqlens
from doc ids), compile + first call (s: flex compiles once per shape; training pays it once),
and max |out - per-document SDPA| of the forward (bf16).

Robust by construction: every row runs in its own try/except (an error or OOM is written in
its row), rows run in priority order (T=32768 first) and stop when `--budget` seconds have
passed (the rest are listed as skipped), and the table is rewritten after every row, so a
killed call still leaves what it measured. Writes $OUT/doc_mask_bench.{md,json} (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megablu.ops.doc_attention import DocMask, doc_attention  # noqa: E402

D = 64
MIXES = ("one", "60/40", "short")


def mix_lengths(T: int, mix: str, seed: int = 0) -> list[int]:
    """Document lengths of one packed row of T tokens."""
    rng = random.Random(f"{seed}-{T}-{mix}")
    if mix == "one":
        return [T]

    def shorts(n):
        out = []
        while sum(out) < n:
            out.append(rng.randint(1024, 4096))
        out[-1] -= sum(out) - n
        return [x for x in out if x > 0]

    if mix == "short":
        return shorts(T)
    long = int(0.6 * T)
    docs = shorts(T - long)
    docs.insert(rng.randint(0, len(docs)), long)
    return docs


def doc_ids_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(lengths)])[None].cuda()


def timed(fn, iters: int, reps: int = 3) -> float:
    """Median over reps of the mean ms of `iters` back-to-back calls (after one warm call)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


def first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def sdpa_fn(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        if backend is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=qt.shape[1] != kt.shape[1])
        else:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=qt.shape[1] != kt.shape[1])
        return o.transpose(1, 2)

    return run


@torch.no_grad()
def per_document_ref(q, k, v, lengths):
    out, s = torch.empty_like(q), 0
    for n in lengths:
        qd, kd, vd = (x[:, s : s + n].transpose(1, 2) for x in (q, k, v))
        out[:, s : s + n] = F.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, enable_gqa=qd.shape[1] != kd.shape[1]
        ).transpose(1, 2)
        s += n
    return out


def measure(fn, q, k, v, iters):
    g = torch.randn_like(q)

    def fwd():
        fn(q, k, v)  # with grad, as in training (a no_grad call would compile flex a second time)

    def fwd_bwd():
        torch.autograd.grad(fn(q, k, v), (q, k, v), g)

    first = first_call_s(fwd_bwd)  # compile (flex) + first fwd+bwd
    return first, timed(fwd, iters), timed(fwd_bwd, iters)


def fmt(x, f="{:.2f}"):
    return "" if x is None else f.format(x)


def write(rows, out: Path, meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "doc_mask_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    head = [
        "heads",
        "T",
        "mix (docs)",
        "kernel",
        "fwd ms",
        "fwd+bwd ms",
        "vs causal SDPA",
        "eff. TF/s",
        "mask ms",
        "compile+1st s",
        "max|Δ| fwd",
        "note",
    ]
    lines = [
        f"# doc-mask attention vs causal SDPA ({meta['device']}, torch {meta['torch']}, bf16, B=1, d={D})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["heads"],
                    str(r["T"]),
                    f"{r['mix']} ({r.get('n_docs', '')})",
                    r["kernel"],
                    fmt(r.get("fwd_ms")),
                    fmt(r.get("fwd_bwd_ms")),
                    fmt(r.get("speedup"), "{:.2f}x"),
                    fmt(r.get("tflops"), "{:.0f}"),
                    fmt(r.get("mask_ms"), "{:.3f}"),
                    fmt(r.get("first_s"), "{:.1f}"),
                    fmt(r.get("max_diff"), "{:.1e}"),
                    r.get("note", ""),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "speedup = causal SDPA (default backend) fwd+bwd / this kernel's; eff. TF/s counts only the "
        "document-causal work (sum of 2 L^2 H D per document forward, x3 for fwd+bwd); compile+1st: the "
        "first fwd+bwd call of this shape (flex compiles once per shape). In training a batch whose rows "
        "are each one document takes causal SDPA (DocMask auto), so the `one` rows of flex/varlen are the "
        "kernels' overhead, not what such a step costs.",
    ]
    (out / "doc_mask_bench.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 16384, 65536], help="in priority order")
    ap.add_argument("--heads", nargs="+", default=["16/4", "9/3"])
    ap.add_argument("--kernels", nargs="+", default=["flex", "varlen"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--budget", type=float, default=110.0, help="seconds; later rows are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("doc_mask_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    out, t0 = Path(a.out), time.perf_counter()
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # one flex compile per (heads, T): more than 8
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, 64)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "budget_s": a.budget}
    rows: list[dict] = []
    torch.manual_seed(0)

    def row(**kw):
        rows.append(kw)
        write(rows, out, meta)
        print(json.dumps(kw), file=sys.stderr, flush=True)

    for T in a.T:
        for heads in a.heads:
            H, Hkv = (int(x) for x in heads.split("/"))
            base = dict(heads=heads, T=T)
            if time.perf_counter() - t0 > a.budget:
                row(**base, mix="-", kernel="all", note="skipped: budget")
                continue
            try:
                q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            except Exception as e:  # noqa: BLE001
                row(**base, mix="-", kernel="all", note=f"inputs: {type(e).__name__}: {e}"[:200])
                continue
            causal_ms = None
            for name, backend in (
                ("sdpa causal", None),
                ("sdpa causal cudnn", "CUDNN_ATTENTION"),
                ("sdpa causal flash", "FLASH_ATTENTION"),
            ):
                try:
                    first, f_ms, fb_ms = measure(sdpa_fn(backend), q, k, v, a.iters)
                    causal_ms = fb_ms if backend is None else causal_ms
                    row(
                        **base,
                        mix="one",
                        n_docs=1,
                        kernel=name,
                        fwd_ms=f_ms,
                        fwd_bwd_ms=fb_ms,
                        speedup=causal_ms / fb_ms if causal_ms else None,
                        tflops=3 * 2 * T * T * H * D / fb_ms / 1e9,
                        first_s=first,
                    )
                except Exception as e:  # noqa: BLE001
                    row(**base, mix="one", kernel=name, note=f"{type(e).__name__}: {str(e).splitlines()[0]}"[:200])
                torch.cuda.empty_cache()
            for mix in MIXES:
                lengths = mix_lengths(T, mix)
                flops = 3 * sum(2 * n * n * H * D for n in lengths)
                try:
                    doc = doc_ids_of(lengths)
                    ref = per_document_ref(q, k, v, lengths)
                except Exception as e:  # noqa: BLE001
                    row(**base, mix=mix, kernel="reference", note=f"{type(e).__name__}: {e}"[:200])
                    continue
                for kern in a.kernels:
                    if time.perf_counter() - t0 > a.budget:
                        row(**base, mix=mix, n_docs=len(lengths), kernel=kern, note="skipped: budget")
                        continue
                    try:
                        m = DocMask(doc, impl=kern)
                        torch.cuda.synchronize()
                        mask_ms = timed(lambda: DocMask(doc, impl=kern), 3)
                        fn = lambda q_, k_, v_, m=m: doc_attention(q_, k_, v_, m)  # noqa: E731
                        first, f_ms, fb_ms = measure(fn, q, k, v, a.iters)
                        with torch.no_grad():
                            diff = (fn(q, k, v).float() - ref.float()).abs().max().item()
                        row(
                            **base,
                            mix=mix,
                            n_docs=len(lengths),
                            kernel=kern,
                            fwd_ms=f_ms,
                            fwd_bwd_ms=fb_ms,
                            speedup=causal_ms / fb_ms if causal_ms else None,
                            tflops=flops / fb_ms / 1e9,
                            mask_ms=mask_ms,
                            first_s=first,
                            max_diff=diff,
                        )
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        row(
                            **base,
                            mix=mix,
                            n_docs=len(lengths),
                            kernel=kern,
                            note=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200],
                        )
                    torch.cuda.empty_cache()
            del q, k, v
            torch.cuda.empty_cache()
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    write(rows, out, meta)
    print((out / "doc_mask_bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
