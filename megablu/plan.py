"""Analytical GPU memory model per rank, the fit table, and its calibration by probes.

Everything is bytes per GPU (1 GB = 1e9 B, as docs/BENCHMARKS.md and the probe report).
A training step's peak is

    peak = persistent (params, grads, optimizer by ZeRO stage/offload)
         + max(forward end:  saved activations of every layer + loss working set,
               backward:     saved activations + one layer's recomputed working set + grads in flight,
               optimizer step: the fp32 gradient partition)

Saved activations per token per layer follow megablu/model/decoder.py and the ops it calls
(bf16 = 2 B; d = d_model, F = ffn_dim, q = H*D, kv = Hkv*D):
- ops=torch (the reference path, what BENCHMARKS measured): each RMSNorm keeps r.float()
  (4d), the normalised bf16 (2d) and its output y (2d, saved by the next linear); SwiGLU
  keeps gate, up, silu(gate) and the product (4F in bf16).
- ops=cuda (fused kernels): each norm keeps only r (2d) + rstd; SwiGLU keeps gate and up.
- attention (both): post-RoPE q, k, v, the output and the fp32 LSE (SDPA saves them).
Recompute (Block.forward): none = all of the above; selective = the attention half plus h
(the checkpointed MLP input), the MLP half is rebuilt in backward; full = the layer input
only, the whole layer is rebuilt in backward (its working set is then live once).
Loss (ops/cross_entropy.py, chunk c): the forward holds at most 10*c*V bytes at once
(fp32 logits, fp32 exp, bf16 grad) plus the fp32 grad of the head weight (4*V*d) and
grad_hidden (2d per token); unchunked it is three fp32 [T, V] (12 V B per token, 94% of
HF's 1.29 MB/token with checkpointing, shared/device/README.md).
Under Ulysses SP a rank holds T/sp tokens; the attention output is saved twice (before and
after the all-to-all back) and kv heads replicated to a multiple of sp grow k and v.
memory.mlp_tiles = n (model/tiled.py): the MLP's (T, ffn) tensors are never saved (its input
is), and the backward rebuilds them one tile at a time: the ffn parts of the rebuilt working
set and of the grads in flight shrink by n; + the tiled dx and fp32 weight-grad sums.
memory.offload_activations (model/offload.py): the layers' saved sets live in pinned host
memory (`host_gb`); on the GPU about two layers' sets remain (forward: the block running +
one block's copies in flight; backward: the block running + the one prefetched), plus what
is outside the blocks (final norm, RoPE tables, ids). Storages under 1 MiB stay on the GPU
(rstd; ignored here).
ZeRO shards over every rank that holds the same parameters (dp*sp = world; DeepSpeed
partitions over its sequence-data-parallel group).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional, Union

from .config.schema import Config, ModelConfig

log = logging.getLogger(__name__)

GB = 1e9
BF16 = 2
FP32 = 4
PEAK_TFLOPS_H200 = 989.0            # dense bf16, shared/device/README.md
COMFORTABLE = 0.80                  # <= 80% of the GPU: comfortable (issue 6: T=1M within 80%)
# DeepSpeed defaults the trainer does not override (runtime/zero/config.py)
ZERO_REDUCE_BUCKET = 5e8            # elements, stage 2/3 contiguous gradient bucket
ZERO3_PREFETCH_BUCKET = 5e7         # elements, stage 3 parameter prefetch
ALLOC_SLACK = 0.05                  # caching-allocator fragmentation over max_memory_allocated
CUDA_CONTEXT_GB = 0.8               # CUDA context + library handles, outside the allocator


@dataclass(frozen=True)
class Setup:
    """What the memory model needs; `from_config` fills it from a Config."""

    model: ModelConfig
    window: int
    gpus: int = 1
    sp: int = 1
    zero_stage: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    recompute: str = "none"
    loss_chunk: int = 0
    micro_batch: int = 1
    ops: str = "cuda"               # cuda: fused kernels (GPU default); torch: reference ops
    optimizer: bool = True          # False: fwd+bwd only (BENCHMARKS rows), grads kept bf16
    mlp_tiles: int = 1              # memory.mlp_tiles
    offload_activations: bool = False   # memory.offload_activations

    @classmethod
    def from_config(cls, cfg: Config, *, gpus: Optional[int] = None, window: Optional[int] = None,
                    sp: Optional[int] = None, ops: Optional[str] = None) -> "Setup":
        p = cfg.parallel
        g = gpus if gpus is not None else p.sp
        return cls(model=cfg.model, window=window or cfg.data.window, gpus=g,
                   sp=sp if sp is not None else (g if gpus is not None else p.sp),
                   zero_stage=p.zero_stage, offload_optimizer=p.offload_optimizer,
                   offload_params=p.offload_params, recompute=cfg.memory.recompute,
                   loss_chunk=cfg.memory.loss_chunk, micro_batch=cfg.train.micro_batch,
                   ops=ops or ("torch" if cfg.memory.ops == "torch" else "cuda"),
                   mlp_tiles=cfg.memory.mlp_tiles, offload_activations=cfg.memory.offload_activations)

    @property
    def tokens_per_rank(self) -> int:
        return self.micro_batch * math.ceil(self.window / self.sp)

    @property
    def shards(self) -> int:
        return self.gpus  # dp * sp ranks hold the same parameters

    def describe(self) -> str:
        off = "+opt-offload" if self.offload_optimizer else ""
        off += "+param-offload" if self.offload_params else ""
        mem = f" mlp_tiles={self.mlp_tiles}" if self.mlp_tiles > 1 else ""
        mem += " +act-offload" if self.offload_activations else ""
        return (f"gpus={self.gpus} sp={self.sp} zero={self.zero_stage}{off} recompute={self.recompute}{mem} "
                f"loss_chunk={self.loss_chunk} ops={self.ops}")


@dataclass
class Calibration:
    """Corrections fitted from probes: activations x act_scale, static + static_offset_gb."""

    act_scale: float = 1.0
    static_offset_gb: float = 0.0
    source: list = field(default_factory=list)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def load_calibration(path: Union[str, Path]) -> Calibration:
    """A calibration JSON, or a probe.json (calibrated on the spot)."""
    data = json.loads(Path(path).read_text())
    if "act_scale" in data:
        return Calibration(**data)
    return calibrate(data)


@dataclass
class Estimate:
    setup: Setup
    terms: dict            # name -> bytes (the peak's composition)
    phase: str             # which phase is the peak
    static: float          # bytes before the first step (params + optimizer states)
    per_token: float       # bytes per token per rank of saved activations on the GPU (after calibration)
    host: float = 0.0      # pinned host bytes per rank for offloaded activations

    @property
    def host_gb(self) -> float:
        return self.host / GB

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated reports at the peak."""
        return sum(self.terms.values())

    @property
    def allocated_gb(self) -> float:
        return self.allocated / GB

    @property
    def gpu_gb(self) -> float:
        """Device memory needed: allocated + allocator slack + CUDA context."""
        return self.allocated_gb * (1 + ALLOC_SLACK) + CUDA_CONTEXT_GB

    @property
    def limiting(self) -> str:
        return max(self.terms.items(), key=lambda kv: kv[1])[0]


