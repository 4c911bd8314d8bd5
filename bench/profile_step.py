"""Where one blu-0.5b training step's GPU time goes (issue 17, item 1).

One fwd+bwd step under torch.profiler (CPU + CUDA activity); every GPU activity (kernel,
memcpy, memset) put in one class; per class its kernel time and share of the step's wall
time; the GPU's idle time (step wall minus the union of all activity intervals), its compute
idle time (minus the union of non-copy kernels only) and where that sits (gaps between
kernels: sizes, forward or backward, the kernels on either side); attention's in-model TF/s
against the same-shape SDPA microbenchmark measured in the same process.

    source dev/device_env.sh
    OUT=$OUT python bench/profile_step.py --T 32768 --modes selective+offload,selective
    python bench/profile_step.py --summarize $OUT/profile_*.json   # side-by-side table (CPU)
    python bench/profile_step.py --summarize $OUT/profile_*.json --baseline selective+offload
                                    # + each case's tokens/s against the baseline mode's at its T
    python bench/profile_step.py --rehearse-cpu                    # the whole path, toy shape, CPU
    # a mode is train_bench's (`python bench/train_bench.py --help`), the fusions included: +fuseqkv (q/k/v as
    # one GEMM), +fusegu (gate/up as one GEMM), +fuseadd (the MLP residual add in the next block's input norm)
    B=selective+offload+frac0.75+liger+fa4+lchunk4096
    OUT=$OUT python bench/profile_step.py --T 32768 --timed 3 --modes $B,$B+fuseqkv,$B+fusegu,$B+fuseadd

The step is bench/train_bench.py's: its `build` (blu-0.5b: 36 layers, d=1024, 16 heads x 64,
4 kv heads, SwiGLU 2816, vocab 100352; bf16, batch 1; `--ops cuda`; chunked vocab loss of
`--loss-chunk` tokens) and its `step` (loss = sum / count, backward; no optimizer; grads
accumulate as in train_bench). Per (T, mode): one warm-up step, `--timed` plain steps (their
median is the step time without the profiler), then one step under the profiler inside a
`megablu::step` range that ends after torch.cuda.synchronize(): that range is the step wall.

Classes (`classify`; the first rule that matches wins):
  copy_h2d / copy_d2h   memcpy HtoD / DtoH (activation offload: megablu/memory/offload.py)
  copy_d2d              memcpy DtoD, memset, copy/cast kernels (names with "copy")
  loss                  anything launched inside the lm head's forward (the chunked loss:
                        its GEMMs too) or the loss Function's backward
  attn_fwd / attn_bwd   launched inside an SDPA/flash/cuDNN/flex attention op (the innermost
                        such op decides fwd or bwd: a recomputed forward inside a checkpoint's
                        backward stays fwd); by kernel name when no op is known
  optimizer             fused optimizer kernels (adam, lamb, ...; none here: no optimizer step)
  gemm                  cuBLAS/cuBLASLt/CUTLASS names (gemm, nvjet, xmma, ...) or launched by
                        aten::mm/addmm/bmm/linear
  other                 the embedding lookup and its backward, and anything not matched
  elementwise           norm, RoPE, SwiGLU (megablu's csrc kernels), torch elementwise and
                        reduction kernels, Triton kernels
A kernel's ops are found through the profiler's correlation ids (kernel -> the op that
launched it -> the ops around it on the launching thread). Times are kernel durations
summed (ms) and as % of the step wall; concurrent kernels (the offload's side stream)
can make the classes sum past the busy time, reported as "concurrency".

Attention flops (B=1, H=16 query heads, D=64): causal forward 2*T^2*H*D per call (half of
the 4*T^2*H*D of full attention), backward 2x the forward (the MFU convention of
train_bench.py: fwd+bwd = 3x fwd, 6*T*H*D per token per layer); the FlashAttention papers'
convention (backward 2.5x) is in the JSON too.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from megablu.train.step_profile import STEP_RANGE, cupti_teardown, export_trace, profiler_table  # noqa: E402

LOSS_RANGE = "megablu::loss"

# (key, label) in report order
CLASSES = [
    ("attn_fwd", "attention fwd"),
    ("attn_bwd", "attention bwd"),
    ("gemm", "GEMM"),
    ("elementwise", "elementwise / norm / rope / swiglu"),
    ("copy_h2d", "copy HtoD (offload fetch)"),
    ("copy_d2h", "copy DtoH (offload)"),
    ("copy_d2d", "copy DtoD / memset / cast"),
    ("loss", "loss (lm head + chunked CE)"),
    ("optimizer", "optimizer"),
    ("other", "other (embedding, unmatched)"),
]
LABELS = dict(CLASSES)
COPY_CLASSES = ("copy_h2d", "copy_d2h", "copy_d2d")

_I = re.IGNORECASE
LOSS_SCOPE = re.compile(r"megablu::loss|_ChunkedLinearCE|LinearCrossEntropy|linear_cross_entropy", _I)
ATTN_SCOPE = re.compile(
    r"scaled_dot_product|flash_attn|flash_attention|efficient_attention|cudnn_attention|"
    r"ScaledDotProduct|FlashAttn|flex_attention|FlexAttention",
    _I,
)
BWD = re.compile(r"backward|bwd|bprop", _I)
ATTN_NAME = re.compile(r"fprop|bprop|flash_fwd|flash_bwd|fmha|FlashAttention|flash_attn|sdpa|attention", _I)
ATTN_BWD_NAME = re.compile(r"bprop|bwd|backward|fmha_cutlassB|dot_do_o|convert_dq", _I)
OPTIM_NAME = re.compile(r"adam|lamb(?!da)|sgd|lion_", _I)  # fused optimizer kernels (a zero_grad foreach is not one)
OPTIM_SCOPE = re.compile(r"Optimizer\.step|optimizer", _I)
GEMM_NAME = re.compile(r"gemm|nvjet|xmma|wgmma|cublas|splitKreduce|cutlass", _I)
GEMM_OP = re.compile(r"^aten::(mm|addmm|addmm_|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm)$")
COPY_NAME = re.compile(r"copy", _I)
EMBED_SCOPE = re.compile(r"embedding", _I)
ELEMENTWISE_NAME = re.compile(
    r"elementwise|reduce|megablu::|rmsnorm|rope|swiglu|silu|norm|softmax|triton|fill|"
    r"cumsum|arange|scatter|gather|index|where|exp|multi_tensor",
    _I,
)
ELEMENTWISE_OP = re.compile(
    r"^aten::(add|add_|mul|mul_|sub|div|neg|exp|log|rsqrt|sqrt|pow|silu|sigmoid|tanh|mean|"
    r"sum|where|fill_|zero_|clamp|relu|gelu|softmax|_softmax|_log_softmax|logsumexp|"
    r"threshold_backward|silu_backward|sigmoid_backward|addcmul|lerp|maximum|minimum|"
    r"masked_fill|ne|eq|gt|lt)$"
)
MEGABLU_CSRC = re.compile(r"megablu::|rmsnorm_(fwd|bwd)_kernel|rope_kernel|swiglu_(fwd|bwd)_kernel")


def classify(name: str, kind: str = "kernel", scopes: tuple = ()) -> str:
    """The class of one GPU activity from its name, its kind ("kernel", "gpu_memcpy",
    "gpu_memset") and the names of the ops around its launch, innermost first."""
    if kind == "gpu_memcpy" or name.startswith("Memcpy"):
        return "copy_h2d" if "HtoD" in name else "copy_d2h" if "DtoH" in name else "copy_d2d"
    if kind == "gpu_memset" or name.startswith("Memset"):
        return "copy_d2d"
    if any(LOSS_SCOPE.search(s) for s in scopes):
        return "loss"
    for s in scopes:  # the innermost attention op decides fwd or bwd
        if ATTN_SCOPE.search(s):
            return "attn_bwd" if BWD.search(s) else "attn_fwd"
    if ATTN_NAME.search(name):
        return "attn_bwd" if ATTN_BWD_NAME.search(name) else "attn_fwd"
    if OPTIM_NAME.search(name) or any(OPTIM_SCOPE.search(s) for s in scopes):
        return "optimizer"
    if GEMM_NAME.search(name):
        return "gemm"
    if COPY_NAME.search(name):
        return "copy_d2d"
    if any(EMBED_SCOPE.search(s) for s in scopes):
        return "other"
    if ELEMENTWISE_NAME.search(name):
        return "elementwise"
    if scopes and GEMM_OP.match(scopes[0]):
        return "gemm"
    if scopes and ELEMENTWISE_OP.match(scopes[0]):
        return "elementwise"
    return "other"


# ---------------------------------------------------------------- profiler events -> records


@dataclass
class Act:
    """One GPU activity: times in microseconds on the profiler's clock."""

    name: str
    start: float
    end: float
    kind: str = "kernel"
    stream: int = 0
    scopes: tuple = ()  # names of the ops around its launch, innermost first
    scope_ids: tuple = ()  # their correlation ids
    cls: str = ""

    @property
    def backward(self) -> bool:
        return any(s.startswith("autograd::engine") for s in self.scopes)


