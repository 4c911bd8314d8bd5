"""The vocab loss through the lm head: megablu's chunked linear cross-entropy against the
kept libraries that fuse the same thing (issue 17, item 3).

    source dev/device_env.sh
    OUT=$OUT python bench/loss_bench.py --T 32768,131072            # GPU: rows to $OUT/loss_bench.json
    python bench/loss_bench.py --render $OUT/loss_bench.json         # the markdown table (CPU)
    python bench/loss_bench.py --device cpu --T 64 --d 32 --V 200    # CPU rehearsal, toy shape

Implementations (`IMPLS`; one that cannot be imported is reported as such):
  megablu        megablu.ops.cross_entropy.linear_cross_entropy(h, W, y, chunk) as the model calls it
                 (LMHead: hidden states (T, d) -> summed CE): fp32 logits per chunk of
                 --megablu-chunk tokens, grads computed in the forward, dW summed in fp32
  liger          liger_kernel.transformers.functional.liger_fused_linear_cross_entropy,
                 reduction="sum", defaults (bf16 logits chunks, dW summed in the weight's dtype)
  liger_fp32acc  the same with accum_dtype=torch.float32 (dW summed in fp32)
  cce            cut_cross_entropy.linear_cross_entropy, reduction="sum", defaults (impl "cce";
                 its gradient filtering: softmax entries below filter_eps skipped in the backward)
  cce_exact      the same with filter_eps=None (no gradient filtering)

Inputs, bf16: h (T, d) ~ N(0, 1) (what the final RMSNorm hands the head), W (V, d) ~
N(0, (logit_std / sqrt(d))^2) so that the logits have std --logit-std, labels uniform in
[0, V), none ignored. The loss is the sum over tokens (the model's reduction).

Per (T, impl):
  - time: forward alone (grad enabled, as in training) and forward+backward, median of --iters
    calls after one warm-up, CUDA events; h.grad and W.grad are None before each call;
  - memory: the peak of torch.cuda.max_memory_allocated during one fwd+bwd minus what was
    allocated before it (the inputs): the grads it returns (dh, dW) are included;
  - exactness against an fp32 reference of the same bf16 inputs (`reference`: fp32 logits in
    chunks, analytic softmax - onehot gradient, TF32 off): loss relative error, and for dh and
    dW the relative Frobenius error ||g - ref|| / ||ref|| and the max abs error. Tolerances:
    TOL_LOSS_REL on the loss, TOL_GRAD_REL on each grad (bf16 has a relative rounding of 2^-9
    = 2e-3 per element; 1e-2 allows a few roundings along the way).
Wheels (PyPI, 2026-12-04, `pip download --no-deps --only-binary=:all: --python-version 3.12`):
liger-kernel 0.8.5 (py3-none-any, 0.9 MB; needs torch >= 2.1.2 and triton >= 2.3.1, both in the
H200 image) and cut-cross-entropy 25.1.1 (py3-none-any, 23 kB; needs torch and triton; imports
triton.testing's get_dram_gbps/get_max_*_tflops, which triton 3.6 still has):
`pip install liger-kernel==0.8.5 cut-cross-entropy==25.1.1`.

Effective TF/s = 6*T*V*d / fwd+bwd time (the logits, dh and dW GEMMs once each; an impl that
recomputes the logits in its backward does more work than that).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOL_LOSS_REL = 1e-4
TOL_GRAD_REL = 1e-2
IGNORE_INDEX = -100

# name -> description (the factories are in `make_impl`)
IMPLS = {
    "megablu": "megablu chunked linear CE (fp32 logits per chunk, dW fp32-summed)",
    "liger": "Liger fused linear CE, defaults (dW summed in bf16)",
    "liger_fp32acc": "Liger fused linear CE, accum_dtype=fp32",
    "cce": "Cut Cross-Entropy, defaults (gradient filtering)",
    "cce_exact": "Cut Cross-Entropy, filter_eps=None",
}
DEFAULT_IMPLS = "megablu,liger,liger_fp32acc,cce,cce_exact"


def make_impl(name: str, megablu_chunk: int) -> Callable:
    """fn(h, W, y) -> summed loss (scalar tensor). Raises ImportError when the library is absent."""
    import torch

    if name == "megablu":
        from megablu.ops.cross_entropy import linear_cross_entropy

        return lambda h, W, y: linear_cross_entropy(h, W, y, megablu_chunk)[0]
    if name in ("liger", "liger_fp32acc"):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        kw = {"accum_dtype": torch.float32} if name == "liger_fp32acc" else {}
        return lambda h, W, y: liger_fused_linear_cross_entropy(h, W, y, reduction="sum", **kw)
    if name in ("cce", "cce_exact"):
        from cut_cross_entropy import linear_cross_entropy

        kw = {"filter_eps": None} if name == "cce_exact" else {}
        return lambda h, W, y: linear_cross_entropy(h, W, y, reduction="sum", **kw)
    raise ValueError(f"unknown impl {name!r} (known: {', '.join(IMPLS)})")


def versions() -> dict:
    out = {}
    for dist in ("torch", "triton", "liger-kernel", "cut-cross-entropy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def make_inputs(T: int, d: int, V: int, logit_std: float, device: str, seed: int = 0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, d, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    W = (torch.randn(V, d, device=device, generator=g) * (logit_std / d**0.5)).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (T,), device=device, generator=g)
    return h, W, y


def reference(h, W, y, chunk: int = 4096):
    """(loss sum as float64, dh fp32, dW fp32) of the summed CE of the bf16 inputs, in fp32:
    logits per chunk, d loss / d logits = softmax - onehot (zero on ignored rows), TF32 off."""
    import torch

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            h32, W32 = h.detach().float(), W.detach().float()
            n = h32.shape[0]
            loss = torch.zeros((), dtype=torch.float64, device=h.device)
            dh = torch.empty_like(h32)
            dW = torch.zeros_like(W32)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                yc = y[s:e]
                valid = yc != IGNORE_INDEX
                safe = torch.where(valid, yc, torch.zeros_like(yc))
                logits = h32[s:e] @ W32.t()  # (c, V) fp32
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, safe[:, None]).squeeze(1)
                loss += ((lse - picked) * valid).double().sum()
                p = torch.exp(logits.sub_(lse[:, None]))  # softmax
                p[torch.arange(e - s, device=p.device), safe] -= 1.0
                p.mul_(valid[:, None])
                dh[s:e] = p @ W32
                dW += p.t() @ h32[s:e]
                del logits, p
            return loss, dh, dW
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def errors(loss, dh, dW, ref) -> dict:
    """Relative errors of (loss, dh, dW) against reference()'s triple."""
    L, rdh, rdW = ref
    Lr = float(L)
    out = {"loss": float(loss), "loss_ref": Lr, "loss_rel": abs(float(loss) - Lr) / abs(Lr) if Lr else None}
    for name, g, r in (("dh", dh, rdh), ("dW", dW, rdW)):
        if g is None:
            out[f"{name}_rel_fro"] = None
            continue
        diff = g.detach().float() - r
        out[f"{name}_rel_fro"] = float(diff.norm() / r.norm())
        out[f"{name}_max_abs"] = float(diff.abs().max())
        out[f"{name}_ref_max_abs"] = float(r.abs().max())
        del diff
    out["within_tol"] = bool(
        out["loss_rel"] is not None
        and out["loss_rel"] <= TOL_LOSS_REL
        and all(out.get(f"{k}_rel_fro") is not None and out[f"{k}_rel_fro"] <= TOL_GRAD_REL for k in ("dh", "dW"))
    )
    return out


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, iters: int, device: str) -> list:
    import torch

    fn()
    _sync(device)
    out = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _err(e: BaseException) -> str:
    oom = type(e).__name__ == "OutOfMemoryError"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{'OOM: ' if oom else ''}{type(e).__name__}: {first[:300]}"


