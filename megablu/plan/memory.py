"""The analytical GPU memory model per rank: Setup -> Estimate (the peak and its terms).

Everything is bytes per GPU (1 GB = 1e9 B, as the bench tables and the probe report).
A training step's peak is

    peak = persistent (params, grads, optimizer by ZeRO stage/offload)
         + max(forward end:  saved activations of every layer + loss working set,
               backward:     saved activations + one layer's recomputed working set + grads in flight,
               optimizer step: the fp32 gradient partition)

Saved activations per token per layer follow megablu/model/decoder.py and the ops it calls
(bf16 = 2 B; d = d_model, F = ffn_dim, q = H*D, kv = Hkv*D):
- ops=torch (the reference path, what experiments/speed/LOG.md measured first): each RMSNorm keeps r.float()
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
HF's 1.29 MB/token with checkpointing, experiments/speed/LOG.md). memory.loss=liger (Liger's
fused linear CE, accum_dtype=fp32, liger-kernel 0.8.5's fused_linear_cross_entropy.py): bf16
logits of one chunk and the fp32 dW (4Vd) in its loop (the chunk: the largest of at most loss_chunk
tokens Liger makes, utils/liger.py; loss_chunk 0: its own, next_pow2(T / ceil(V/d)) tokens),
then the fp32 dW and its bf16 cast (6Vd); + dh (2d), the fp32 per-token loss and the label
mask per token: 0.684 GB at T=32k for blu-0.5b (experiments/speed/LOG.md's loss table holds it against a run).
memory.attention=fa4 saves what SDPA saves (q, k, v, out, fp32 LSE); its backward's buffers
differ (flash-attn-4 4.0.0b40 interface.py `_flash_attn_bwd`, read, not measured): the fp32 dq
accumulator, two fp32 row scratches per head, and with GQA fp32 dk/dv accumulators at the kv
head count instead of SDPA's dk/dv at the query head count.
Sliding-window layers (model.sliding_layers, ops/window_attention.py) longer than one block of C rows
(C = the window rounded up to 128) run SDPA per block on keys concatenated from nb + 1 chunks (nb =
ceil((window - 1) / C)): SDPA saves those copies, (nb + 1) x k and v per token beside the rest
(`window_copies_per_token`). Their one (C, (nb + 1) C) mask per layer (1 MiB at window 512) and a block's
scores (inside the fused kernel) are not per token and not counted; nor is the mask of a sequence of one
block or less (the dense call on <= C + window keys).
Under Ulysses SP a rank holds T/sp tokens; the attention output is saved twice (before and
after the all-to-all back) and kv heads replicated to a multiple of sp grow k and v.
memory.mlp_tiles = n (memory/tiled.py): the MLP's (T, ffn) tensors are never saved (its input
is), and the backward rebuilds them one tile at a time: the ffn parts of the rebuilt working
set and of the grads in flight shrink by n; + the tiled dx and fp32 weight-grad sums.
memory.offload_activations (memory/offload.py): the layers' saved sets live in pinned host
memory (`host_gb`); on the GPU about two layers' sets remain (forward: the block running +
one block's copies in flight; backward: the block running + the one prefetched), plus what
is outside the blocks (final norm, RoPE tables, ids). Storages under 1 MiB stay on the GPU
(memory/constants.py MIN_BYTES: rstd; ignored here).
ZeRO shards over every rank that holds the same parameters (dp*sp = world; DeepSpeed
partitions over its sequence-data-parallel group).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..config.schema import Config, ModelConfig
from ..memory.constants import KEEP_LAST, MAX_INFLIGHT, offloaded_count
from ..parallel.heads import head_plan
from ..utils.device import peak_bf16_tflops
from ..utils.liger import liger_chunk_tokens, liger_mem_const
from ..utils.window import block_rows, earlier_chunks

GB = 1e9
BF16 = 2
FP32 = 4
_H200 = peak_bf16_tflops("NVIDIA H200")  # dense bf16: the one table, utils/device.py
assert _H200 is not None, "utils/device.PEAK_BF16_TFLOPS must list the NVIDIA H200 (the planner's reference)"
PEAK_TFLOPS_H200: float = _H200
COMFORTABLE = 0.80  # <= 80% of the GPU: comfortable
# DeepSpeed defaults the trainer does not override (runtime/zero/config.py)
ZERO_REDUCE_BUCKET = 5e8  # elements, stage 2/3 contiguous gradient bucket
ZERO3_PREFETCH_BUCKET = 5e7  # elements, stage 3 parameter prefetch
ALLOC_SLACK = 0.05  # caching-allocator fragmentation over max_memory_allocated
CUDA_CONTEXT_GB = 0.8  # CUDA context + library handles, outside the allocator


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
    ops: str = "cuda"  # cuda: fused kernels (GPU default); torch: reference ops
    optimizer: bool = True  # False: fwd+bwd only (the bench rows), grads kept bf16
    mlp_tiles: int = 1  # memory.mlp_tiles
    offload_activations: bool = False  # memory.offload_activations
    offload_keep: int = 1  # memory.offload_keep: the last blocks whose saved sets stay on the GPU
    offload_fraction: float = 1.0  # memory.offload_fraction: the share of the others that offload
    loss: str = "chunked"  # the loss that runs: chunked | liger (memory.loss=auto resolved)
    attention: str = "sdpa"  # the kernel that runs: sdpa | fa4 (memory.attention=auto resolved)

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        gpus: Optional[int] = None,
        window: Optional[int] = None,
        sp: Optional[int] = None,
        ops: Optional[str] = None,
        loss: Optional[str] = None,
    ) -> Setup:
        """loss: the implementation that runs (a probe's); default memory.loss, where auto is what it picks
        for a GPU run in this environment (liger when liger_kernel imports here, else chunked); the same for
        attention (memory.attention=auto: fa4 when the config allows it and flash_attn.cute imports here)."""
        p = cfg.parallel
        if loss is None and cfg.memory.loss == "auto":
            from ..ops.cross_entropy import auto_loss

            loss = auto_loss("cuda")[0]
        attention: str = cfg.memory.attention
        if attention == "auto":
            from ..ops.attention import auto_for_config

            attention = auto_for_config(cfg, "cuda")[0]
        g = gpus if gpus is not None else p.sp
        return cls(
            model=cfg.model,
            window=window or cfg.data.window,
            gpus=g,
            sp=sp if sp is not None else (g if gpus is not None else p.sp),
            zero_stage=p.zero_stage,
            offload_optimizer=p.offload_optimizer,
            offload_params=p.offload_params,
            recompute=cfg.memory.recompute,
            loss_chunk=cfg.memory.loss_chunk,
            micro_batch=cfg.train.micro_batch,
            ops=ops or ("torch" if cfg.memory.ops == "torch" else "cuda"),
            mlp_tiles=cfg.memory.mlp_tiles,
            offload_activations=cfg.memory.offload_activations,
            offload_keep=cfg.memory.offload_keep,
            offload_fraction=cfg.memory.offload_fraction,
            loss=loss or cfg.memory.loss,
            attention=attention,
        )

    def to_json(self) -> dict:
        """Plain JSON (probe.json's "setup"; from_json reads it back)."""
        return {**asdict(self), "model": self.model.model_dump()}

    @classmethod
    def from_json(cls, d: dict) -> Setup:
        """A Setup from to_json's dict; keys that are not Setup fields (a probe's ops_config) are ignored."""
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**d, "model": ModelConfig(**d["model"])})

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
        mem += f" keep={self.offload_keep}" if self.offload_activations and self.offload_keep != 1 else ""
        mem += f" fraction={self.offload_fraction:g}" if self.offload_activations and self.offload_fraction != 1 else ""
        loss = (
            "loss=liger" + (f" loss_chunk={self.loss_chunk}" if self.loss_chunk > 0 else "")
            if self.loss == "liger"
            else f"loss_chunk={self.loss_chunk}"
        )
        attn = f" attention={self.attention}" if self.attention != "sdpa" else ""
        return (
            f"gpus={self.gpus} sp={self.sp} zero={self.zero_stage}{off} recompute={self.recompute}{mem} "
            f"{loss} ops={self.ops}{attn}"
        )