@dataclass
class Op:
    name: str
    start: float
    end: float
    thread: int
    corr: int
    parent: Optional[Op] = None
    children: int = 0
    _chain: Optional[tuple] = field(default=None, repr=False)

    def chain(self) -> tuple:
        if self._chain is None:
            up = self.parent.chain() if self.parent is not None else ((), ())
            self._chain = ((self.name,) + up[0], (self.corr,) + up[1])
        return self._chain


def _get(ev, attr, default=None):
    f = getattr(ev, attr, None)
    if f is None:
        return default
    try:
        return f()
    except Exception:  # noqa: BLE001 - an accessor this torch build lacks
        return default


def _kind(ev) -> Optional[str]:
    """ "kernel" | "gpu_memcpy" | "gpu_memset" for a device activity, None to skip it
    (user-annotation spans, sync events)."""
    act = str(_get(ev, "activity_type", "") or "").lower()
    name = str(_get(ev, "name", ""))
    if "annotation" in act or _get(ev, "is_user_annotation", False):
        return None
    if "memcpy" in act or name.startswith("Memcpy"):
        return "gpu_memcpy"
    if "memset" in act or name.startswith("Memset"):
        return "gpu_memset"
    if "kernel" in act or not act:
        return "kernel"
    return None


def _times_us(ev) -> tuple:
    s, e = _get(ev, "start_ns"), _get(ev, "end_ns")
    if s is None:  # older builds: microseconds
        s = _get(ev, "start_us", 0) * 1000
        e = s + _get(ev, "duration_us", 0) * 1000
    elif e is None:
        e = s + _get(ev, "duration_ns", 0)
    return s / 1e3, e / 1e3


def _nest(ops: list) -> None:
    """Parent of each op: the innermost op of the same thread whose span holds it."""
    by_thread: dict = {}
    for o in ops:
        by_thread.setdefault(o.thread, []).append(o)
    for lst in by_thread.values():
        lst.sort(key=lambda o: (o.start, -o.end))
        stack: list = []
        for o in lst:
            while stack and not (stack[-1].start <= o.start and o.end <= stack[-1].end):
                stack.pop()
            o.parent = stack[-1] if stack else None
            if o.parent is not None:
                o.parent.children += 1
            stack.append(o)