def run_T(T: int, a, device: str, fns: dict, rows: list, save: Callable, waited: dict, t_start: float) -> None:
    """Exactness for every impl (the first call, which also compiles its kernels), then time and
    memory for every impl once the build marker (--wait-for) exists."""
    import torch

    base = {"T": T, "d": a.d, "V": a.V, "logit_std": a.logit_std, "dtype": "bf16", "reduction": "sum"}
    h, W, y = make_inputs(T, a.d, a.V, a.logit_std, device)
    t0 = time.perf_counter()
    ref = reference(h, W, y)
    _sync(device)
    ref_s = time.perf_counter() - t0
    res: dict = {}
    for name, fn in fns.items():
        row = dict(base, impl=name, desc=IMPLS[name], ref_s=ref_s)
        res[name] = row
        rows.append(row)  # updated in place below; saved after every step
        if isinstance(fn, str):
            row["error"] = fn
            save()
            continue
        try:
            h.grad = W.grad = None
            t0 = time.perf_counter()
            loss = fn(h, W, y)
            loss.backward()
            _sync(device)
            row["first_call_s"] = time.perf_counter() - t0  # includes Triton/inductor compiles
            row.update(errors(loss.detach(), h.grad, W.grad, ref))
        except Exception as e:  # noqa: BLE001 - one impl failing must not hide the others
            row["error"] = _err(e)
        h.grad = W.grad = None
        gc.collect()
        save()
    del ref
    if device == "cuda":
        torch.cuda.empty_cache()
    if a.wait_for and not waited:
        t0 = time.perf_counter()
        while not Path(a.wait_for).exists() and time.perf_counter() - t0 < a.wait_max:
            time.sleep(0.5)
        waited.update(waited_s=time.perf_counter() - t0, marker_seen=Path(a.wait_for).exists())
        print(
            f"loss_bench: waited {waited['waited_s']:.1f} s for {a.wait_for} "
            f"({'seen' if waited['marker_seen'] else 'NOT seen: timings may overlap the build'})",
            file=sys.stderr,
            flush=True,
        )
    for name, fn in fns.items():
        row = res[name]
        if "error" in row:
            continue
        left = a.budget_s - (time.perf_counter() - t_start) if a.budget_s else float("inf")
        if left < 5:
            row["skipped"] = f"timing skipped, budget: {left:.0f} s left"
            save()
            continue
        try:

            def fwd():
                fn(h, W, y)

            def fwd_bwd():
                h.grad = W.grad = None
                fn(h, W, y).backward()

            f = _time(fwd, a.iters, device)
            fb = _time(fwd_bwd, a.iters, device)
            row.update(
                fwd_ms=statistics.median(f),
                fwd_bwd_ms=statistics.median(fb),
                fwd_ms_all=f,
                fwd_bwd_ms_all=fb,
                eff_tflops=6.0 * T * a.V * a.d / (statistics.median(fb) / 1e3) / 1e12,
            )
            h.grad = W.grad = None
            gc.collect()
            if device == "cuda":
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn(h, W, y).backward()
                torch.cuda.synchronize()
                row.update(
                    peak_gb_above_inputs=(torch.cuda.max_memory_allocated() - before) / 1e9,
                    grads_gb=(torch.cuda.memory_allocated() - before) / 1e9,
                )
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        h.grad = W.grad = None
        gc.collect()
        save()
    h = W = y = None  # freed (the timing closures above hold them by name)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _fmt(x, f="{:.3g}"):
    return "-" if x is None else f.format(x)


