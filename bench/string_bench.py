"""STRING attention's two kernels side by side on one GPU, at an eval's shape.

    source dev/device_env.sh && OUT=$OUT python bench/string_bench.py [--T 32744] [--shift 10922]

SmolLM2-135M's attention (9 query heads on 3 kv heads, d 64), bf16, forward only (STRING is an eval
feature), one prompt: plain causal SDPA (what an eval without STRING runs), STRING with the masked-SDPA
kernel (per 4096-row block, as `MEGABLU_STRING_IMPL=sdpa`), and STRING with the flex kernel (the default on
CUDA since 2026-12-05). Each timed with CUDA events after warm-up; the flex compile is timed apart. Also the
largest difference of each STRING kernel from an fp32 run of the sdpa kernel on the same inputs.
Prints a markdown table; writes string_bench.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# timed: the median over reps of one call's CUDA-event ms, after a warm call
from ops_bench import timed  # noqa: E402

from megablu.model.string import string_attention, string_attention_flex  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[32744, 16360])
    p.add_argument("--shift", type=int, default=10922)
    p.add_argument("--heads", default="9/3")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("string_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    H, Hk = (int(x) for x in a.heads.split("/"))
    rows = []
    for T in a.T:
        g = torch.Generator(device="cuda").manual_seed(T)
        q = torch.randn(1, T, H, a.d, device="cuda", generator=g)
        k, ks, v = (torch.randn(1, T, Hk, a.d, device="cuda", generator=g) for _ in range(3))
        ref = string_attention(q, k, ks, v, a.shift, impl="sdpa")  # fp32
        qb, kb, ksb, vb = (x.bfloat16() for x in (q, k, ks, v))
        t0 = time.perf_counter()
        out_flex = string_attention_flex(qb, kb, ksb, vb, a.shift)
        torch.cuda.synchronize()
        first_flex_s = time.perf_counter() - t0
        out_sdpa = string_attention(qb, kb, ksb, vb, a.shift, impl="sdpa")
        qt, kt, vt = (x.transpose(1, 2) for x in (qb, kb, vb))
        ms = {
            "causal_sdpa": timed(
                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True), 1, a.reps
            ),
            "string_sdpa": timed(lambda: string_attention(qb, kb, ksb, vb, a.shift, impl="sdpa"), 1, a.reps),
            "string_flex": timed(lambda: string_attention_flex(qb, kb, ksb, vb, a.shift), 1, a.reps),
        }
        rows.append(
            {
                "T": T,
                "shift": a.shift,
                "heads": a.heads,
                "d": a.d,
                "ms": ms,
                "first_flex_call_s": round(first_flex_s, 2),
                "max_abs_err_vs_fp32": {
                    "string_sdpa": (out_sdpa.float() - ref).abs().max().item(),
                    "string_flex": (out_flex.float() - ref).abs().max().item(),
                },
            }
        )
        del ref, out_flex, out_sdpa
        torch.cuda.empty_cache()
    print(
        f"STRING attention, {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 forward, "
        f"heads {a.heads}, d {a.d}, shift {a.shift}; ms per call (median of {a.reps})\n"
    )
    print(
        "| T | causal SDPA (no STRING) | STRING sdpa | STRING flex | flex / causal | sdpa / flex | first flex call s "
        "| max err sdpa / flex (vs fp32) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, e = r["ms"], r["max_abs_err_vs_fp32"]
        print(
            f"| {r['T']} | {m['causal_sdpa']:.2f} | {m['string_sdpa']:.2f} | {m['string_flex']:.2f} | "
            f"{m['string_flex'] / m['causal_sdpa']:.2f} | {m['string_sdpa'] / m['string_flex']:.2f} | "
            f"{r['first_flex_call_s']} | {e['string_sdpa']:.3g} / {e['string_flex']:.3g} |"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "string_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