def records(events: Iterable, cpu_ops_as_kernels: bool = False) -> tuple:
    """(activities, ranges, gpu_spans, stats) from torch's kineto events
    (`prof.profiler.kineto_results.events()`).

    ranges: user annotations on the CPU (name -> list of (start, end)); gpu_spans: the same
    annotations' spans on the GPU timeline (a fallback for kernels whose launching op is not
    known). `cpu_ops_as_kernels`: the CPU rehearsal, where leaf CPU ops stand in for kernels.
    """
    ops: dict = {}
    devs: list = []
    ranges: dict = {}
    gpu_spans: dict = {}
    stats = {"device_events": 0, "skipped_device_events": 0}
    for ev in events:
        dt = str(_get(ev, "device_type", ""))
        name = str(_get(ev, "name", ""))
        s, e = _times_us(ev)
        act = str(_get(ev, "activity_type", "") or "").lower()
        if dt.endswith("CUDA"):
            stats["device_events"] += 1
            if "annotation" in act or _get(ev, "is_user_annotation", False):
                gpu_spans.setdefault(name, []).append((s, e))
                continue
            kind = _kind(ev)
            if kind is None:
                stats["skipped_device_events"] += 1
                continue
            devs.append(
                (
                    Act(name, s, e, kind, int(_get(ev, "device_resource_id", 0) or 0)),
                    int(_get(ev, "linked_correlation_id", 0) or 0),
                )
            )
        elif dt.endswith("CPU"):
            if act and act not in ("cpu_op", "user_annotation"):
                continue  # runtime/driver calls, python frames, instant events
            if not act and _get(ev, "linked_correlation_id", 0):
                continue
            if "annotation" in act or _get(ev, "is_user_annotation", False):
                ranges.setdefault(name, []).append((s, e))
            corr = int(_get(ev, "correlation_id", 0) or 0)
            ops[corr] = Op(name, s, e, int(_get(ev, "start_thread_id", 0) or 0), corr)
    _nest(list(ops.values()))
    if cpu_ops_as_kernels:  # GEMM ops and the leaves outside them stand in for kernels

        def stands_in(o):
            if o.name in ranges or any(GEMM_OP.match(n) for n in o.chain()[0][1:]):
                return False
            return o.children == 0 or bool(GEMM_OP.match(o.name))

        devs = [(Act(o.name, o.start, o.end, "kernel", o.thread), o.corr) for o in ops.values() if stands_in(o)]
    acts = []
    linked = 0.0
    for a, corr in devs:
        op = ops.get(corr)
        if op is not None:
            a.scopes, a.scope_ids = op.chain()
            linked += a.end - a.start
        else:
            for rname, spans in gpu_spans.items():  # not linked: the GPU span of a range holds it
                if any(s0 <= a.start < e0 for s0, e0 in spans):
                    a.scopes += (rname,)
        a.cls = classify(a.name, a.kind, a.scopes)
        acts.append(a)
    total = sum(a.end - a.start for a in acts)
    stats["linked_pct"] = 100.0 * linked / total if total > 0 else 0.0
    return acts, ranges, gpu_spans, stats


# ---------------------------------------------------------------- interval arithmetic


def union(ivs: Iterable) -> list:
    """Merged, sorted [start, end) intervals."""
    out: list = []
    for s, e in sorted(ivs):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(ivs: Iterable) -> float:
    return sum(e - s for s, e in ivs)


