"""Greedy decoding with a KV cache, on one rank or with a Ulysses-sharded prefill.

One rank: the prompt (B, L) is prefilled in chunks of `prefill_chunk` tokens through the
cache (each chunk attends to the cached past plus causally to itself), so the logits held
at once are (B, chunk, V) instead of (B, L, V) -- 6.4 GB for L=32k, V=49k in fp32 -- then
one token at a time is fed back. `use_cache=False` recomputes the whole sequence at every
step instead (the reference the cache is tested against: a cache bug can
look like a long-context gain).

Sequence parallel (sp_group given, model wrapped by apply_ulysses), the protocol agreed with
megablu.parallel:
  1. pad the prompt at the END to Lp = ceil(L/sp)*sp (causal: the real tokens never see
     the pad, so the logits at L-1 are exact);
  2. rank r prefills its slice [r*Lp/sp, (r+1)*Lp/sp) with explicit global position_ids
     into KVCache(seq_sharded=True);
  3. the rank holding position L-1 picks the first token; it is broadcast over the group;
  4. cache.truncate(L) drops the pad keys, cache.seq_sharded=False, and every rank feeds
     the same token with position_ids [[L+i]]; each step's argmax is broadcast from group
     rank 0 so the ranks cannot drift apart.

RoPE choice (rope.yarn.apply=beyond_original): made once per sequence from the length it will
reach, L + max_new, through KVCache.rope_len (and rope_len= on the recompute path), so a
prompt that ends short of original_max_position but grows past it while generating keeps
YaRN from its first token on, and the cache never holds keys of two ropes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from ..model.decoder import KVCache
from .decode import check_mode, decode as run_decode, resolve_mode


class StaticKVCache(KVCache):
    """KVCache whose per-layer buffers (B, capacity, Hkv_local, D) are allocated at the first
    append, so a decoded token is one slice write instead of KVCache.append's torch.cat (which
    copies the whole cache per token and layer: O(L) per step, 2x the memory at the copy).
    `k[layer]` / `v[layer]` stay views of the filled part, which is all the model reads."""

    def __init__(self, n_layers: int, capacity: int, seq_sharded: bool = False):
        super().__init__(n_layers, seq_sharded=seq_sharded)
        self.capacity = capacity
        self._kb: list[Optional[torch.Tensor]] = [None] * n_layers
        self._vb: list[Optional[torch.Tensor]] = [None] * n_layers
        self._n = [0] * n_layers
        # STRING's shifted keys (model/string.py), allocated when first appended
        self._ksb: list[Optional[torch.Tensor]] = [None] * n_layers
        self._nks = [0] * n_layers
        self._step_pos: Optional[torch.Tensor] = None  # (1,) long on the device: shape-stable steps (begin_steps)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self._step_pos is not None:
            return self._append_at(layer, k, v)
        kb, vb = self._kb[layer], self._vb[layer]
        if kb is None or vb is None:  # both or neither
            B, _, H, D = k.shape
            kb = self._kb[layer] = k.new_empty(B, self.capacity, H, D)
            vb = self._vb[layer] = v.new_empty(B, self.capacity, v.shape[2], v.shape[3])
        s, t = self._n[layer], k.shape[1]
        if s + t > self.capacity:
            raise RuntimeError(f"StaticKVCache: {s} + {t} tokens > capacity {self.capacity}")
        kb[:, s : s + t] = k
        vb[:, s : s + t] = v
        self._n[layer] = s + t
        self.k[layer], self.v[layer] = kb[:, : s + t], vb[:, : s + t]
        return self.k[layer], self.v[layer]

    def _append_at(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """One token per row written at position _step_pos (a device tensor: no host read), -> the whole
        buffers (B, capacity, Hkv, D); the caller attends over the part it knows is filled."""
        if k.shape[1] != 1:
            raise ValueError(f"StaticKVCache: a shape-stable step appends one token per row, got {k.shape[1]}")
        kb, vb, pos = self._kb[layer], self._vb[layer], self._step_pos
        assert kb is not None and vb is not None and pos is not None  # begin_steps checked both
        kb.index_copy_(1, pos, k)
        vb.index_copy_(1, pos, v)
        return kb, vb

    def begin_steps(self, pos: torch.Tensor) -> None:
        """From now on each append writes its one token at `pos` ((1,) long, on the buffers' device; the caller
        advances it) and returns the whole buffers: the write is the same kernel at every step, so a CUDA graph
        can replay it. end_steps(length) goes back to appending after the filled part."""
        if any(b is None for b in self._kb):
            raise RuntimeError("StaticKVCache.begin_steps: prefill first (the buffers are allocated by it)")
        if any(b is not None for b in self._ksb):
            raise RuntimeError("StaticKVCache.begin_steps: STRING's shifted keys are not written at a position")
        self._step_pos = pos

    def end_steps(self, length: int) -> None:
        """Leave step mode with `length` positions filled (the prompt plus the tokens fed back)."""
        self._step_pos = None
        self._n = [length] * self.n_layers
        self._views()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep these batch rows ((B',) indices) of every buffer, in that order: a decode drops the rows that
        are done. A (B,) rope_len follows them."""
        for bufs in (self._kb, self._vb, self._ksb):
            for i, b in enumerate(bufs):
                if b is not None:
                    bufs[i] = b.index_select(0, rows)
        if isinstance(self.rope_len, torch.Tensor) and self.rope_len.dim() > 0:
            self.rope_len = self.rope_len.index_select(0, rows.to(self.rope_len.device))
        self._views()

    def _views(self) -> None:
        for i, n in enumerate(self._n):
            kb, vb, ksb = self._kb[i], self._vb[i], self._ksb[i]
            if kb is not None and vb is not None:
                self.k[i], self.v[i] = kb[:, :n], vb[:, :n]
            if ksb is not None:
                self.ks[i] = ksb[:, : self._nks[i]]

    def append_shifted(self, layer: int, ks: torch.Tensor) -> torch.Tensor:
        if self._step_pos is not None:
            raise RuntimeError("StaticKVCache: STRING's shifted keys are not supported in a shape-stable step")
        ksb = self._ksb[layer]
        if ksb is None:
            ksb = self._ksb[layer] = ks.new_empty(ks.shape[0], self.capacity, *ks.shape[2:])
        s, t = self._nks[layer], ks.shape[1]
        if s + t > self.capacity:
            raise RuntimeError(f"StaticKVCache: {s} + {t} shifted keys > capacity {self.capacity}")
        ksb[:, s : s + t] = ks
        self._nks[layer] = s + t
        self.ks[layer] = ksb[:, : s + t]
        return self.ks[layer]

    def truncate(self, length: int) -> None:
        self._n = [min(n, length) for n in self._n]
        self._nks = [min(n, length) for n in self._nks]
        self._views()