@dataclass
class Calibration:
    """Corrections fitted from probes: activations x act_scale, static + static_offset_gb."""

    act_scale: float = 1.0
    static_offset_gb: float = 0.0
    source: list = field(default_factory=list)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


@dataclass
class Estimate:
    setup: Setup
    terms: dict  # name -> bytes (the peak's composition)
    phase: str  # which phase is the peak
    static: float  # bytes before the first step (params + optimizer states)
    per_token: float  # bytes per token per rank of saved activations on the GPU (after calibration)
    host: float = 0.0  # pinned host bytes per rank for offloaded activations

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
    """kv replication of Ulysses (parallel/heads.py; its padded-heads branch expands to MHA)."""
    return 1 if sp == 1 else head_plan(m.n_heads, m.n_kv_heads, sp)[0]


def layer_bytes_per_token(
    m: ModelConfig, ops: str, sp: int = 1, attention: str = "sdpa", window_copies: float = 0.0
) -> dict:
    """Saved bytes per token per layer, by part: attn half, MLP half, the layer input, h.
    attention: memory.attention (the backward's buffers differ, module docstring). window_copies: what a
    sliding-window layer's blocks save beside (`window_copies_per_token`), in the attention half."""
    d, F, hd = m.d_model, m.ffn_dim, m.resolved_head_dim
    q, kv = m.n_heads * hd, m.n_kv_heads * hd * _kv_rep(m, sp)
    # norm: torch keeps r.float() (4d) + the normalised bf16 (2d); cuda keeps r (2d); + rstd
    norm = (FP32 * d + BF16 * d + FP32) if ops == "torch" else (BF16 * d + FP32)
    attn = (
        norm
        + BF16 * d  # norm + its output y (q/k/v proj input)
        + BF16 * (q + 2 * kv)  # post-RoPE q, k, v (SDPA)
        + BF16 * q
        + FP32 * m.n_heads
        + window_copies
    )  # attention output + LSE (+ a sliding layer's key/value copies)
    if sp > 1:
        attn += BF16 * q  # output saved again after the all-to-all back
    mlp = (
        norm
        + BF16 * d  # second norm + its output (gate/up input)
        + BF16 * F * (4 if ops == "torch" else 3)
    )  # gate, up, (silu(gate)), down input
    # the attention backward (SDPA's flash kernel, FA2): an fp32 dq accumulator; with GQA
    # (fewer kv heads than q heads on the rank) dk and dv at q's head count before their sum
    # over the group; dq, dk, dv; the fp32 softmax row sums. Beside it: the output's grad from
    # o_proj and the residual grad. 5.5 KB/token above the MLP backward's point for blu-0.5b:
    # 2.9 GB at 512k.
    gqa_expand = 2 * BF16 * q if kv < q else 0
    scratch = FP32 * m.n_heads
    if attention == "fa4":
        # FA4: fp32 dk/dv accumulators at the kv head count, and two fp32 row scratches per head
        gqa_expand = 2 * FP32 * kv if kv < q else 0
        scratch = 2 * FP32 * m.n_heads
    return {
        "attn": attn,
        "mlp": mlp,
        "input": BF16 * d,
        "h": BF16 * d,
        "mlp_ffn": BF16 * F * (4 if ops == "torch" else 3),  # the (T, ffn) part of "mlp"
        # grads in flight at the MLP backward: d(down input) and d(gate), d(up) (3F) while
        # the down input is already freed (-F), + the residual grad
        "bwd_extra": BF16 * (2 * F + d),
        "attn_bwd": BF16 * d + BF16 * q + FP32 * q + gqa_expand + BF16 * (q + 2 * kv) + scratch,
        "a2a": 3 * BF16 * (2 * q + 2 * kv) if sp > 1 else 0,
    }