def minus(a: list, b: list) -> list:
    """Merged intervals a minus merged intervals b."""
    out = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def overlap(ivs: list, lo: float, hi: float) -> float:
    """Length of merged intervals ivs inside [lo, hi)."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in ivs)


def clip(a: Act, lo: float, hi: float) -> Optional[tuple]:
    s, e = max(a.start, lo), min(a.end, hi)
    return (s, e) if e > s else None


# ---------------------------------------------------------------- the analysis

GAP_BUCKETS = [
    (0.0, 10.0, "< 10 us"),
    (10.0, 100.0, "10-100 us"),
    (100.0, 1000.0, "0.1-1 ms"),
    (1000.0, float("inf"), ">= 1 ms"),
]


def attention_flops(T: int, H: int, D: int, B: int = 1) -> dict:
    """Causal attention flops of one call (forward: QK^T and PV, 2*2*T*T*H*D halved)."""
    fwd = 2.0 * B * T * T * H * D
    return {
        "fwd": fwd,
        "bwd": 2.0 * fwd,
        "bwd_fa": 2.5 * fwd,
        "convention": "causal: fwd = 2*T^2*H*D per call (half of full attention's 4*T^2*H*D); "
        "bwd = 2x fwd (MFU convention, fwd+bwd = 3x fwd); FlashAttention papers: bwd = 2.5x fwd",
    }


def _short(name: str, n: int = 110) -> str:
    name = " ".join(name.split())
    return name if len(name) <= n else name[: n - 3] + "..."


def summarize(acts: list, window: tuple, T: int = 0, heads: int = 0, head_dim: int = 0, n_layers: int = 0) -> dict:
    """Per-class kernel time, busy/idle time, gaps and attention TF/s of the activities
    inside `window` (start, end) in microseconds."""
    lo, hi = window
    wall = hi - lo
    inside = [(a, iv) for a in acts if (iv := clip(a, lo, hi)) is not None]
    res: dict = {"wall_ms": wall / 1e3, "classes": {}, "n_activities": len(inside)}
    for key, label in CLASSES:
        mine = [(a, iv) for a, iv in inside if a.cls == key]
        t = sum(e - s for _, (s, e) in mine)
        by_name: dict = {}
        for a, (s, e) in mine:
            c = by_name.setdefault(a.name, [0, 0.0])
            c[0] += 1
            c[1] += e - s
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:6]
        res["classes"][key] = {
            "label": label,
            "ms": t / 1e3,
            "pct_wall": 100.0 * t / wall if wall > 0 else 0.0,
            "count": len(mine),
            "union_ms": length(union(iv for _, iv in mine)) / 1e3,
            "top": [[_short(n), c, ms / 1e3] for n, (c, ms) in top],
        }
    ew = [(a, iv) for a, iv in inside if a.cls == "elementwise" and MEGABLU_CSRC.search(a.name)]
    res["classes"]["elementwise"]["megablu_csrc_ms"] = sum(e - s for _, (s, e) in ew) / 1e3
    busy = union(iv for _, iv in inside)
    compute = union(iv for a, iv in inside if a.cls not in COPY_CLASSES)
    kernel_sum = sum(e - s for _, (s, e) in inside)
    res["gpu"] = {
        "busy_ms": length(busy) / 1e3,
        "idle_ms": (wall - length(busy)) / 1e3,
        "idle_pct": 100.0 * (wall - length(busy)) / wall if wall > 0 else 0.0,
        "compute_busy_ms": length(compute) / 1e3,
        "kernel_sum_ms": kernel_sum / 1e3,
        "concurrency_ms": (kernel_sum - length(busy)) / 1e3,
        "copy_exposed_ms": {
            k: length(minus(union(iv for a, iv in inside if a.cls == k), compute)) / 1e3 for k in COPY_CLASSES
        },
    }
    res["gpu"]["compute_idle_ms"] = (wall - length(compute)) / 1e3
    # where compute stops: gaps between non-copy kernels (a copy running alone, e.g. an offload
    # stall, counts here as a gap; the GPU idle above counts it as busy)
    res["gaps"] = _gaps([(a, iv) for a, iv in inside if a.cls not in COPY_CLASSES], compute, lo, hi)
    # forward / backward spans on the GPU: backward = kernels launched by the autograd engine
    fwd = [iv for a, iv in inside if not a.backward]
    bwd = [iv for a, iv in inside if a.backward]
    phases = {}
    if fwd and bwd:
        split = min(s for s, _ in bwd)
        for pname, (p0, p1) in (("forward", (lo, split)), ("backward", (split, hi))):
            pb, pc = overlap(busy, p0, p1), overlap(compute, p0, p1)
            phases[pname] = {
                "span_ms": (p1 - p0) / 1e3,
                "busy_ms": pb / 1e3,
                "idle_ms": (p1 - p0 - pb) / 1e3,
                "compute_idle_ms": (p1 - p0 - pc) / 1e3,
            }
    res["phases"] = phases
    if T and heads and head_dim:
        res["attention"] = _attention(inside, T, heads, head_dim, n_layers)
    res["top_kernels"] = _top_kernels(inside, wall, 30)
    return res


def _gaps(inside: list, busy: list, lo: float, hi: float) -> dict:
    """Idle intervals of the window: size buckets, the phase they sit in (that of the kernel
    after the gap), the largest with the kernels on either side."""
    by_start = sorted(inside, key=lambda x: x[1][0])
    start_keys = [iv[0] for _, iv in by_start]
    by_end = sorted(inside, key=lambda x: x[1][1])
    end_keys = [iv[1] for _, iv in by_end]
    gaps = []
    prev = lo
    for s, e in busy + [(hi, hi)]:
        if s > prev:
            gaps.append((prev, s))
        prev = max(prev, e)
    out_b = {label: [0, 0.0] for _, _, label in GAP_BUCKETS}
    by_phase = {
        "head (before the first kernel)": 0.0,
        "forward": 0.0,
        "backward": 0.0,
        "tail (after the last kernel)": 0.0,
    }
    listed = []
    for s, e in gaps:
        d = e - s
        for b0, b1, label in GAP_BUCKETS:
            if b0 <= d < b1:
                out_b[label][0] += 1
                out_b[label][1] += d / 1e3
        i = bisect.bisect_left(start_keys, e)
        after = by_start[i][0] if i < len(start_keys) and start_keys[i] == e else None
        j = bisect.bisect_right(end_keys, s) - 1
        before = by_end[j][0] if 0 <= j < len(end_keys) and end_keys[j] == s else None
        if s <= lo and after is not None:
            phase = "head (before the first kernel)"
        elif after is None:
            phase = "tail (after the last kernel)"
        else:
            phase = "backward" if after.backward else "forward"
        by_phase[phase] += d / 1e3
        listed.append(
            {
                "at_ms": (s - lo) / 1e3,
                "ms": d / 1e3,
                "phase": phase,
                "before": _short(before.name, 70) if before is not None else "",
                "after": _short(after.name, 70) if after is not None else "",
            }
        )
    listed.sort(key=lambda g: -g["ms"])
    return {"count": len(gaps), "buckets": out_b, "by_phase_ms": by_phase, "largest": listed[:10]}


def _attention(inside: list, T: int, H: int, D: int, n_layers: int) -> dict:
    fl = attention_flops(T, H, D)
    out = {"convention": fl["convention"], "T": T, "heads": H, "head_dim": D}
    for key, fkey in (("attn_fwd", "fwd"), ("attn_bwd", "bwd")):
        mine = [(a, iv) for a, iv in inside if a.cls == key]
        t = sum(e - s for _, (s, e) in mine) / 1e6  # seconds
        # one call = one attention op: the outermost attention op around the kernel (a backward's
        # autograd node holds the aten backward op and any GQA reduction beside it)
        calls = set()
        for a, _ in mine:
            ids = [cid for s, cid in zip(a.scopes, a.scope_ids, strict=True) if ATTN_SCOPE.search(s)]
            if ids:
                calls.add(ids[-1])
        n = len(calls)
        out[f"{fkey}_calls"] = n
        if n == 0:
            n = n_layers
            out[f"{fkey}_calls_assumed"] = n_layers
        out[f"{fkey}_ms"] = t * 1e3
        out[f"{fkey}_tflops"] = fl[fkey] * n / t / 1e12 if t > 0 else None
        if fkey == "bwd":
            out["bwd_tflops_fa"] = fl["bwd_fa"] * n / t / 1e12 if t > 0 else None
    f, b = out["fwd_ms"], out["bwd_ms"]
    nf = out.get("fwd_calls") or out.get("fwd_calls_assumed", 0)
    out["fwd_bwd_tflops"] = 3 * fl["fwd"] * nf / ((f + b) / 1e3) / 1e12 if f + b > 0 else None
    return out


def _top_kernels(inside: list, wall: float, n: int) -> list:
    by: dict = {}
    for a, (s, e) in inside:
        r = by.setdefault(a.name, {"name": a.name, "class": a.cls, "count": 0, "us": 0.0})
        r["count"] += 1
        r["us"] += e - s
    rows = sorted(by.values(), key=lambda r: -r["us"])[:n]
    return [
        {
            "name": _short(r["name"], 140),
            "class": r["class"],
            "count": r["count"],
            "ms": r["us"] / 1e3,
            "avg_us": r["us"] / r["count"],
            "pct_wall": 100.0 * r["us"] / wall if wall > 0 else 0.0,
        }
        for r in rows
    ]


# ---------------------------------------------------------------- markdown


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def case_markdown(r: dict) -> str:
    """One case: the class table, GPU idle, attention against the microbenchmark, gaps, top kernels."""
    hdr = f"### T={r['T']}, {r['mode']}"
    if r.get("skipped") or r.get("error"):
        return f"{hdr}\n\n{'skipped: ' + r['skipped'] if r.get('skipped') else 'FAILED: ' + r['error']}\n"
    s, p = r["step"], r["profile"]
    lines = [
        hdr,
        "",
        f"blu-0.5b ({r['n_layers']} layers), bf16, batch 1, ops {r['ops']}, loss chunk {r['loss_chunk']}, "
        f"one fwd+bwd without optimizer; weights drawn on the {r.get('init', 'cpu')}; built in "
        f"{_f(r.get('build_s'), '{:.1f}')} s. "
        + (
            f"Step without the profiler: {_f(s.get('timed_median_s'), '{:.3f}')} s (median of "
            f"{len(s.get('timed_s', []))}; warm-up step {_f(s.get('warmup_s'), '{:.2f}')} s), "
            if s.get("timed_s")
            else f"No plain step timed (warm-up step {_f(s.get('warmup_s'), '{:.2f}')} s): tokens/s and MFU are the "
            f"profiled step's, profiler overhead included; "
        )
        + f"{_f(s.get('tokens_per_s'), '{:.0f}')} tokens/s, MFU {_f(s.get('mfu'), '{:.0%}')}, peak "
        f"{_f(s.get('peak_gb'))} GB. Profiled step wall: {p['wall_ms']:.1f} ms. "
        f"Kernels linked to their ops: {r['profile_stats'].get('linked_pct', 0):.0f}% of kernel time.",
        "",
        "| class | kernel ms | % of step wall | kernels | largest kernel (ms) |",
        "|---|---|---|---|---|",
    ]
    for key, label in CLASSES:
        c = p["classes"][key]
        top = f"{c['top'][0][0][:70]} ({c['top'][0][2]:.1f})" if c["top"] else ""
        extra = f"; megablu csrc {c['megablu_csrc_ms']:.1f} ms" if key == "elementwise" else ""
        lines.append(f"| {label} | {c['ms']:.1f} | {c['pct_wall']:.1f}% | {c['count']} | {top}{extra} |")
    g = p["gpu"]
    lines += [
        f"| **GPU busy** (union of all activity) | {g['busy_ms']:.1f} | "
        f"{100 * g['busy_ms'] / p['wall_ms']:.1f}% | | concurrency (sum - union) {g['concurrency_ms']:.1f} ms |",
        f"| **GPU idle** (wall - busy) | {g['idle_ms']:.1f} | {g['idle_pct']:.1f}% | | |",
        f"| compute idle (no kernel but copies) | {g['compute_idle_ms']:.1f} | "
        f"{100 * g['compute_idle_ms'] / p['wall_ms']:.1f}% | | gaps below are these |",
        f"| copies not hidden by compute | HtoD {g['copy_exposed_ms']['copy_h2d']:.1f}, DtoH "
        f"{g['copy_exposed_ms']['copy_d2h']:.1f}, DtoD {g['copy_exposed_ms']['copy_d2d']:.1f} | | | |",
        "",
    ]
    a = p.get("attention")
    if a:
        m = r.get("micro") or {}
        lines.append(
            f"Attention in the model ({a.get('fwd_calls') or a.get('fwd_calls_assumed')} fwd / "
            f"{a.get('bwd_calls') or a.get('bwd_calls_assumed')} bwd calls): fwd {a['fwd_ms']:.1f} ms = "
            f"{_f(a['fwd_tflops'], '{:.0f}')} TF/s, bwd {a['bwd_ms']:.1f} ms = "
            f"{_f(a['bwd_tflops'], '{:.0f}')} TF/s, fwd+bwd {_f(a['fwd_bwd_tflops'], '{:.0f}')} TF/s "
            f"({a['convention']})."
        )
        if m and not m.get("error"):
            lines.append(
                f"Same-shape SDPA microbenchmark, same process: kernels fwd "
                f"{_f(m.get('kernel_fwd_tflops'), '{:.0f}')} / bwd {_f(m.get('kernel_bwd_tflops'), '{:.0f}')}"
                f" / fwd+bwd "
                f"{_f(m.get('kernel_fwd_bwd_tflops'), '{:.0f}')} TF/s; wall (CUDA events, median of "
                f"{m.get('reps')}) fwd {_f(m.get('fwd_tflops'), '{:.0f}')}, fwd+bwd "
                f"{_f(m.get('fwd_bwd_tflops'), '{:.0f}')} TF/s; kernels "
                f"{', '.join(m.get('kernels', [])[:3])}."
            )
            if a.get("fwd_bwd_tflops") and m.get("kernel_fwd_bwd_tflops"):
                lines.append(
                    f"In-model / microbenchmark (kernel time, fwd+bwd): "
                    f"{a['fwd_bwd_tflops'] / m['kernel_fwd_bwd_tflops']:.2f}."
                )
        elif m.get("error"):
            lines.append(f"SDPA microbenchmark failed: {m['error']}")
        lines.append("")
    gp = p["gaps"]
    lines.append(
        "Compute gaps: "
        + ", ".join(f"{k}: {v[0]} ({v[1]:.1f} ms)" for k, v in gp["buckets"].items())
        + ". By phase: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in gp["by_phase_ms"].items())
        + "."
    )
    if p.get("phases"):
        lines.append(
            "GPU spans: "
            + "; ".join(
                f"{k} {v['span_ms']:.1f} ms (idle {v['idle_ms']:.1f}, compute idle {v['compute_idle_ms']:.1f})"
                for k, v in p["phases"].items()
            )
            + "."
        )
    if gp["largest"]:
        lines += ["", "| largest gaps: at ms | ms | phase | before | after |", "|---|---|---|---|---|"]
        lines += [
            f"| {x['at_ms']:.2f} | {x['ms']:.3f} | {x['phase']} | {x['before']} | {x['after']} |"
            for x in gp["largest"][:5]
        ]
    lines += [
        "",
        f"Top {len(p['top_kernels'])} kernels:",
        "",
        "| kernel | class | count | ms | avg us | % of wall |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {k['name'].replace('|', '/')} | {k['class']} | {k['count']} | {k['ms']:.2f} | {k['avg_us']:.1f} | "
        f"{k['pct_wall']:.2f}% |"
        for k in p["top_kernels"]
    ]
    if r.get("profiler_table"):
        lines += [
            "",
            "<details><summary>torch.profiler key_averages (top 30 by self device time)</summary>",
            "",
            "```",
            r["profiler_table"].rstrip(),
            "```",
            "</details>",
        ]
    return "\n".join(lines) + "\n"


def _tk(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def summary_markdown(results: list) -> str:
    """Side-by-side table of several cases (each a profile_<T>_<mode>.json)."""
    done = [r for r in results if not r.get("skipped") and not r.get("error")]
    out = []
    if not done:
        return "no profiled case completed\n" + "".join(
            f"- T={r.get('T')} {r.get('mode')}: {r.get('skipped') or r.get('error')}\n" for r in results
        )
    done.sort(key=lambda r: (r["T"], r["mode"]))
    cols = [f"T={_tk(r['T'])} {r['mode']}" for r in done]
    out += ["| ms (% of step wall) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out.append(
        "| step wall, no profiler (s) | "
        + " | ".join(_f(r["step"].get("timed_median_s"), "{:.3f}") for r in done)
        + " |"
    )
    out.append(
        "| tokens/s (* = of the profiled step) | "
        + " | ".join(
            _f(r["step"].get("tokens_per_s"), "{:.0f}") + ("*" if r["step"].get("profiled_only") else "") for r in done
        )
        + " |"
    )
    out.append("| profiled step wall (ms) | " + " | ".join(f"{r['profile']['wall_ms']:.1f}" for r in done) + " |")
    for key, label in CLASSES:
        out.append(
            f"| {label} | "
            + " | ".join(
                f"{r['profile']['classes'][key]['ms']:.1f} ({r['profile']['classes'][key]['pct_wall']:.1f}%)"
                for r in done
            )
            + " |"
        )
    out.append(
        "| GPU busy (union) | "
        + " | ".join(
            f"{r['profile']['gpu']['busy_ms']:.1f} "
            f"({100 * r['profile']['gpu']['busy_ms'] / r['profile']['wall_ms']:.1f}%)"
            for r in done
        )
        + " |"
    )
    out.append(
        "| **GPU idle** | "
        + " | ".join(f"{r['profile']['gpu']['idle_ms']:.1f} ({r['profile']['gpu']['idle_pct']:.1f}%)" for r in done)
        + " |"
    )
    out.append(
        "| compute idle (no kernel but copies) | "
        + " | ".join(
            f"{r['profile']['gpu']['compute_idle_ms']:.1f} "
            f"({100 * r['profile']['gpu']['compute_idle_ms'] / r['profile']['wall_ms']:.1f}%)"
            for r in done
        )
        + " |"
    )
    out.append(
        "| attention fwd+bwd TF/s in model | "
        + " | ".join(_f((r["profile"].get("attention") or {}).get("fwd_bwd_tflops"), "{:.0f}") for r in done)
        + " |"
    )
    micro = {r["T"]: r["micro"] for r in done if r.get("micro") and not r["micro"].get("error")}
    out.append(
        "| same-shape SDPA micro fwd+bwd TF/s (kernel) | "
        + " | ".join(_f((micro.get(r["T"]) or {}).get("kernel_fwd_bwd_tflops"), "{:.0f}") for r in done)
        + " |"
    )
    for r in results:
        if r.get("skipped") or r.get("error"):
            out.append(f"\nT={r.get('T')} {r.get('mode')}: {r.get('skipped') or 'FAILED: ' + str(r.get('error'))}")
    return "\n".join(out) + "\n"


def gains_markdown(results: list, baseline: str) -> str:
    """Per T, each case against the `baseline` mode's case of the same T (same call): tokens/s and
    its ratio, peak GB, MFU, the warm-up step (first-call compiles: FlashAttention-4's CuTe DSL
    kernels, Liger's Triton kernels), attention's fwd+bwd TF/s and the loss's ms in the model."""
    out = [
        f"| T | mode | tokens/s | x {baseline} | peak GB | MFU | warm-up s | attention TF/s | loss ms |",
        "|---" * 9 + "|",
    ]
    by_T: dict = {}
    for r in results:
        by_T.setdefault(r.get("T"), []).append(r)
    for T, rows in sorted(by_T.items(), key=lambda kv: kv[0] or 0):
        base = next((r for r in rows if r.get("mode") == baseline and "step" in r), None)
        b = (base or {}).get("step", {}).get("tokens_per_s")
        for r in sorted(rows, key=lambda r: (r.get("mode") != baseline, r.get("mode", ""))):
            if r.get("skipped") or r.get("error") or "step" not in r:
                why = r.get("skipped") or f"FAILED: {r.get('error')}"
                out.append(f"| {T} | {r.get('mode')} | {why.replace('|', '/')[:300]} | | | | | | |")
                continue
            st, pr = r["step"], r.get("profile") or {}
            tps = st.get("tokens_per_s")
            ratio = f"{tps / b:.2f}x" if tps and b else "-"
            out.append(
                f"| {T} | {r['mode']} | {_f(tps, '{:.0f}')}{'*' if st.get('profiled_only') else ''} | "
                f"{ratio} | {_f(st.get('peak_gb'))} | {_f(st.get('mfu'), '{:.0%}')} | "
                f"{_f(st.get('warmup_s'))} | "
                f"{_f((pr.get('attention') or {}).get('fwd_bwd_tflops'), '{:.0f}')} | "
                f"{_f(((pr.get('classes') or {}).get('loss') or {}).get('ms'))} |"
            )
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- measurement (GPU; CPU rehearsal)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, reps: int, device: str) -> list:
    """Wall time (ms) of each of `reps` calls after one warm-up: CUDA events on the GPU."""
    import torch

    fn()
    _sync(device)
    out = []
    for _ in range(reps):
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


