"""BluModel: a Llama-style decoder. Architecture only (no deepspeed import).

Families (model/hf.py imports and exports them; docs/MODELS.md) are switches of this one class,
off by default (config model.*): qk_norm (Qwen3 per head, OLMo 2 over the projection),
norm_layout=post (OLMo 2), nope_layers (SmolLM3's layers without RoPE), and Gemma 3's norm_offset,
embed_scale, activation=gelu_tanh, norm_layout=sandwich and sliding_layers (a window of
sliding_window tokens, their own RoPE at rope.local_theta: `rotary_local`).

Layout convention: activations are (B, T, d); attention works on (B, T, H, D) so that
DeepSpeed's DistributedAttention (scatter heads, gather sequence) can wrap the inner
kernel `Attention.core` unchanged (parallel/ulysses.py swaps it from outside).

Packed rows (data.doc_mask): `doc_ids` (B, S) make attention document-causal
(ops/doc_attention.py); the DocMask is built once per forward and handed to every layer's
kernel, through Ulysses too (it sees the full S). `rope_len` picks each token's RoPE under
rope.yarn.apply=beyond_original (model/rope.py, model/packing.py).

STRING (eval.string) is installed from outside too, for evaluation only: model/string.py
`apply_string(model, cfg, length)` hooks the rotary and replaces each Attention's forward; nothing here
knows of it (the KV cache only has room for the extra keys such a wrapper keeps).

Memory switches (config `memory:`: recompute, mlp_tiles, offload_activations, loss_chunk,
loss, attention, ops, fuse_qkv, fuse_gate_up, fuse_block_add) are applied from outside, like Ulysses:
megablu/memory/apply.py `apply_memory(model, cfg.memory)` installs them on the blocks, the MLPs, the
attention kernels and the head of a built model. The three fusions are flags read here (`Attention.fuse_qkv`,
`MLP.fuse_gate_up`, `Block.defer_add`), off by default; each computes the same function with the same
parameters (names and shapes unchanged): one GEMM for q/k/v and one for gate/up (ops/linear.py), and the MLP
residual add of block i done inside block i+1's input norm (ops.add_rms_norm, as the attention residual add is
inside a block).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config.schema import ModelConfig, RopeConfig
from ..ops.attention import causal_attention
from ..ops.cross_entropy import linear_cross_entropy
from ..ops.doc_attention import DocMask, doc_attention
from ..ops.window_attention import window_attention
from .packing import document_lengths
from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, cast back, then * weight (HF LlamaRMSNorm order).

    offset (model.norm_offset, Gemma): the scale is 1 + weight (Gemma3RMSNorm; it multiplies in fp32
    before the cast, the same numbers in fp32). `impl` picks the kernel (megablu.ops: fused CUDA or the
    pure-torch reference)."""

    def __init__(self, dim: int, eps: float, impl: Optional[str] = None, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.impl, self.offset = eps, impl, offset

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.scale(), self.eps, impl=self.impl)