def window_copies_per_token(m: ModelConfig, tokens: int, sp: int = 1) -> float:
    """Bytes per token per rank one sliding-window layer saves beyond SDPA's q, k, v, output and LSE, for a
    sequence of `tokens` (the attention sees the whole sequence, under Ulysses too): the keys and values
    each block concatenates, nb + 1 chunks of C (ops/window_attention.py), so (nb + 1) copies of k and v.
    0 without sliding layers, or when the sequence is one block or less (module docstring)."""
    if m.sliding_window is None or not m.sliding_layers:
        return 0.0
    block = block_rows(m.sliding_window)
    if tokens <= block:
        return 0.0
    kv = m.n_kv_heads * m.resolved_head_dim * _kv_rep(m, sp)
    return (earlier_chunks(m.sliding_window, block) + 1) * 2 * BF16 * kv


def mean_window_copies(m: ModelConfig, tokens: int, sp: int = 1) -> float:
    """window_copies_per_token spread over all layers (the sliding ones hold it): what the sums over
    layers below add per layer."""
    return window_copies_per_token(m, tokens, sp) * len(m.sliding_layers) / m.n_layers


def saved_per_layer(lb: dict, recompute: str, mlp_tiles: int = 1) -> float:
    """Bytes per token one layer saves for backward (lb = layer_bytes_per_token)."""
    if recompute == "none":
        # the layer input is kept by the first norm (as r, or as r.float() on the torch path);
        # tiled, the MLP saves its input y only (in lb["mlp"] as the norm's output), not the ffn part
        return lb["attn"] + lb["mlp"] - (lb["mlp_ffn"] if mlp_tiles > 1 else 0)
    if recompute == "selective":
        return lb["attn"] + lb["h"]  # tiled or not: the checkpoint / the tiled norm+MLP keeps h
    if recompute == "full":
        return lb["input"]
    raise ValueError(f"memory.recompute must be none|selective|full, got {recompute!r}")


