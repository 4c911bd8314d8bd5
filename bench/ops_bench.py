"""Op microbenchmarks: GB/s of the fused CUDA ops (forward, backward) against the pure-torch
reference and against the GPU's measured HBM bandwidth (a large device-to-device copy).

    source dev/device_env.sh && python bench/ops_bench.py [--T 32768 131072] [--compile]

Shapes are blu-0.5b's (d=1024, 16 heads x 64, 4 kv heads, SwiGLU 2816, bf16, B=1) unless
overridden. Bytes are the op's unavoidable traffic (each input read once, each output
written once), the same for both implementations, so GB/s compares time directly.
Backward is timed as `torch.autograd.grad` over a retained graph, for both paths.
Prints a markdown table per T (stdout) and writes ops_bench.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megablu.ops import builder  # noqa: E402
from megablu.ops.rmsnorm import add_rms_norm  # noqa: E402
from megablu.ops.rope import apply_rotary  # noqa: E402
from megablu.ops.swiglu import swiglu  # noqa: E402


def timed(fn, iters: int, reps: int = 5) -> float:
    """Median over `reps` of the mean time (ms) of `iters` back-to-back calls."""
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


def kernel_ms(fn, iters: int, by_kernel: Optional[dict] = None) -> float:
    """GPU time (ms) of the kernels one call launches, from the profiler: what the op costs
    inside a training step, where the queue is full and the host's launch time is hidden.
    `timed` measures back-to-back calls instead, which at small T is bound by the host (an
    autograd.grad call costs tens of microseconds of Python and engine time, about what a
    32k-token RoPE backward kernel takes)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    us = sum(e.device_time_total for e in kernels)
    if us <= 0:
        raise RuntimeError("the profiler recorded no kernel time")
    if by_kernel is not None:  # ms per call of each kernel: which one a miss is in
        for e in kernels:
            by_kernel[e.name[:80]] = by_kernel.get(e.name[:80], 0.0) + e.device_time_total / iters / 1e3
    return us / iters / 1e3


def hbm_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
    """GB/s of a large D2D copy (read + write counted), the practical HBM ceiling."""
    n = int(gib * 2**30) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), iters)
    x = y = None  # free both (the lambda above holds them by name)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


class Case:
    """One op at one shape: builds inputs, forward closures per impl, bytes moved."""

    def __init__(self, name, make, fwd_bytes, bwd_bytes):
        self.name, self.make, self.fwd_bytes, self.bwd_bytes = name, make, fwd_bytes, bwd_bytes