def render(result: dict) -> str:
    """The markdown table of a loss_bench.json."""
    meta = result.get("meta", {})
    v = meta.get("versions", {})
    lines = [
        f"Loss through the lm head (d={meta.get('d')}, V={meta.get('V')}, bf16 inputs, summed CE, logits std "
        f"{meta.get('logit_std')}; {meta.get('device')}; torch {v.get('torch')}, triton {v.get('triton')}, "
        f"liger-kernel {v.get('liger-kernel')}, cut-cross-entropy {v.get('cut-cross-entropy')}). "
        f"Time: median of {meta.get('iters')} after a warm-up ({meta.get('timer', 'CUDA events')}). Peak: max "
        f"allocated during one fwd+bwd minus the inputs (returned grads included). Errors against an fp32 "
        f"reference of the same inputs; tolerance: loss {TOL_LOSS_REL:g} relative, grads {TOL_GRAD_REL:g} "
        f"relative (Frobenius).",
        "",
    ]
    if meta.get("wait"):
        w = meta["wait"]
        lines += [
            f"Timings waited {w.get('waited_s', 0):.0f} s for the ops build to end "
            f"({'it ended' if w.get('marker_seen') else 'it had NOT ended: timings overlap the build'}).",
            "",
        ]
    lines += [
        "| T | impl | fwd ms | fwd+bwd ms | eff. TF/s | peak GB above inputs | loss rel err | dh rel err | "
        "dW rel err | within tol | first call s | note |",
        "|---" * 12 + "|",
    ]
    by_T: dict = {}
    for r in result.get("rows", []):
        by_T.setdefault(r["T"], []).append(r)
    for T, rs in sorted(by_T.items()):
        mine = next((r for r in rs if r["impl"] == "megablu" and r.get("fwd_bwd_ms")), None)
        for r in rs:
            note = r.get("error") or r.get("skipped") or ""
            if not note and mine is not None and r is not mine and r.get("fwd_bwd_ms"):
                note = f"{mine['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x megablu's speed"
            tol = "" if r.get("within_tol") is None else ("yes" if r["within_tol"] else "**no**")
            lines.append(
                f"| {T} | {r['impl']} | {_fmt(r.get('fwd_ms'), '{:.1f}')} | "
                f"{_fmt(r.get('fwd_bwd_ms'), '{:.1f}')} | {_fmt(r.get('eff_tflops'), '{:.0f}')} | "
                f"{_fmt(r.get('peak_gb_above_inputs'), '{:.2f}')} | {_fmt(r.get('loss_rel'), '{:.1e}')} | "
                f"{_fmt(r.get('dh_rel_fro'), '{:.1e}')} | {_fmt(r.get('dW_rel_fro'), '{:.1e}')} | {tol} | "
                f"{_fmt(r.get('first_call_s'), '{:.1f}')} | {note.replace('|', '/')} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", default="32768,131072", help="comma list of token counts")
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--V", type=int, default=100352)
    p.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--megablu-chunk", type=int, default=4096, help="megablu's loss_chunk (tokens per chunk)")
    p.add_argument("--logit-std", type=float, default=2.0)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--wait-for", default="", help="time nothing before this file exists (the ops build's marker)")
    p.add_argument("--wait-max", type=float, default=120.0, help="seconds to wait for --wait-for at most")
    p.add_argument("--budget-s", type=float, default=0, help="seconds this process may use (0: no limit)")
    p.add_argument("--json", default="loss_bench.json", help="file name under --out")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="directory (default $OUT)")
    p.add_argument("--render", metavar="JSON", help="print the markdown table of a loss_bench.json and exit")
    a = p.parse_args(argv)
    if a.render:
        return a
    try:
        a.T_list = [int(x) for x in a.T.split(",") if x]
    except ValueError:
        p.error(f"--T must be a comma list of integers, got {a.T!r}")
    a.impl_list = [x for x in a.impls.split(",") if x]
    bad = [x for x in a.impl_list if x not in IMPLS]
    if bad:
        p.error(f"unknown impl(s) {bad}: known {list(IMPLS)}")
    if not a.T_list or any(t <= 0 for t in a.T_list) or a.d <= 0 or a.V <= 1 or a.iters < 1 or a.megablu_chunk < 0:
        p.error("--T, --d, --iters must be positive, --V > 1, --megablu-chunk >= 0")
    return a