def outside_layers_per_token(m: ModelConfig, ops: str) -> float:
    """Saved bytes per token outside the blocks: final norm, RoPE tables, ids."""
    d, hd = m.d_model, m.resolved_head_dim
    final_norm = (FP32 * d + BF16 * d) if ops == "torch" else BF16 * d
    rope = 2 * BF16 * hd  # cos, sin (B, T, D), shared by all layers
    ids = 3 * 8  # input ids, labels, positions (int64)
    return final_norm + rope + ids


OFFLOAD_RESIDENT_LAYERS = MAX_INFLIGHT  # memory/offload.py: the block running + one in flight / prefetched
OFFLOAD_KEPT_LAYERS = KEEP_LAST  # memory/offload.py: the final blocks never leave the GPU


def resident_layers(n_layers: int, keep: int = OFFLOAD_KEPT_LAYERS, fraction: float = 1.0) -> int:
    """Layers' saved sets on the GPU with activation offload: the blocks never offloaded (the `keep`
    last, and 1 - fraction of the others) + one offloaded block running or in flight / prefetched
    (OFFLOAD_RESIDENT_LAYERS = 2 with the defaults: the last block and the one prefetched)."""
    kept = n_layers - offloaded_count(n_layers, keep, fraction)
    return min(n_layers, max(OFFLOAD_RESIDENT_LAYERS, kept + OFFLOAD_RESIDENT_LAYERS - OFFLOAD_KEPT_LAYERS))


def saved_per_token(
    m: ModelConfig,
    recompute: str,
    ops: str,
    sp: int = 1,
    mlp_tiles: int = 1,
    offload: bool = False,
    keep: int = OFFLOAD_KEPT_LAYERS,
    fraction: float = 1.0,
    tokens: int = 0,
) -> float:
    """Bytes per token per rank saved for backward on the GPU over all layers + head + RoPE tables.
    tokens: the sequence length, for the sliding-window layers' copies (0: not counted)."""
    lb = layer_bytes_per_token(m, ops, sp, window_copies=mean_window_copies(m, tokens, sp))
    per_layer = saved_per_layer(lb, recompute, mlp_tiles)
    layers = resident_layers(m.n_layers, keep, fraction) if offload else m.n_layers
    return layers * per_layer + outside_layers_per_token(m, ops)


def host_per_token(
    m: ModelConfig,
    recompute: str,
    ops: str,
    sp: int = 1,
    mlp_tiles: int = 1,
    keep: int = OFFLOAD_KEPT_LAYERS,
    fraction: float = 1.0,
    tokens: int = 0,
) -> float:
    """Pinned host bytes per token per rank with memory.offload_activations: the saved sets of the
    blocks that offload (all but the last `keep`, memory.offload_keep, or `fraction` of them spread
    evenly, memory.offload_fraction: memory/constants.py offloaded); tokens as in saved_per_token."""
    lb = layer_bytes_per_token(m, ops, sp, window_copies=mean_window_copies(m, tokens, sp))
    return offloaded_count(m.n_layers, keep, fraction) * saved_per_layer(lb, recompute, mlp_tiles)


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
    rebuilt = {
        "none": ffn / n,  # the tiles' ffn tensors
        "selective": (rest + ffn) / n,  # norm + MLP rebuilt per tile
        "full": lb["attn"] + rest + ffn / n,
    }[recompute]
    d2 = lb["h"]  # BF16 * d
    grads = (lb["bwd_extra"] - d2) / n + d2 + d2  # ffn grads per tile + residual grad + tiled dx
    return max(rebuilt + grads + lb["a2a"], attn_point)