@dataclass
class KVCache:
    """Per-layer keys/values (B, S, Hkv_local, D) after RoPE, for incremental decoding.

    `seq_sharded` tells a sequence-parallel attention whether the current call's inputs are
    slices of one sequence across ranks (prefill) or the same tokens on every rank (decode).

    `rope_len` is the total length each sequence will reach, prompt + max_new: an int, or a
    (B,) tensor when the rows differ. Under rope.yarn.apply=beyond_original it picks the RoPE
    once per sequence, before the prefill -- the original one when rope_len <=
    original_max_position, YaRN otherwise -- and every later step reuses that choice, so
    the cached keys never mix two ropes (a switch decided by the length reached so far
    would change rope mid-generation). Whoever creates a cache for generation sets it
    (eval/generate.py does); the model refuses a beyond_original forward without it.
    Ignored by the other ropes.

    `ks` holds a second copy of each key beside `k`, position for position, for an attention installed
    from outside that keeps one (STRING, model/string.py: append_shifted); it stays empty otherwise.
    """

    n_layers: int
    seq_sharded: bool = False
    rope_len: Optional[object] = None  # int | torch.Tensor (B,)
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    ks: list = field(default_factory=list)

    def __post_init__(self):
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.ks = [None] * self.n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=1)
            self.v[layer] = torch.cat([self.v[layer], v], dim=1)
        return self.k[layer], self.v[layer]

    def append_shifted(self, layer: int, ks: torch.Tensor) -> torch.Tensor:
        """STRING's shifted keys of the new tokens; -> all of the layer's shifted keys."""
        self.ks[layer] = ks if self.ks[layer] is None else torch.cat([self.ks[layer], ks], dim=1)
        return self.ks[layer]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep these batch rows ((B',) indices), in that order (a decode drops the rows that are done)."""
        for ts in (self.k, self.v, self.ks):
            for i, t in enumerate(ts):
                if t is not None:
                    ts[i] = t.index_select(0, rows)
        if isinstance(self.rope_len, torch.Tensor) and self.rope_len.dim() > 0:
            self.rope_len = self.rope_len.index_select(0, rows.to(self.rope_len.device))

    def truncate(self, length: int) -> None:
        """Drop cached positions >= length (e.g. the end padding of an sp-sharded prefill)."""
        self.k = [None if t is None else t[:, :length] for t in self.k]
        self.v = [None if t is None else t[:, :length] for t in self.v]
        self.ks = [None if t is None else t[:, :length] for t in self.ks]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[1]


class LocalAttention(nn.Module):
    """Causal attention on (B, T, H, D) q and (B, S, Hkv, D) k/v; GQA without materialising repeats.

    `kernel` (memory.attention, set by megablu.memory.apply_memory) runs the causal case T == S
    (training, a prefill): "sdpa", "fa4" or "auto" (ops/attention.py). A decode step (T < S, a KV
    cache) runs SDPA with a bottom-right causal mask whatever the kernel. With `docs` (a DocMask
    over these T tokens) the attention is document-causal instead, on the kernel the DocMask
    chose (FlexAttention on CUDA); fa4 refuses it.

    `window` (model.sliding_window on the layers of model.sliding_layers): a query at i attends to keys
    i - window < j <= i only, through SDPA by blocks of queries whatever the kernel (ops/window_attention.py;
    under Ulysses too: this kernel sees the whole sequence). The config refuses the window with fa4 or doc_mask."""

    def __init__(self, layer_idx: int = 0, window: Optional[int] = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel = "sdpa"
        self.window = window

    def forward(self, q, k, v, cache: Optional[KVCache] = None, docs: Optional[DocMask] = None):
        if self.window is not None:
            if docs is not None:
                raise ValueError(
                    "a sliding-window layer (model.sliding_layers) with document masking "
                    "(data.doc_mask): no kernel here applies both; set data.doc_mask=false"
                )
            if cache is not None:
                k, v = cache.append(self.layer_idx, k, v)
            return self._windowed(q, k, v)
        if docs is not None:
            if cache is not None:
                raise ValueError("document masking with a KV cache is not supported (generation runs one sequence)")
            if self.kernel == "fa4":
                raise ValueError(
                    "memory.attention=fa4 runs plain causal attention; document masking (data.doc_mask) "
                    "runs on FlexAttention: set memory.attention=sdpa"
                )
            return doc_attention(q, k, v, docs)
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v)
        return self._plain(q, k, v)

    def _windowed(self, q, k, v):
        """q (B, T, H, D) over k, v (B, tk, Hkv, D), bottom-right aligned, each query seeing its last
        `window` keys (itself included), as transformers' sliding_window_causal mask (ops/window_attention.py:
        by blocks of query rows, never a (T, tk) mask)."""
        return window_attention(q, k, v, self.window)

    def _plain(self, q, k, v):
        """Causal attention of q (B, T, H, D) over k, v (B, tk, Hkv, D), tk >= T (bottom-right aligned)."""
        tq, tk = q.shape[1], k.shape[1]
        if tq == tk:
            return causal_attention(q, k, v, self.kernel)
        # (B, T, H, D) -> (B, H, T, D)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if tq == 1:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:
            # new tokens attend to the whole past plus causally among themselves (bottom-right aligned)
            i = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
            mask = torch.arange(tk, device=q.device)[None, :] <= i
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, impl: Optional[str] = None):
        super().__init__()
        self.impl = impl
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        d, hd = cfg.d_model, self.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        # q/k RMSNorm before RoPE: "head" normalises each (.., D) head with one D-weight shared by the
        # heads (Qwen3: q_norm(q_proj(x).view(B, T, H, D))); "proj" the whole (.., H*D) projection
        # before the split into heads (OLMo 2: q_norm(q_proj(x)))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            nq, nk = (hd, hd) if cfg.qk_norm == "head" else (self.n_heads * hd, self.n_kv_heads * hd)
            self.q_norm = RMSNorm(nq, cfg.norm_eps, impl, cfg.norm_offset)
            self.k_norm = RMSNorm(nk, cfg.norm_eps, impl, cfg.norm_offset)
        # NoPE layers (SmolLM3): attention sees q and k without any rotation
        self.rope = layer_idx not in cfg.nope_layers
        self.sliding = layer_idx in cfg.sliding_layers
        # The inner kernel; apply_ulysses replaces it with a sequence-parallel wrapper.
        self.core: nn.Module = LocalAttention(layer_idx, cfg.sliding_window if self.sliding else None)
        # memory.fuse_qkv (set by megablu.memory.apply_memory): q, k and v as one GEMM
        self.fuse_qkv = False

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) projections of x (B, T, d): (B, T, H*D), (B, T, Hkv*D) twice. Three GEMMs, or with
        fuse_qkv one over the three weights concatenated (ops/linear.py), split into views of its output."""
        if not self.fuse_qkv:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        ps = (self.q_proj, self.k_proj, self.v_proj)
        y = ops.packed_linear(x, [p.weight for p in ps], [p.bias for p in ps])
        q, k, v = y.split([p.out_features for p in ps], dim=-1)
        # q and k leave through RoPE (new tensors); v reaches the attention kernel, which saves it for the
        # backward: as a view it would keep the whole (B, T, (H + 2 Hkv) D) output alive (offloaded whole), so
        # it gets its own (B, T, Hkv*D) storage
        return q, k, v.contiguous()

    def forward(self, x, cos, sin, cache: Optional[KVCache] = None, docs: Optional[DocMask] = None):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = ops.apply_rotary(q, k, cos, sin, impl=self.impl)
        if cache is not None:
            out = self.core(q, k, v, cache)
        elif docs is not None:
            out = self.core(q, k, v, docs=docs)
        else:
            out = self.core(q, k, v)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU with activation=gelu_tanh (Gemma's gelu_pytorch_tanh).

    fuse_gate_up (memory.fuse_gate_up, set by megablu.memory.apply_memory): gate and up as one GEMM
    (ops/linear.py) into a (..., 2*ffn) [gate | up] tensor that ops.swiglu_packed takes whole (its backward
    returns the packed gradient: no split, no concatenation)."""

    def __init__(self, cfg: ModelConfig, impl: Optional[str] = None):
        super().__init__()
        self.impl = impl
        self.gelu = cfg.activation == "gelu_tanh"
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.fuse_gate_up = False

    def forward(self, x):
        if self.fuse_gate_up:
            gu = ops.packed_linear(x, (self.gate_proj.weight, self.up_proj.weight))
            if self.gelu:
                gate, up = gu.chunk(2, dim=-1)
                return self.down_proj(F.gelu(gate, approximate="tanh") * up)
            return self.down_proj(ops.swiglu_packed(gu, impl=self.impl))
        if self.gelu:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x), impl=self.impl))