def new_cache(model, capacity: int, rope_len: int, seq_sharded: bool = False) -> KVCache:
    """THE place generation makes its KV cache. `rope_len` is the length the sequence will reach
    (prompt + max_new): a model whose rope depends on the whole sequence's length (YaRN applied
    only beyond the original positions) reads cache.rope_len to pick it once, at prefill."""
    cache = StaticKVCache(_n_layers(model), capacity, seq_sharded=seq_sharded)
    cache.rope_len = rope_len
    return cache


def _n_layers(model) -> int:
    return model.cfg.n_layers


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_generate(
    model,
    input_ids: torch.Tensor,
    max_new: int,
    *,
    sp_group=None,
    prefill_chunk: int = 2048,
    use_cache: bool = True,
    stop_ids: Sequence[int] = (),
    decode: str = "auto",
) -> torch.Tensor:
    """input_ids (B, L) -> generated ids (B, max_new), greedy.

    With stop_ids (tokenizer.stop_ids: EOT, an end of turn), a row is done once it has produced any of them:
    its later tokens are stop_ids[0] (scoring cuts at a row's first stop, cut_at_stop, so the result is the
    same as decoding on) and decoding ends when every row is done. prefill_chunk <= 0
    prefills the whole prompt in one call (fastest on a GPU with a flash kernel; only the last
    position's logits are ever computed). decode: how the steps run (eval/decode.py: auto | eager | static |
    graph; auto replays a CUDA graph of the step on a GPU where the model allows it)."""
    check_mode(decode)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L), got {tuple(input_ids.shape)}")
    input_ids = input_ids.to(_device(model))
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        resolve_mode(decode, model, None, max_new - 1, one_rank=False)
        return _generate_sp(model, input_ids, max_new, sp_group, stop_ids)
    if not use_cache:
        return _generate_recompute(model, input_ids, max_new)
    B, L = input_ids.shape
    cache = new_cache(model, L + max_new, rope_len=L + max_new)
    mode = resolve_mode(decode, model, cache, max_new - 1, one_rank=True)
    chunk = prefill_chunk if prefill_chunk > 0 else L
    for s in range(0, L, chunk):
        logits = model(input_ids[:, s : s + chunk], cache=cache, logits_index=-1)
    tok = logits[:, -1].argmax(-1)  # (B,)
    return run_decode(model, tok, cache, max_new, stop_ids, mode=mode)