# --------------------------------------------------------------------------- activations
def _kv_rep(m: ModelConfig, sp: int) -> int:
    """kv replication of parallel/ulysses.head_plan (its padded-heads branch expands to MHA)."""
    if sp == 1:
        return 1
    if m.n_heads % sp == 0:
        for r in range(1, m.n_heads // m.n_kv_heads + 1):
            if (m.n_kv_heads * r) % sp == 0 and m.n_heads % (m.n_kv_heads * r) == 0:
                return r
    return m.n_heads // m.n_kv_heads


def layer_bytes_per_token(m: ModelConfig, ops: str, sp: int = 1) -> dict:
    """Saved bytes per token per layer, by part: attn half, MLP half, the layer input, h."""
    d, F, hd = m.d_model, m.ffn_dim, m.resolved_head_dim
    q, kv = m.n_heads * hd, m.n_kv_heads * hd * _kv_rep(m, sp)
    # norm: torch keeps r.float() (4d) + the normalised bf16 (2d); cuda keeps r (2d); + rstd
    norm = (FP32 * d + BF16 * d + FP32) if ops == "torch" else (BF16 * d + FP32)
    attn = (norm + BF16 * d                         # norm + its output y (q/k/v proj input)
            + BF16 * (q + 2 * kv)                   # post-RoPE q, k, v (SDPA)
            + BF16 * q + FP32 * m.n_heads)          # attention output + LSE
    if sp > 1:
        attn += BF16 * q                            # output saved again after the all-to-all back
    mlp = (norm + BF16 * d                          # second norm + its output (gate/up input)
           + BF16 * F * (4 if ops == "torch" else 3))  # gate, up, (silu(gate)), down input
    # the attention backward (SDPA's flash kernel, FA2): an fp32 dq accumulator; with GQA
    # (fewer kv heads than q heads on the rank) dk and dv at q's head count before their sum
    # over the group; dq, dk, dv; the fp32 softmax row sums. Beside it: the output's grad from
    # o_proj and the residual grad. 5.5 KB/token above the MLP backward's point for blu-0.5b:
    # 2.9 GB at 512k, which the planner missed until the H200's 1M/512k steps (2026-12-03).
    gqa_expand = 2 * BF16 * q if kv < q else 0
    return {"attn": attn, "mlp": mlp, "input": BF16 * d, "h": BF16 * d,
            "mlp_ffn": BF16 * F * (4 if ops == "torch" else 3),   # the (T, ffn) part of "mlp"
            # grads in flight at the MLP backward: d(down input) and d(gate), d(up) (3F) while
            # the down input is already freed (-F), + the residual grad
            "bwd_extra": BF16 * (2 * F + d),
            "attn_bwd": BF16 * d + BF16 * q + FP32 * q + gqa_expand + BF16 * (q + 2 * kv) + FP32 * m.n_heads,
            "a2a": 3 * BF16 * (2 * q + 2 * kv) if sp > 1 else 0}


def saved_per_layer(lb: dict, recompute: str, mlp_tiles: int = 1) -> float:
    """Bytes per token one layer saves for backward (lb = layer_bytes_per_token)."""
    if recompute == "none":
        # the layer input is kept by the first norm (as r, or as r.float() on the torch path);
        # tiled, the MLP saves its input y only (in lb["mlp"] as the norm's output), not the ffn part
        return lb["attn"] + lb["mlp"] - (lb["mlp_ffn"] if mlp_tiles > 1 else 0)
    if recompute == "selective":
        return lb["attn"] + lb["h"]      # tiled or not: the checkpoint / the tiled norm+MLP keeps h
    if recompute == "full":
        return lb["input"]
    raise ValueError(f"memory.recompute must be none|selective|full, got {recompute!r}")


def outside_layers_per_token(m: ModelConfig, ops: str) -> float:
    """Saved bytes per token outside the blocks: final norm, RoPE tables, ids."""
    d, hd = m.d_model, m.resolved_head_dim
    final_norm = (FP32 * d + BF16 * d) if ops == "torch" else BF16 * d
    rope = 2 * BF16 * hd                            # cos, sin (B, T, D), shared by all layers
    ids = 3 * 8                                     # input ids, labels, positions (int64)
    return final_norm + rope + ids


OFFLOAD_RESIDENT_LAYERS = 2   # model/offload.py: the block running + one in flight / prefetched
OFFLOAD_KEPT_LAYERS = 1       # model/offload.py KEEP_LAST: the final blocks never leave the GPU


def saved_per_token(m: ModelConfig, recompute: str, ops: str, sp: int = 1, mlp_tiles: int = 1,
                    offload: bool = False) -> float:
    """Bytes per token per rank saved for backward on the GPU over all layers + head + RoPE tables."""
    per_layer = saved_per_layer(layer_bytes_per_token(m, ops, sp), recompute, mlp_tiles)
    layers = min(OFFLOAD_RESIDENT_LAYERS, m.n_layers) if offload else m.n_layers
    return layers * per_layer + outside_layers_per_token(m, ops)


def host_per_token(m: ModelConfig, recompute: str, ops: str, sp: int = 1, mlp_tiles: int = 1) -> float:
    """Pinned host bytes per token per rank with memory.offload_activations: every layer's saved
    set but the last OFFLOAD_KEPT_LAYERS ones (model/offload.py keeps those on the device)."""
    return (m.n_layers - OFFLOAD_KEPT_LAYERS) * saved_per_layer(layer_bytes_per_token(m, ops, sp), recompute, mlp_tiles)


def layer_working_set(lb: dict, recompute: str, mlp_tiles: int = 1) -> float:
    """Bytes per token live at one layer's backward beyond the saved sets, at the worse of its
    two points: the MLP backward (what the recompute rebuilds, the MLP's ffn part one tile at
    a time when tiled, + the grads in flight) and the attention backward (the MLP's tensors
    freed; the attention half rebuilt under `full`; the flash kernel's buffers)."""
    n = max(1, mlp_tiles)
    ffn, rest = lb["mlp_ffn"], lb["mlp"] - lb["mlp_ffn"]
    attn_point = (lb["attn"] if recompute == "full" else 0.0) + lb["attn_bwd"] + lb["a2a"]
    if n == 1:
        rebuilt = {"none": 0.0, "selective": lb["mlp"], "full": lb["attn"] + lb["mlp"]}[recompute]
        return max(rebuilt + lb["bwd_extra"] + lb["a2a"], attn_point)
    rebuilt = {"none": ffn / n,                        # the tiles' ffn tensors
               "selective": (rest + ffn) / n,          # norm + MLP rebuilt per tile
               "full": lb["attn"] + rest + ffn / n}[recompute]
    d2 = lb["h"]                                        # BF16 * d
    grads = (lb["bwd_extra"] - d2) / n + d2 + d2        # ffn grads per tile + residual grad + tiled dx
    return max(rebuilt + grads + lb["a2a"], attn_point)


def loss_bytes(m: ModelConfig, tokens: int, chunk: int) -> tuple[float, float]:
    """(bytes independent of T, bytes per token) of the loss at its forward peak."""
    V, d = m.vocab_size, m.d_model
    if chunk <= 0:
        return 0.0, 12.0 * V + BF16 * d
    c = min(chunk, tokens)
    # fp32 logits + fp32 exp + bf16 grad (10cV), or logits + bf16 grad + the (V, d) bf16
    # product and its fp32 copy (6cV + 6Vd); the fp32 grad_w (4Vd) lives throughout
    return max(10.0 * c * V, 6.0 * c * V + 6.0 * V * d) + FP32 * V * d, BF16 * d  # + grad_hidden


# --------------------------------------------------------------------------- the estimate
def estimate(s: Setup, calib: Optional[Calibration] = None) -> Estimate:
    calib = calib or Calibration()
    m, N, K = s.model, s.model.n_params(), s.shards
    t = s.tokens_per_rank
    terms: dict[str, float] = {}
    # --- persistent: parameters, gradients, optimizer states
    # ZeRO-3 gathers one module at a time (+ prefetch): the largest is the embedding/head or a block
    emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    biggest = max(m.vocab_size * m.d_model, (N - emb - m.d_model) // m.n_layers)
    if s.zero_stage == 3:
        gathered = BF16 * (2 * biggest + ZERO3_PREFETCH_BUCKET)
        terms["params (bf16)"] = gathered + (0 if s.offload_params else BF16 * N / K)
    else:
        terms["params (bf16)"] = BF16 * N
    if not s.optimizer or s.zero_stage <= 1:
        terms["grads (bf16)"] = BF16 * N
    else:
        terms["grads (bf16)"] = BF16 * (N / K + min(ZERO_REDUCE_BUCKET, N))
    if s.optimizer and not s.offload_optimizer:
        terms["optimizer (fp32 master+Adam)"] = 12.0 * N / (K if s.zero_stage >= 1 else 1)
    # before the first step: params and the fp32 master partition (DeepSpeed allocates it at
    # initialize; torch Adam creates its two moments lazily at the first step, grads appear
    # in the first backward), i.e. 4 of the 12 B/param
    static = terms["params (bf16)"] + terms.get("optimizer (fp32 master+Adam)", 0.0) / 3
    if calib.static_offset_gb:
        terms["static correction (probe)"] = calib.static_offset_gb * GB
        static += calib.static_offset_gb * GB

    # --- phases (activations scale with act_scale)
    a = calib.act_scale
    per_tok = saved_per_token(m, s.recompute, s.ops, s.sp, s.mlp_tiles, s.offload_activations) * a
    lb = layer_bytes_per_token(m, s.ops, s.sp)
    loss_const, loss_tok = loss_bytes(m, t, s.loss_chunk)
    fwd_end = per_tok * t + (loss_const + loss_tok * t) * a
    layer_ws = layer_working_set(lb, s.recompute, s.mlp_tiles) * a
    # tiled: fp32 sums of the MLP weights' grads over tiles (model/tiled.py), one layer at a time
    tile_acc = FP32 * 3 * m.d_model * m.ffn_dim if s.mlp_tiles > 1 else 0.0
    bwd = per_tok * t + layer_ws * t + tile_acc
    host = host_per_token(m, s.recompute, s.ops, s.sp, s.mlp_tiles) * a * t if s.offload_activations else 0.0
    step = FP32 * N / K if (s.optimizer and not s.offload_optimizer) else 0.0
    phases = {"forward end": fwd_end, "backward": bwd, "optimizer step": step}
    phase = max(phases, key=phases.get)
    act = f"activations ({s.recompute}, " + (f"{min(OFFLOAD_RESIDENT_LAYERS, m.n_layers)} of {m.n_layers} layers "
                                             f"on the GPU, rest on host)" if s.offload_activations
                                             else f"{m.n_layers} layers)")
    if phase == "forward end":
        terms[act] = per_tok * t
        terms["loss" + (f" (chunk {s.loss_chunk})" if s.loss_chunk else " (unchunked fp32 [T, V])")] = \
            (loss_const + loss_tok * t) * a
    elif phase == "backward":
        terms[act] = per_tok * t
        terms["backward working set (one layer" + (" + all-to-all" if s.sp > 1 else "") + ")"] = \
            bwd - per_tok * t
    else:
        terms["optimizer step (fp32 grad partition)"] = step
    return Estimate(setup=s, terms=terms, phase=phase, static=static, per_token=per_tok, host=host)


def flops_per_token(m: ModelConfig, window: int) -> float:
    """Model flops per token: 6N (input embedding excluded: a lookup) + causal attention 6 L T H D."""
    n = m.n_params() - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    return 6.0 * n + 6.0 * m.n_layers * window * m.n_heads * m.resolved_head_dim


# --------------------------------------------------------------------------- calibration
def _setup_from_probe(p: dict) -> Setup:
    ctx = p.get("setup")
    if not ctx:
        raise ValueError("probe json has no 'setup' section; it was not written by megablu's probe")
    ctx = dict(ctx)
    ctx["model"] = ModelConfig(**ctx["model"])
    return Setup(**{k: v for k, v in ctx.items() if k in Setup.__dataclass_fields__})


def calibrate(probes: Union[dict, Iterable[dict]]) -> Calibration:
    """Fit act_scale and static_offset_gb to measured probes (probe.json dicts).

    Each probe gives the static memory before the first step and the peak. The static
    offset is the mean (measured - predicted) static; the activation scale is the least-
    squares ratio of measured to predicted (peak - static) over all probes.
    """
    probes = [probes] if isinstance(probes, dict) else list(probes)
    offs, num, den, src = [], 0.0, 0.0, []
    for p in probes:
        if p.get("oom") or p.get("peak_gb") is None:
            continue
        s = _setup_from_probe(p)
        e = estimate(s)
        static_pred = e.static
        if p.get("static_gb") is not None:
            offs.append(p["static_gb"] * GB - static_pred)
        dyn_pred = e.allocated - static_pred
        dyn_meas = p["peak_gb"] * GB - (p["static_gb"] * GB if p.get("static_gb") is not None else static_pred)
        num += dyn_pred * dyn_meas
        den += dyn_pred * dyn_pred
        src.append({"window": s.window, "recompute": s.recompute, "peak_gb": p["peak_gb"]})
    if den == 0:
        raise ValueError("calibrate: no probe with a measured peak (all OOM or empty)")
    scale = num / den
    if not 0.5 <= scale <= 2.0:
        log.warning("calibration: activation scale %.2f is far from 1; check the probe's setup", scale)
    off = sum(offs) / len(offs) / GB if offs else 0.0
    return Calibration(act_scale=scale, static_offset_gb=off, source=src)


# --------------------------------------------------------------------------- fit table
_COSTS = {  # rough relative step time, from docs/BENCHMARKS.md where measured (32k)
    "recompute=selective": 1.04,   # 1.074 / 1.030 s
    "recompute=full": 1.26,        # 1.294 / 1.030 s
    "loss_chunk=4096": 1.0,
    "zero_stage=2": 1.02,          # estimate
    "zero_stage=3": 1.15,          # estimate
    "offload_optimizer": None,     # a fixed time per step: _cost()
    "offload_params": None,        # a fixed time per step: _cost()
    # tiles add no forward to selective (the tiles ARE its MLP recompute), only smaller GEMMs
    "mlp_tiles=8": 1.02,           # estimate
    # H200, blu-0.5b, selective: 0.959 / 0.939 s at 32k (the last block kept), 11.48 / 11.41 s
    # at 128k: the copies hide behind the layers' compute (docs/BENCHMARKS.md)
    "offload_activations": 1.02,
}


# ZeRO-Offload adds a fixed time per step, so its relative cost falls as the window grows.
# Measured on one H200 against ZeRO-1 (docs/EXPERIMENTS.md, 2026-12-03, single steps,
# bench/results/2026-12-03; tests/test_plan.py checks the model against those rows):
#   optimizer offload, ZeRO-1/2: CPU Adam + PCIe for the rank's partition, 0.58-0.62 s per
#     billion parameters (blu-0.5b at 16k, blu-1.5b at 32k)
#   optimizer offload, ZeRO-3: 0.7-1.65 s for both shapes, i.e. not per parameter but per
#     layer (ZeRO-3's hooks fetch and release each module): 25-57 ms per layer
#   parameter offload, optimizer on the GPU: 3.3-3.5 s per billion parameters (16k)
#   parameter offload on top of optimizer offload: within the single steps' noise of
#     optimizer offload alone (-0.6 to +1.1 s): nothing added
_OFFLOAD_S_PER_BPARAM = {"offload_optimizer": 0.6, "offload_params": 3.4}
_ZERO3_OFFLOAD_S_PER_LAYER = 0.035
ASSUMED_MFU = 0.36   # megablu, selective recompute, H200, 32k and 128k (docs/BENCHMARKS.md)


def step_seconds(s: Setup) -> float:
    """The step's compute time per rank at ASSUMED_MFU of an H200 (for ranking changes only)."""
    return flops_per_token(s.model, s.window) * s.tokens_per_rank / (ASSUMED_MFU * PEAK_TFLOPS_H200 * 1e12)


def _cost(change: str, after: Setup) -> float:
    """Relative step time of one change, `after` being the setup with it applied."""
    if _COSTS[change] is not None:
        return _COSTS[change]
    if change == "offload_optimizer" and after.zero_stage == 3:
        added = _ZERO3_OFFLOAD_S_PER_LAYER * after.model.n_layers
    elif change == "offload_params" and after.offload_optimizer:
        added = 0.0
    else:
        added = _OFFLOAD_S_PER_BPARAM[change] * after.model.n_params() / after.shards / 1e9
    return 1.0 + added / step_seconds(after)


def verdict(frac: float) -> str:
    if frac <= COMFORTABLE:
        return "comfortable"
    if frac <= 1.0:
        return "tight-probe-first"
    return "impossible"


def _apply(s: Setup, change: str) -> Optional[Setup]:
    if change.startswith("recompute="):
        order = ["none", "selective", "full"]
        new = change.split("=")[1]
        return replace(s, recompute=new) if order.index(new) > order.index(s.recompute) else None
    if change == "loss_chunk=4096":
        return replace(s, loss_chunk=4096) if s.loss_chunk <= 0 else None
    if change.startswith("zero_stage="):
        z = int(change.split("=")[1])
        return replace(s, zero_stage=z) if z > s.zero_stage else None
    if change == "offload_optimizer":
        return replace(s, offload_optimizer=True, zero_stage=max(1, s.zero_stage)) \
            if not s.offload_optimizer else None
    if change == "offload_params":
        return replace(s, offload_params=True, zero_stage=3) if not s.offload_params else None
    if change == "mlp_tiles=8":
        return replace(s, mlp_tiles=8) if s.mlp_tiles < 8 and s.tokens_per_rank >= 8 else None
    if change == "offload_activations":
        # config invariant: not with recompute=none and an untiled MLP
        ok = not s.offload_activations and (s.recompute != "none" or s.mlp_tiles > 1)
        return replace(s, offload_activations=True) if ok else None
    raise ValueError(change)


def suggest(s: Setup, gpu_gb: float, calib: Optional[Calibration] = None,
            max_gpus: int = 64, host_gb: Optional[float] = None) -> Optional[str]:
    """The cheapest change (product of relative step costs) that makes `s` comfortable,
    or failing that, fit; more GPUs (sp x2, x4 ...) only when no switch on these GPUs does.
    host_gb: pinned host memory per GPU that offloaded activations may take (None: no limit);
    a change that offloads activations says how much it needs."""
    import itertools

    changes = list(_COSTS)
    best: dict[str, tuple] = {}
    gpu_options = [s.gpus * 2 ** k for k in range(0, 7) if s.gpus * 2 ** k <= max_gpus]
    for gi, g in enumerate(gpu_options):
        base = replace(s, gpus=g, sp=min(g, s.sp * g // s.gpus))
        for r in range(0, 4):
            for combo in itertools.combinations(changes, r):
                cur, ok, cost = base, True, 1.0
                for c in combo:
                    nxt = _apply(cur, c)
                    if nxt is None:
                        ok = False
                        break
                    cur = nxt
                    cost *= _cost(c, cur)
                if not ok or (gi == 0 and not combo):
                    continue
                e = estimate(cur, calib)
                if host_gb is not None and e.host_gb > host_gb:
                    continue
                frac = e.gpu_gb / gpu_gb
                desc = ", ".join([f"{g} GPUs (sp={cur.sp})"] * (gi > 0) + [
                    f"parallel.{c}" if c in ("offload_optimizer", "offload_params") or c.startswith("zero")
                    else f"memory.{c}" for c in combo])
                if e.host:
                    desc += f" [{e.host_gb:.0f} GB pinned host per GPU]"
                for kind, lim in (("comfortable", COMFORTABLE), ("fits", 1.0)):
                    if frac <= lim and (kind not in best or (gi, cost) < best[kind][:2]):
                        best[kind] = (gi, cost, desc, frac)
        if "comfortable" in best:
            break
    pick = best.get("comfortable") or best.get("fits")
    if pick is None:
        return None
    text = f"{pick[2]} -> {pick[3]:.0%} ({'comfortable' if pick[3] <= COMFORTABLE else 'tight'})"
    tight = best.get("fits")
    if tight is not None and tight[0] < pick[0]:
        text += f"; on {gpu_options[tight[0]]} GPUs: {tight[2]} -> {tight[3]:.0%} (tight, probe first)"
    return text


def parse_tokens(text: str) -> list[int]:
    """'16k,32k,1M' -> [16384, 32768, 1048576]."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = {"k": 1024, "m": 1024 ** 2}.get(p[-1], 1)
        out.append(int(float(p[:-1] if mult > 1 else p) * mult))
    return out


def fit_table(cfg: Config, gpus: list[int], windows: list[int], gpu_gb: float,
              calib: Optional[Calibration] = None, ops: Optional[str] = None,
              sp: Optional[int] = None, host_gb: Optional[float] = None) -> list[dict]:
    """One row per (gpus, window); sp = gpus, or a fixed sp (dp = gpus / sp; others skipped).
    host_gb: pinned host memory per GPU the suggestions may use for offloaded activations."""
    rows = []
    for g in gpus:
        if sp is not None and (g % sp or sp > g):
            log.warning("plan: %d GPUs is not a multiple of sp=%d; row skipped", g, sp)
            continue
        for w in windows:
            s = Setup.from_config(cfg, gpus=g, window=w, ops=ops, sp=sp)
            e = estimate(s, calib)
            frac = e.gpu_gb / gpu_gb
            v = verdict(frac)
            limiting = e.limiting
            if host_gb is not None and e.host_gb > host_gb:   # offloaded activations need the host too
                v, limiting = "impossible", f"pinned host memory {e.host_gb:.0f} GB > {host_gb:g} GB per GPU"
            rows.append({"gpus": g, "sp": s.sp, "window": w, "tokens_per_rank": s.tokens_per_rank,
                         "gb_per_gpu": e.gpu_gb, "host_gb_per_gpu": e.host_gb, "frac": frac, "verdict": v,
                         "limiting": limiting,
                         "phase": e.phase,
                         "suggestion": suggest(s, gpu_gb, calib, host_gb=host_gb) if v != "comfortable" else None})
    return rows


def _fmt_tokens(n: int) -> str:
    if n % 1024 ** 2 == 0:
        return f"{n // 1024 ** 2}M"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def format_table(rows: list[dict], gpu_gb: float, host_gb: Optional[float] = None) -> str:
    lines = [f"| GPUs | sp | target | tok/rank | GB/GPU | % of {gpu_gb:g} GB | verdict | limiting term |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['sp']} | {_fmt_tokens(r['window'])} | {r['tokens_per_rank']:,} | "
                     f"{r['gb_per_gpu']:.1f} | {r['frac']:.1%} | {r['verdict']} | {r['limiting']} |")
    hosts = [r for r in rows if r.get("host_gb_per_gpu")]
    if hosts:
        lines.append("")
        lines.append("Pinned host memory for offloaded activations (memory.offload_activations), per GPU: " +
                     ", ".join(f"{r['gpus']} GPUs {_fmt_tokens(r['window'])}: {r['host_gb_per_gpu']:.1f} GB"
                               for r in hosts)
                     + ("" if host_gb is not None else
                        " (not checked against any host: pass --host-gb, the pinned memory one GPU's share "
                        "of its node can give, to mark rows that need more impossible)"))
    sugg = [r for r in rows if r["verdict"] != "comfortable"]
    if sugg:
        lines.append("")
        lines.append("Cheapest change to fit:")
        for r in sugg:
            lines.append(f"- {r['gpus']} GPUs, {_fmt_tokens(r['window'])}: "
                         f"{r['suggestion'] or 'nothing in reach (more GPUs than 64)'}")
    return "\n".join(lines)