def _activities(device: str):
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]


def _profile(fn, device: str):
    """(activities, ranges, stats, prof) of one call of fn inside the STEP_RANGE range."""
    import torch
    from torch.profiler import profile, record_function

    # CUPTI detached when the profiler stops: a later mode's plain steps are timed without it (before
    # 2026-12-06 every mode after the first in a call was timed with CUPTI still attached)
    cupti_teardown(device)
    with profile(activities=_activities(device)) as prof:
        x = torch.ones(8, device=device) * 2  # the tracer is up before the measured range
        _sync(device)
        del x
        with record_function(STEP_RANGE):
            fn()
            _sync(device)
    acts, ranges, _spans, stats = records(prof.profiler.kineto_results.events(), cpu_ops_as_kernels=device != "cuda")
    return acts, ranges, stats, prof


def _window(ranges: dict) -> tuple:
    spans = ranges.get(STEP_RANGE)
    if not spans:
        raise RuntimeError(f"the profiler recorded no {STEP_RANGE!r} range")
    return spans[-1]


def sdpa_micro(T: int, H: int, Hkv: int, D: int, reps: int, device: str = "cuda") -> dict:
    """The model's attention call alone (LocalAttention: (B, T, H, D) transposed to (B, H, T, D),
    causal, enable_gqa), bf16: wall time with CUDA events and kernel time from the profiler."""
    import torch
    import torch.nn.functional as F

    dt = torch.bfloat16
    qb = torch.randn(1, T, H, D, device=device, dtype=dt, requires_grad=True)
    kb = torch.randn(1, T, Hkv, D, device=device, dtype=dt, requires_grad=True)
    vb = torch.randn(1, T, Hkv, D, device=device, dtype=dt, requires_grad=True)
    go = torch.randn(1, H, T, D, device=device, dtype=dt)

    def fwd():
        return F.scaled_dot_product_attention(
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), is_causal=True, enable_gqa=Hkv != H
        )

    def fwd_bwd():
        fwd().backward(go)

    fl = attention_flops(T, H, D)
    f_ms = statistics.median(time_ms(fwd, reps, device))
    fb_ms = statistics.median(time_ms(fwd_bwd, reps, device))
    out = {
        "T": T,
        "heads": H,
        "kv_heads": Hkv,
        "head_dim": D,
        "reps": reps,
        "fwd_ms": f_ms,
        "fwd_bwd_ms": fb_ms,
        "fwd_tflops": fl["fwd"] / (f_ms / 1e3) / 1e12,
        "fwd_bwd_tflops": 3 * fl["fwd"] / (fb_ms / 1e3) / 1e12,
    }
    acts, ranges, _stats, _prof = _profile(fwd_bwd, device)
    lo, hi = _window(ranges)
    k = {"attn_fwd": 0.0, "attn_bwd": 0.0}
    names: dict = {}
    for a in acts:
        iv = clip(a, lo, hi)
        if iv is not None and a.cls in k:
            k[a.cls] += (iv[1] - iv[0]) / 1e3
            names[_short(a.name, 80)] = names.get(_short(a.name, 80), 0.0) + iv[1] - iv[0]
    out.update(
        kernel_fwd_ms=k["attn_fwd"],
        kernel_bwd_ms=k["attn_bwd"],
        kernel_fwd_tflops=fl["fwd"] / (k["attn_fwd"] / 1e3) / 1e12 if k["attn_fwd"] > 0 else None,
        kernel_bwd_tflops=fl["bwd"] / (k["attn_bwd"] / 1e3) / 1e12 if k["attn_bwd"] > 0 else None,
        kernels=[n for n, _ in sorted(names.items(), key=lambda kv: -kv[1])],
    )
    tot = k["attn_fwd"] + k["attn_bwd"]
    out["kernel_fwd_bwd_tflops"] = 3 * fl["fwd"] / (tot / 1e3) / 1e12 if tot > 0 else None
    out["convention"] = fl["convention"]
    return out