class Block(nn.Module):
    """norm_layout pre (Llama): h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).
    post (OLMo 2): h = x + post_attention_layernorm(attn(x)); out = h + post_feedforward_layernorm(mlp(h)).
    sandwich (Gemma 3): h = x + post_attention_layernorm(attn(input_layernorm(x)));
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).
    The names are transformers' (an import/export maps them by prefix).

    memory.fuse_block_add (pre only; megablu.memory.apply_memory sets `defer_add` on every block but the
    last): the block returns (h, mlp branch) unsummed, and the next block receives them as (x, pending) and
    forms its input x + pending inside its input_layernorm (ops.add_rms_norm: one pass writes the sum and its
    norm, and its backward adds the residual gradient itself). The last block adds: its output is the
    hidden state the final norm and the eval's hooks read."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, impl: Optional[str] = None):
        super().__init__()
        self.impl = impl
        self.layout = cfg.norm_layout

        def norm():
            return RMSNorm(cfg.d_model, cfg.norm_eps, impl, cfg.norm_offset)

        if self.layout != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer_idx, impl)
        self.post_attention_layernorm = norm()
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.layout != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, impl)
        self.defer_add = False  # memory.fuse_block_add: return (h, mlp branch) for the next block to add

    def input_norm(self, x: torch.Tensor, pending: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm(x'), x') for the block input x' = x + pending (norm_layout pre): `pending` is the
        previous block's MLP branch it left unsummed (memory.fuse_block_add), added inside the norm's kernel;
        x' = x without it."""
        if pending is not None and self.layout != "pre":
            raise ValueError(
                f"a pending residual (memory.fuse_block_add) needs model.norm_layout=pre, got {self.layout}"
            )
        n = self.input_layernorm
        if pending is None:
            return n(x), x
        return ops.add_rms_norm(pending, x, n.scale(), n.eps, impl=n.impl)

    def attend(
        self,
        x,
        cos,
        sin,
        cache: Optional[KVCache] = None,
        docs: Optional[DocMask] = None,
        pending: Optional[torch.Tensor] = None,
    ):
        """x' + the attention branch (the first residual), x' = x + pending (see input_norm)."""
        if self.layout == "pre" or pending is not None:
            y, x = self.input_norm(x, pending)
            return x + self.self_attn(y, cos, sin, cache, docs)
        a = self.self_attn(x if self.layout == "post" else self.input_layernorm(x), cos, sin, cache, docs)
        return x + self.post_attention_layernorm(a)

    @property
    def ffn_norms(self) -> tuple:
        """The norms the MLP branch reads (before the MLP, after it, or both)."""
        if self.layout == "pre":
            return (self.post_attention_layernorm,)
        if self.layout == "post":
            return (self.post_feedforward_layernorm,)
        return (self.pre_feedforward_layernorm, self.post_feedforward_layernorm)

    def ffn(self, h, mlp=None):
        """The MLP branch of h (row-wise), out = h + ffn(h); `mlp` replaces self.mlp (an untiled one)."""
        mlp = mlp or self.mlp
        if self.layout == "pre":
            return mlp(self.post_attention_layernorm(h))
        if self.layout == "post":
            return self.post_feedforward_layernorm(mlp(h))
        return self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(h)))

    def forward(
        self,
        x,
        cos,
        sin,
        cache: Optional[KVCache] = None,
        docs: Optional[DocMask] = None,
        pending: Optional[torch.Tensor] = None,
    ):
        """`docs`: document-causal attention (the same DocMask for every layer). cos/sin: this layer's
        rope tables (BluModel.forward picks the local ones for a sliding layer with rope.local_theta).
        `pending`: the previous block's unsummed MLP branch (input_norm). Returns the block's output, or
        with `defer_add` the pair (h, mlp branch) whose sum it is."""
        if self.layout != "pre":
            h = self.attend(x, cos, sin, cache, docs, pending)
            m = self.ffn(h)
            return (h, m) if self.defer_add else h + m
        y0, x = self.input_norm(x, pending)
        a = self.self_attn(y0, cos, sin, cache, docs)
        # fused residual add + norm: h = x + a, y = rmsnorm(h) in one pass
        n = self.post_attention_layernorm
        y, h = ops.add_rms_norm(a, x, n.scale(), n.eps, impl=self.impl)
        m = self.mlp(y)
        return (h, m) if self.defer_add else h + m