@torch.no_grad()
def _generate_recompute(model, input_ids: torch.Tensor, max_new: int) -> torch.Tensor:
    seq = input_ids
    total = input_ids.shape[1] + max_new  # the length the sequence will reach picks its RoPE
    for _ in range(max_new):
        tok = model(seq, rope_len=total)[:, -1].argmax(-1)
        seq = torch.cat([seq, tok[:, None]], 1)
    return seq[:, input_ids.shape[1] :]


@torch.no_grad()
def _generate_sp(model, input_ids: torch.Tensor, max_new: int, group, stop_ids: Sequence[int] = ()) -> torch.Tensor:
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    B, L = input_ids.shape
    Lp = -(-L // sp) * sp
    per = Lp // sp
    dev = input_ids.device
    if Lp != L:
        # (B, L) -> (B, Lp): pad at the end; any id works, causality hides it from real tokens
        input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(B, Lp - L)], 1)
    pos = torch.arange(r * per, (r + 1) * per, device=dev).expand(B, per)
    cache = new_cache(model, Lp + max_new, rope_len=L + max_new, seq_sharded=True)
    owner = (L - 1) // per
    # only the owner of position L-1 needs its logits; the others compute one cheap row
    at = (L - 1) - owner * per if r == owner else -1
    logits = model(input_ids[:, r * per : (r + 1) * per], position_ids=pos, cache=cache, logits_index=at)  # (B, 1, V)
    tok = logits[:, 0].argmax(-1) if r == owner else torch.zeros(B, dtype=torch.long, device=dev)
    tok = tok.contiguous()
    dist.broadcast(tok, src=dist.get_global_rank(group, owner), group=group)
    cache.truncate(L)
    cache.seq_sharded = False
    src0 = dist.get_global_rank(group, 0)

    def agree(t):  # group rank 0's argmax on every rank: the ranks cannot drift apart (or stop apart)
        dist.broadcast(t, src=src0, group=group)
        return t

    return run_decode(
        model,
        tok,
        cache,
        max_new,
        stop_ids,
        mode="eager",
        agree=agree,
        positions=lambda i, b: torch.full((b, 1), L + i, device=dev, dtype=torch.long),
    )


def cut_at_stop(ids: list[int], stop_ids: Sequence[int]) -> list[int]:
    """ids up to (without) the first of any stop id: what an answer is; the text after an end of turn is not."""
    stops = set(stop_ids)
    return next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)