def mode_fs(mode: str) -> str:
    """A mode as a file-name part: the device tool returns only [A-Za-z0-9._-] names."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", mode)


def case_path(out: Path, T: int, mode: str, ext: str = "json") -> Path:
    return out / f"profile_{T}_{mode_fs(mode)}.{ext}"


def estimate_case_s(T: int, timed: int) -> float:
    """Rough seconds one case takes on the H200 (build ~10 s, steps ~1.0 s at 32k and ~11.5 s
    at 128k, analysis ~5 s): a case is skipped rather than started when the budget is short."""
    step = 1.0 * (T / 32768) ** 1.75
    return 15.0 + (2 + timed) * step


def build_model(tb, mode: str, T: int, a, device: str) -> tuple:
    """(model, where its weights were drawn). train_bench.build draws blu-0.5b's 0.6B initial
    weights on the CPU (several seconds a build); under a CUDA default device the same build
    draws them on the GPU (the values differ, which no timing depends on). --init-on-cpu, or
    any failure of the GPU draw, takes train_bench's own path."""
    import torch

    if device == "cuda" and not a.init_on_cpu:
        try:
            with torch.device("cuda"):
                return tb.build("megablu", mode, T, a.loss_chunk, a.ops, a.mlp_tiles, device=device), "cuda"
        except Exception as e:  # noqa: BLE001 - fall back to the exact train_bench path
            gc.collect()
            torch.cuda.empty_cache()
            return (
                tb.build("megablu", mode, T, a.loss_chunk, a.ops, a.mlp_tiles, device=device),
                f"cpu (the GPU draw failed: {type(e).__name__}: {str(e)[:200]})",
            )
    return tb.build("megablu", mode, T, a.loss_chunk, a.ops, a.mlp_tiles, device=device), "cpu"