class LMHead(nn.Module):
    """Final projection; holds (or ties) the weight so ZeRO-3 gathers it when called.

    With labels, the summed loss through `loss` ("chunked" over `chunk`-token pieces of the vocab
    projection, 0 = unchunked; "liger": Liger's fused linear cross-entropy, in chunks of at most `chunk`
    tokens where Liger can make them, 0 = its own); megablu.memory.apply_memory
    sets both from memory.loss / loss_chunk, memory.loss=auto resolved to one of them (ops/cross_entropy.py)."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d))
        self.chunk = 0
        self.loss = "chunked"

    def forward(self, h: torch.Tensor, labels: Optional[torch.Tensor] = None):
        if labels is None:
            return F.linear(h, self.weight)
        return linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.weight, labels.reshape(-1), self.chunk, self.loss)


@contextlib.contextmanager
def _no_default_init():
    """Skip nn.Linear / nn.Embedding's own init while BluModel is built: reset_parameters
    writes every parameter anyway, and the default kaiming init of 1.5B parameters takes
    ~15 s of CPU time that is thrown away."""
    saved = {n: getattr(nn.init, n) for n in ("kaiming_uniform_", "uniform_", "normal_")}
    try:
        for n in saved:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


class BluModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RopeConfig, seed: Optional[int] = None):
        """seed: the init's own generator (reset_parameters(seed)); None uses torch's global RNG.

        The ops run their default implementation (auto); megablu.memory.apply_memory sets the
        configured one with the other memory switches."""
        super().__init__()
        with _no_default_init():
            self._build(cfg, rope)
        self.reset_parameters(seed)

    def _build(self, cfg: ModelConfig, rope: RopeConfig):
        self.cfg, self.rope_cfg = cfg, rope
        self.max_position: Optional[int] = None  # max_position_embeddings an HF import recorded (model/hf.py)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=cfg.norm_offset)
        self.rotary = RotaryEmbedding(cfg.resolved_head_dim, rope)
        # Gemma 3's sliding layers: plain RoPE at their own base, never scaled (their distances stay < the window)
        self.rotary_local = (
            RotaryEmbedding(cfg.resolved_head_dim, RopeConfig(theta=rope.local_theta))
            if rope.local_theta is not None and cfg.sliding_layers
            else None
        )
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            # torch's stubs type Embedding.weight as Tensor; it is the Parameter LMHead.weight is declared as
            self.lm_head.weight = self.embed_tokens.weight  # type: ignore[assignment]

    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(0.0 if self.cfg.norm_offset else 1.0)  # a scale of 1 either way
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                # GPT-2 style residual scaling: keeps the residual stream's variance ~constant in depth
                p.copy_(torch.randn(p.shape, generator=gen) * std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        logits_index: Optional[int] = None,
        doc_ids: Optional[torch.Tensor] = None,
        rope_len=None,
    ):
        """Logits (B, T, V) without labels; with labels, (sum of CE, labelled-token count).

        position_ids (B, T) are global positions: under sequence parallelism each rank
        passes the positions of its own slice (restarting per document is the caller's
        choice, data.doc_positions). logits_index (e.g. -1) returns the logits of
        that one position only, (B, 1, V): a long prefill never holds [T, V] logits.
        doc_ids (B, S): document-causal attention over packed documents; S is the length
        attention sees, T itself, or under Ulysses the full padded sequence of which
        input_ids is this rank's slice. None: plain causal attention.
        rope_len: under rope.yarn.apply=beyond_original, the length of the sequence each token
        belongs to (model/packing.py): an int, (B, 1) or (B, T). Default: cache.rope_len with a
        cache; each document's length with unsharded doc_ids; else T (the row as given).
        Sharded inputs must pass it (parallel/sequence.py shard_batch computes it).
        """
        B, T = input_ids.shape
        if doc_ids is not None and cache is not None:
            raise ValueError("doc_ids with a KV cache: document masking is for training on packed rows")
        if position_ids is None:
            start = cache.length if cache is not None and not cache.seq_sharded else 0
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        # one mask for every layer (and under Ulysses every rank: all see the full S)
        docs = DocMask(doc_ids.to(input_ids.device)) if doc_ids is not None else None
        h = self.embed_tokens(input_ids)
        if self.cfg.embed_scale:
            # Gemma: * sqrt(d_model), the factor rounded to the embedding's dtype as transformers does
            h = h * torch.tensor(self.cfg.d_model**0.5, dtype=h.dtype)
        rl = self._rope_len(B, T, cache, doc_ids, rope_len, input_ids.device) if self.rotary.length_aware else None
        cos, sin = self.rotary(position_ids, h.dtype, rl)
        local = self.rotary_local(position_ids, h.dtype) if self.rotary_local is not None else (cos, sin)
        pending = None  # memory.fuse_block_add: the MLP branch the previous block left to this one to add
        for layer in cast("Iterable[Block]", self.layers):  # nn.ModuleList iterates as nn.Module
            c, s = local if layer.self_attn.sliding else (cos, sin)
            if pending is None:
                out = layer(h, c, s, cache, docs=docs)
            else:
                out = layer(h, c, s, cache, docs=docs, pending=pending)
            h, pending = out if layer.defer_add else (out, None)
        if pending is not None:  # the last block deferred too (apply_memory never sets it there)
            h = h + pending
        if labels is None and logits_index is not None:
            i = logits_index % T
            h = h[:, i : i + 1]
        h = self.norm(h)
        if labels is None:
            return self.lm_head(h)
        return self.lm_head(h, labels)

    @staticmethod
    def _rope_len(B: int, T: int, cache: Optional[KVCache], doc_ids, rope_len, device) -> torch.Tensor:
        """Each token's sequence length as a (B, T) or (B, 1) tensor (see forward)."""
        if rope_len is None and cache is not None:
            if cache.rope_len is None:
                raise ValueError(
                    "rope.yarn.apply=beyond_original picks one RoPE per generated sequence from its "
                    "total length: set KVCache.rope_len = prompt length + max_new before the prefill"
                )
            rope_len = cache.rope_len
        if rope_len is None and doc_ids is not None:
            if doc_ids.shape[1] != T:
                raise ValueError(
                    f"doc_ids cover {doc_ids.shape[1]} tokens but input_ids {T}: a sharded input must "
                    f"pass rope_len (each token's document length; parallel.sequence.shard_batch)"
                )
            return document_lengths(doc_ids.to(device))
        if rope_len is None:
            return torch.full((B, 1), T, device=device)
        r = torch.as_tensor(rope_len, device=device)
        if r.dim() == 0:
            return r.expand(B, 1)
        if r.dim() == 1:
            return r.view(-1, 1).expand(B, 1)
        if r.shape[1] not in (1, T):
            raise ValueError(f"rope_len {tuple(r.shape)} must be an int, (B,), (B, 1) or (B, T={T})")
        return r

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