def cases(T: int, B: int, d: int, H: int, Hkv: int, D: int, ffn: int, dtype, dev: str = "cuda"):
    es = torch.tensor([], dtype=dtype).element_size()
    N = B * T

    def rope_make():
        q = torch.randn(B, T, H, D, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(B, T, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
        ang = torch.arange(T, device=dev, dtype=torch.float32)[:, None] * torch.rand(D // 2, device=dev)
        ang = torch.cat([ang, ang], -1).expand(B, T, D)
        cos, sin = (ang.cos() * 1.1).to(dtype).contiguous(), (ang.sin() * 1.1).to(dtype).contiguous()
        grads = (torch.randn_like(q), torch.randn_like(k))
        return (q, k), lambda impl: apply_rotary(q, k, cos, sin, impl=impl), grads

    def rms_make():
        x = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
        res = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
        w = torch.rand(d, device=dev, dtype=dtype).add_(0.5).requires_grad_()
        grads = (torch.randn_like(x), torch.randn_like(x))
        return (x, res, w), lambda impl: add_rms_norm(x, res, w, 1e-5, impl=impl), grads

    def swiglu_make():
        g = torch.randn(B, T, ffn, device=dev, dtype=dtype, requires_grad=True)
        u = torch.randn(B, T, ffn, device=dev, dtype=dtype, requires_grad=True)
        grads = (torch.randn_like(g),)
        return (g, u), lambda impl: (swiglu(g, u, impl=impl),), grads

    qk = N * (H + Hkv) * D * es
    table = 2 * N * D * es
    return [
        # read q,k + cos,sin; write q',k'  (backward: the same with grads)
        Case(f"rope q{H}/k{Hkv}x{D}", rope_make, 2 * qk + table, 2 * qk + table),
        # fwd: read x,res (+w); write y,r (+rstd)   bwd: read gy,gr,r (+rstd); write dr
        Case(f"add+rmsnorm d={d}", rms_make, 4 * N * d * es + 4 * N, 4 * N * d * es + 4 * N),
        # fwd: read gate,up; write out        bwd: read grad,gate,up; write dgate,dup
        Case(f"swiglu F={ffn}", swiglu_make, 3 * N * ffn * es, 5 * N * ffn * es),
    ]


def bench_case(c: Case, impl: str, iters: int, kernel: bool = False, by_kernel: Optional[list] = None):
    """(forward ms, backward ms) of one implementation: wall time of back-to-back calls, or
    with `kernel` the GPU time of their kernels (kernel_ms; by_kernel gets the forward's and
    the backward's per-kernel split)."""
    splits = ({}, {})
    if by_kernel is not None:
        by_kernel.extend(splits)

    def measure(fn, n, i):
        return kernel_ms(fn, n, splits[i]) if kernel else timed(fn, n)

    inputs, fwd, grads = c.make()
    f_ms = measure(lambda: fwd(impl), iters, 0)
    outs = fwd(impl)
    outs = outs if isinstance(outs, tuple) else (outs,)
    b_ms = measure(lambda: torch.autograd.grad(outs, inputs, grads[: len(outs)], retain_graph=True), iters, 1)
    outs = None  # free the graph (the lambda above holds it by name)
    return f_ms, b_ms


def check(c: Case) -> float:
    """max |cuda - torch| / max |torch| over forward outputs and input grads (sanity)."""
    inputs, fwd, grads = c.make()
    worst = 0.0
    res = {}
    for impl in ("cuda", "torch"):
        outs = fwd(impl)
        outs = outs if isinstance(outs, tuple) else (outs,)
        gs = torch.autograd.grad(outs, inputs, grads[: len(outs)])
        res[impl] = [o.detach().float() for o in outs] + [g.float() for g in gs]
    for a, b in zip(res["cuda"], res["torch"], strict=True):
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return worst


def compiled_case(c: Case, iters: int):
    """torch.compile of the reference expression (Inductor-fused), for context."""
    inputs, fwd, grads = c.make()
    cf = torch.compile(lambda: fwd("torch"))
    f_ms = timed(cf, iters)
    outs = cf()
    outs = outs if isinstance(outs, tuple) else (outs,)
    b_ms = timed(lambda: torch.autograd.grad(outs, inputs, grads[: len(outs)], retain_graph=True), iters)
    return f_ms, b_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=36, help="for the per-step elementwise estimate")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile of the reference (first T only: it compiles per shape)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ops_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    ext = builder.load()
    print(
        f"extension {builder.EXT_PREFIX}_{ext.source_hash()} ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr
    )
    bw = hbm_bandwidth()
    dev = torch.cuda.get_device_name()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": dev,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype),
        "hbm_copy_GBps": bw,
        "shapes": vars(args),
        "rows": [],
        "per_step": [],
    }
    print(f"# op microbenchmarks ({dev}, torch {torch.__version__}, bf16, B={args.B})\n")
    print(f"Measured HBM bandwidth (D2D copy, 4 GiB): **{bw:.0f} GB/s**\n")
    for T in args.T:
        print(f"## T = {T}\n")
        hdr = (
            "| op | dir | MB | cuda ms | cuda GB/s | % HBM | kernel ms | kernel % HBM | torch ms | torch GB/s "
            "| speedup |"
        )
        if args.compile:
            hdr += " compile ms | compile GB/s |"
        print(hdr)
        print("|" + "---|" * (hdr.count("|") - 1))
        step = {"T": T, "cuda_ms": 0.0, "torch_ms": 0.0, "compile_ms": 0.0}
        for c in cases(T, args.B, args.d, args.heads, args.kv_heads, args.head_dim, args.ffn, dtype):
            try:
                err = check(c)
                cu = bench_case(c, "cuda", args.iters)
                tr = bench_case(c, "torch", args.iters)
                splits: list = []
                try:
                    ku = bench_case(c, "cuda", args.iters, kernel=True, by_kernel=splits)
                except Exception as e:  # noqa: BLE001 - the profiler column is context; keep the row
                    print(f"<!-- kernel time of {c.name} not measured: {type(e).__name__}: {e} -->")
                    ku, splits = (float("nan"), float("nan")), [{}, {}]
            except Exception as e:  # noqa: BLE001 - one op failing must not hide the others
                print(f"| {c.name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} |")
                result["rows"].append({"T": T, "op": c.name, "error": f"{type(e).__name__}: {e}"})
                continue
            co = None
            if args.compile and T == args.T[0]:  # Inductor compiles per shape: first T only
                try:
                    co = compiled_case(c, args.iters)
                except Exception as e:  # noqa: BLE001 - context column only; never fail the bench
                    print(f"<!-- torch.compile failed for {c.name}: {type(e).__name__}: {e} -->")
            # per layer: 2 norms, 1 rope, 1 swiglu
            mult = args.layers * (2 if "rmsnorm" in c.name else 1)
            for i, (direction, nbytes) in enumerate((("fwd", c.fwd_bytes), ("bwd", c.bwd_bytes))):
                gbs = nbytes / (cu[i] * 1e-3) / 1e9
                tgbs = nbytes / (tr[i] * 1e-3) / 1e9
                row = {
                    "T": T,
                    "op": c.name,
                    "dir": direction,
                    "MB": nbytes / 1e6,
                    "cuda_ms": cu[i],
                    "cuda_GBps": gbs,
                    "pct_hbm": 100 * gbs / bw,
                    "kernel_ms": ku[i],
                    "kernel_pct_hbm": 100 * nbytes / (ku[i] * 1e-3) / 1e9 / bw,
                    "torch_ms": tr[i],
                    "torch_GBps": tgbs,
                    "speedup": tr[i] / cu[i],
                    "max_rel_err_vs_torch": err,
                    "kernels_ms": splits[i],
                }
                line = (
                    f"| {c.name} | {direction} | {nbytes / 1e6:.0f} | {cu[i]:.3f} | {gbs:.0f} | "
                    f"{100 * gbs / bw:.0f}% | {ku[i]:.3f} | {row['kernel_pct_hbm']:.0f}% | {tr[i]:.3f} | "
                    f"{tgbs:.0f} | {tr[i] / cu[i]:.2f}x |"
                )
                if co is not None:
                    row.update(compile_ms=co[i], compile_GBps=nbytes / (co[i] * 1e-3) / 1e9)
                    line += f" {co[i]:.3f} | {row['compile_GBps']:.0f} |"
                    step["compile_ms"] += mult * co[i]
                elif args.compile:
                    line += " - | - |"
                print(line)
                if len(splits[i]) > 1:
                    print(
                        f"<!-- {c.name} {direction} kernels (ms per call): "
                        + ", ".join(f"{k} {v:.3f}" for k, v in sorted(splits[i].items(), key=lambda kv: -kv[1]))
                        + " -->"
                    )
                result["rows"].append(row)
                step["cuda_ms"] += mult * cu[i]
                step["torch_ms"] += mult * tr[i]
            print(f"<!-- {c.name}: max rel err cuda vs torch (outputs and grads) {err:.2e} -->")
            save(result)
        result["per_step"].append(step)
        save(result)
        print(
            f"\nElementwise ops per training step ({args.layers} layers x (2 norms + rope + swiglu), fwd+bwd, "
            f"no recompute): cuda {step['cuda_ms']:.1f} ms, torch {step['torch_ms']:.1f} ms"
            + (f", torch.compile {step['compile_ms']:.1f} ms" if step["compile_ms"] else "")
            + "\n"
        )
    save(result)
    return 0


def save(result: dict) -> None:
    """ops_bench.json under $OUT (rewritten after every op, so a timeout keeps what ran)."""
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "ops_bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