def profile_case(T: int, mode: str, a, device: str = "cuda") -> dict:
    import torch
    import train_bench as tb
    from torch.profiler import record_function

    cfg = tb.BLU05B
    row: dict = {
        "T": T,
        "mode": mode,
        "ops": a.ops,
        "loss_chunk": tb.memory_fields(mode, a.loss_chunk)["loss_chunk"],
        "n_layers": cfg.n_layers,
        "shape": cfg.model_dump() if hasattr(cfg, "model_dump") else str(cfg),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": _device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
    }
    model = None
    try:
        t0 = time.perf_counter()
        model, row["init"] = build_model(tb, mode, T, a, device)
        row["build_s"] = time.perf_counter() - t0
        head = model.lm_head
        head_forward = head.forward

        def loss_forward(*args, **kw):  # the loss's kernels carry this range (class "loss")
            with record_function(LOSS_RANGE):
                return head_forward(*args, **kw)

        head.forward = loss_forward
        ids = torch.randint(0, cfg.vocab_size, (1, T), device=device)
        step = {}
        t0 = time.perf_counter()
        tb.step(model, "megablu", ids)
        _sync(device)
        step["warmup_s"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=False)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.timed):
            t0 = time.perf_counter()
            tb.step(model, "megablu", ids)
            _sync(device)
            times.append(time.perf_counter() - t0)
        step["timed_s"] = times
        if times:
            dt = sorted(times)[len(times) // 2]
            step.update(
                timed_median_s=dt, tokens_per_s=T / dt, mfu=tb.flops_per_token(cfg, T) * T / dt / 1e12 / tb.PEAK_TFLOPS
            )
        row["step"] = step
        acts, ranges, stats, prof = _profile(lambda: tb.step(model, "megablu", ids), device)
        if device == "cuda":  # over the plain steps and the profiled one (the only one when --timed 0)
            step["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        off = getattr(model, "offload", None)
        step["host_gb"] = off.host_bytes / 1e9 if off is not None else 0.0
        window = _window(ranges)
        row["profile_stats"] = stats
        row["profile"] = summarize(acts, window, T, cfg.n_heads, cfg.resolved_head_dim, cfg.n_layers)
        if not times:  # no plain step: the profiled one stands in (profiler overhead included)
            w = row["profile"]["wall_ms"] / 1e3
            step.update(
                profiled_only=True, tokens_per_s=T / w, mfu=tb.flops_per_token(cfg, T) * T / w / 1e12 / tb.PEAK_TFLOPS
            )
        row["profiler_table"] = profiler_table(prof)
        row["prof"] = prof  # popped by the caller (trace export), never serialised
    except Exception as e:  # noqa: BLE001 - a failing case must not stop the others
        oom = type(e).__name__ == "OutOfMemoryError"
        row["error"] = f"{'OOM: ' if oom else ''}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        model = None  # freed before the next case
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            # the offload's pinned host buffers (53 GB at 128k) go back before the next case
            getattr(torch._C, "_host_emptyCache", lambda: None)()
    return row


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def write_json(path: Path, row: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: v for k, v in row.items() if k != "prof"}, indent=1, default=str))
    tmp.replace(path)


