"""The add+RMSNorm backward kernel's two paths, side by side on one GPU.

    source dev/device_env.sh && OUT=$OUT python bench/rmsnorm_bwd_variants.py [--T 32768 131072]

The extension is built once (megablu.ops.builder, as training loads it); each variant is then
measured in its own process, one after another, with MEGABLU_RMS_BWD_ASYNC set to force its
path (the kernel reads the variable once per process). A variant's row: the backward
kernel's GPU time from the profiler, its % of the HBM copy bandwidth measured in the same
process (bytes as bench/ops_bench.py: read gy, grad_r, r, rstd; write dr), and whether dr and
dw are bitwise equal to the first variant's (a variant moves loads, never the arithmetic).

Variants: the register path, and the cp.async path (rows staged through shared memory; see
csrc/rmsnorm/rmsnorm_kernel.cu), which is the default where the GPU has the shared memory
for it. Forcing it where it does not fit fails that variant with the binding's message. Two
earlier knobs, an L2 prefetch of the next row and grad_r loaded early, were measured slower
on 2026-12-03 and removed (experiments/speed/LOG.md).
Prints a markdown table; writes rmsnorm_bwd_variants.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# name -> the environment that forces its path; the first is the reference for the bitwise check
VARIANTS = {"registers": {"MEGABLU_RMS_BWD_ASYNC": "0"}, "async": {"MEGABLU_RMS_BWD_ASYNC": "1"}}


def build():
    """The extension, as megablu loads it (torch's extension cache keeps it for measure())."""
    from megablu.ops import builder

    return builder.load()


def measure(name: str, Ts: list[int], d: int, ref_dir: Path) -> list[dict]:
    import torch
    from ops_bench import hbm_bandwidth, kernel_ms

    for k, v in VARIANTS[name].items():  # set by main() for this process
        assert os.environ.get(k) == v, f"variant {name} needs {k}={v} in its environment, got {os.environ.get(k)!r}"
    ext = build()
    bw = hbm_bandwidth()
    rows = []
    for T in Ts:
        g = torch.Generator(device="cuda").manual_seed(T)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        gy, gr, r = mk(T, d), mk(T, d), mk(T, d)
        w = (torch.rand(d, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        rstd = torch.rand(T, device="cuda", generator=g) + 0.5
        dr, dw = ext.rmsnorm_bwd(gy, gr, r, w, rstd)
        split: dict = {}
        ms = kernel_ms(lambda: ext.rmsnorm_bwd(gy, gr, r, w, rstd), 50, split)
        kern = max(split, key=split.get)  # the backward kernel itself (the dw sum is another)
        nbytes = 4 * T * d * 2 + 4 * T
        ref = ref_dir / f"T{T}.pt"
        if not ref.exists():
            torch.save({"dr": dr.cpu(), "dw": dw.cpu()}, ref)
        want = torch.load(ref)
        rows.append(
            {
                "variant": name,
                "env": VARIANTS[name],
                "T": T,
                "hbm_GBps": bw,
                "ms": ms,
                "kernel_ms": split[kern],
                "pct_hbm": 100 * nbytes / (ms * 1e-3) / 1e9 / bw,
                "kernel_pct_hbm": 100 * nbytes / (split[kern] * 1e-3) / 1e9 / bw,
                "bitwise_equal": bool(torch.equal(dr.cpu(), want["dr"]) and torch.equal(dw.cpu(), want["dw"])),
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ref-dir", default="/tmp/rmsvar_ref", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.build_only:
        build()
        return 0
    if a.one:
        print(json.dumps(measure(a.one, a.T, a.d, Path(a.ref_dir))))
        return 0

    ref_dir = Path(a.ref_dir)
    ref_dir.mkdir(parents=True, exist_ok=True)
    for f in ref_dir.glob("*.pt"):
        f.unlink()
    t0 = time.time()
    built = subprocess.run([sys.executable, __file__, "--build-only"]).returncode == 0
    failed = [] if built else list(VARIANTS)
    print(
        f"<!-- 1 build for {len(VARIANTS)} variants in {time.time() - t0:.0f} s; failed: {failed or 'none'} -->",
        flush=True,
    )
    rows = []
    for v in VARIANTS:
        if v in failed:
            continue
        r = subprocess.run(
            [sys.executable, __file__, "--one", v, "--ref-dir", str(ref_dir), "--T", *map(str, a.T), "--d", str(a.d)],
            capture_output=True,
            text=True,
            env={**os.environ, **VARIANTS[v]},
        )
        if r.returncode != 0:
            print(f"<!-- {v} failed: {r.stderr[-400:]} -->")
            continue
        rows += json.loads(r.stdout.strip().splitlines()[-1])
    print(f"add+RMSNorm backward, bf16, d={a.d}, with grad_r; kernel time from the profiler\n")
    print(
        "| variant | T | kernel ms | kernel % HBM | call ms (incl. dw sum) | HBM GB/s (same process) "
        "| bitwise = first |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['T']} | {r['kernel_ms']:.4f} | {r['kernel_pct_hbm']:.0f}% | {r['ms']:.4f} | "
            f"{r['hbm_GBps']:.0f} | {r['bitwise_equal']} |"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "rmsnorm_bwd_variants.json").write_text(json.dumps(rows, indent=1))
    return 0 if rows and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