def liger_chunk(m: ModelConfig, tokens: int, chunk: int = 0) -> int:
    """Liger's tokens per chunk under memory.loss_chunk=`chunk` (utils/liger.py: the largest chunk of at
    most `chunk` tokens Liger makes; 0 = its own, next_pow2(ceil(T / ceil(V / d))); <= T)."""
    c = liger_mem_const(tokens, m.d_model, m.vocab_size, chunk)
    return liger_chunk_tokens(tokens, m.d_model, m.vocab_size, c)


def loss_bytes(m: ModelConfig, tokens: int, chunk: int, loss: str = "chunked") -> tuple[float, float]:
    """(bytes independent of T, bytes per token) of the loss at its forward peak."""
    V, d = m.vocab_size, m.d_model
    if loss == "liger":
        # its loop: fp32 dW + one chunk's bf16 logits; its end: fp32 dW + the bf16 dW cast
        const = max(FP32 * V * d + BF16 * liger_chunk(m, tokens, chunk) * V, (FP32 + BF16) * V * d)
        return const, BF16 * d + FP32 + 1  # dh, the fp32 per-token loss, the label mask
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
    per_tok = (
        saved_per_token(
            m,
            s.recompute,
            s.ops,
            s.sp,
            s.mlp_tiles,
            s.offload_activations,
            s.offload_keep,
            s.offload_fraction,
            tokens=s.window,
        )
        * a
    )
    # one layer's working set: a sliding layer's, copies included, where the model has one (the larger)
    lb = layer_bytes_per_token(m, s.ops, s.sp, s.attention, window_copies_per_token(m, s.window, s.sp))
    loss_const, loss_tok = loss_bytes(m, t, s.loss_chunk, s.loss)
    fwd_end = per_tok * t + (loss_const + loss_tok * t) * a
    layer_ws = layer_working_set(lb, s.recompute, s.mlp_tiles) * a
    # tiled: fp32 sums of the MLP weights' grads over tiles (memory/tiled.py), one layer at a time
    tile_acc = FP32 * 3 * m.d_model * m.ffn_dim if s.mlp_tiles > 1 else 0.0
    bwd = per_tok * t + layer_ws * t + tile_acc
    host = (
        host_per_token(m, s.recompute, s.ops, s.sp, s.mlp_tiles, s.offload_keep, s.offload_fraction, s.window) * a * t
        if s.offload_activations
        else 0.0
    )
    step = FP32 * N / K if (s.optimizer and not s.offload_optimizer) else 0.0
    phases = {"forward end": fwd_end, "backward": bwd, "optimizer step": step}
    phase = max(phases, key=lambda k: phases[k])
    act = f"activations ({s.recompute}, " + (
        f"{resident_layers(m.n_layers, s.offload_keep, s.offload_fraction)} of "
        f"{m.n_layers} layers "
        f"on the GPU, rest on host)"
        if s.offload_activations
        else f"{m.n_layers} layers)"
    )
    if phase == "forward end":
        terms[act] = per_tok * t
        what = (
            f" (liger, chunk {liger_chunk(m, t, s.loss_chunk)})"
            if s.loss == "liger"
            else f" (chunk {s.loss_chunk})"
            if s.loss_chunk
            else " (unchunked fp32 [T, V])"
        )
        terms["loss" + what] = (loss_const + loss_tok * t) * a
    elif phase == "backward":
        terms[act] = per_tok * t
        terms["backward working set (one layer" + (" + all-to-all" if s.sp > 1 else "") + ")"] = bwd - per_tok * t
    else:
        terms["optimizer step (fp32 grad partition)"] = step
    return Estimate(setup=s, terms=terms, phase=phase, static=static, per_token=per_tok, host=host)


def flops_per_token(m: ModelConfig, window: int) -> float:
    """Model flops per token: 6N (input embedding excluded: a lookup) + causal attention 6 L T H D."""
    n = m.n_params() - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    return 6.0 * n + 6.0 * m.n_layers * window * m.n_heads * m.resolved_head_dim