def parse_args(argv: Optional[list] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=32768, help="sequence length (one per process)")
    p.add_argument(
        "--modes", default="selective+offload,selective", help="comma list of train_bench modes, run in this order"
    )
    p.add_argument("--ops", default="cuda", choices=("cuda", "torch", "auto"))
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--mlp-tiles", type=int, default=8)
    p.add_argument("--timed", type=int, default=2, help="plain steps timed before the profiled one (0: none)")
    p.add_argument(
        "--init-on-cpu",
        action="store_true",
        help="draw the initial weights on the CPU as train_bench does (slower; default: on the GPU)",
    )
    p.add_argument("--micro-reps", type=int, default=5, help="SDPA microbenchmark: median of this many")
    p.add_argument("--no-micro", action="store_true", help="skip the same-shape SDPA microbenchmark")
    p.add_argument("--trace-mode", default="", help="export this mode's gzip'd chrome trace to $OUT")
    p.add_argument("--trace-max-mib", type=float, default=15.0)
    p.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="seconds this process may use (0: no limit); a case that would not fit is recorded as skipped",
    )
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="directory for the JSON (default $OUT)")
    p.add_argument("--summarize", nargs="*", metavar="JSON", help="print the side-by-side table of these cases")
    p.add_argument("--baseline", default="", help="with --summarize: also each case against this mode at its T")
    p.add_argument(
        "--rehearse-cpu",
        action="store_true",
        help="the whole path on CPU at a toy shape (2 layers, d=64, T=256, torch ops)",
    )
    a = p.parse_args(argv)
    if a.summarize is None:
        if a.T <= 0 or a.loss_chunk < 0 or a.timed < 0 or a.micro_reps < 1 or a.budget_s < 0:
            p.error("--T must be > 0, --loss-chunk/--timed/--budget-s >= 0, --micro-reps >= 1")
        modes = [m for m in a.modes.split(",") if m]
        if not modes:
            p.error("--modes is empty")
        import train_bench as tb

        for m in modes:
            try:
                tb.parse_mode(m)
            except ValueError as e:
                p.error(str(e))
        a.mode_list = modes
    return a


def main(argv: Optional[list] = None) -> int:
    a = parse_args(argv)
    if a.summarize is not None:
        rows = [json.loads(Path(f).read_text()) for f in a.summarize if Path(f).is_file()]
        print(summary_markdown(rows))
        if a.baseline:
            print()
            print(gains_markdown(rows, a.baseline))
        return 0
    t_start = time.perf_counter()
    import torch

    device = "cuda"
    if a.rehearse_cpu:
        import train_bench as tb

        from megablu.config.schema import ModelConfig

        tb.BLU05B = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512)
        device, a.ops = "cpu", "torch"
        if a.T == 32768:
            a.T = 256
        a.loss_chunk = min(a.loss_chunk, 64)
    elif not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU (or --rehearse-cpu)", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    import train_bench as tb

    cfg = tb.BLU05B
    micro = None
    if not a.no_micro:
        try:
            micro = sdpa_micro(a.T, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, a.micro_reps, device)
        except Exception as e:  # noqa: BLE001 - the cases still run
            micro = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(f"sdpa micro T={a.T}: {json.dumps(micro)}", file=sys.stderr, flush=True)
    for mode in a.mode_list:
        left = a.budget_s - (time.perf_counter() - t_start) if a.budget_s else float("inf")
        need = estimate_case_s(a.T, a.timed)
        if left < need:
            row = {"T": a.T, "mode": mode, "skipped": f"budget: {left:.0f} s left, the case needs ~{need:.0f} s"}
        else:
            row = profile_case(a.T, mode, a, device)
            row["micro"] = micro
        prof = row.pop("prof", None)
        if prof is not None and mode == a.trace_mode and out is not None:
            left = a.budget_s - (time.perf_counter() - t_start) if a.budget_s else float("inf")
            if left > 20:
                try:
                    row["trace"] = export_trace(
                        prof, out / f"trace_{a.T}_{mode_fs(mode)}.json.gz", int(a.trace_max_mib * 2**20)
                    )
                except Exception as e:  # noqa: BLE001 - the analysis is saved anyway
                    row["trace"] = f"not exported: {type(e).__name__}: {e}"
            else:
                row["trace"] = f"not exported: {left:.0f} s left"
        del prof
        if out is not None:
            write_json(case_path(out, a.T, mode), row)
        print(case_markdown(row), flush=True)
        print(
            json.dumps({k: row.get(k) for k in ("T", "mode", "error", "skipped", "trace")}), file=sys.stderr, flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