def main(argv: Optional[list] = None) -> int:
    a = parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return 0
    t_start = time.perf_counter()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("loss_bench: needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    fns: dict = {}
    for name in a.impl_list:
        try:
            fns[name] = make_impl(name, a.megablu_chunk)
        except ImportError as e:
            fns[name] = f"not importable: {_err(e)}"
        except Exception as e:  # noqa: BLE001 - a library that breaks at import is reported, not fatal
            fns[name] = f"import failed: {_err(e)}"
    waited: dict = {}
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "versions": versions(),
            "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
            "d": a.d,
            "V": a.V,
            "logit_std": a.logit_std,
            "iters": a.iters,
            "megablu_chunk": a.megablu_chunk,
            "timer": "CUDA events" if a.device == "cuda" else "perf_counter",
            "tolerances": {"loss_rel": TOL_LOSS_REL, "grad_rel_fro": TOL_GRAD_REL},
            "wait": waited,
        },
        "rows": [],
    }

    def save():
        if out is not None:
            tmp = out / (a.json + ".tmp")
            tmp.write_text(json.dumps(result, indent=1, default=str))
            tmp.replace(out / a.json)

    save()
    for T in a.T_list:
        left = a.budget_s - (time.perf_counter() - t_start) if a.budget_s else float("inf")
        need = 10.0 * max(1.0, T / 32768)
        if left < need:
            result["rows"] += [
                {"T": T, "impl": n, "skipped": f"budget: {left:.0f} s left, T needs ~{need:.0f} s"} for n in a.impl_list
            ]
            save()
            continue
        try:
            run_T(T, a, a.device, fns, result["rows"], save, waited, t_start)
        except Exception as e:  # noqa: BLE001 - e.g. the inputs or the reference OOM: the next T still runs
            result["rows"].append({"T": T, "impl": "(all)", "error": _err(e)})
            save()
        print(
            json.dumps(
                [
                    {k: r.get(k) for k in ("T", "impl", "fwd_bwd_ms", "loss_rel", "dh_rel_fro", "dW_rel_fro", "error")}
                    for r in result["rows"]
                    if r["T"] == T
                ]
            ),
            file=sys.stderr,
            flush=True,
        )
    save()
    if out is None:
        print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
