"""Greedy decoding with a KV cache, on one rank or with a Ulysses-sharded prefill.

One rank: the prompt (B, L) is prefilled in chunks of `prefill_chunk` tokens through the
cache (each chunk attends to the cached past plus causally to itself), so the logits held
at once are (B, chunk, V) instead of (B, L, V) -- 6.4 GB for L=32k, V=49k in fp32 -- then
one token at a time is fed back. `use_cache=False` recomputes the whole sequence at every
step instead (the reference the cache is tested against: the seed once shipped a cache bug
that looked like a long-context gain).

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

from typing import Optional

import torch
import torch.distributed as dist

from ..model.decoder import KVCache


def _n_layers(model) -> int:
    return model.cfg.n_layers


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, max_new: int, *, sp_group=None, prefill_chunk: int = 2048,
                    use_cache: bool = True) -> torch.Tensor:
    """input_ids (B, L) -> generated ids (B, max_new), greedy, no early stop (scoring cuts at EOT)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L), got {tuple(input_ids.shape)}")
    input_ids = input_ids.to(_device(model))
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        return _generate_sp(model, input_ids, max_new, sp_group)
    if not use_cache:
        return _generate_recompute(model, input_ids, max_new)
    B, L = input_ids.shape
    cache = KVCache(_n_layers(model), rope_len=L + max_new)
    chunk = prefill_chunk if prefill_chunk > 0 else L
    for s in range(0, L, chunk):
        logits = model(input_ids[:, s:s + chunk], cache=cache, logits_index=-1)
    tok = logits[:, -1].argmax(-1)                           # (B,)
    out = [tok]
    for _ in range(max_new - 1):
        logits = model(tok[:, None], cache=cache)            # positions continue from cache.length
        tok = logits[:, -1].argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)


@torch.no_grad()
def _generate_recompute(model, input_ids: torch.Tensor, max_new: int) -> torch.Tensor:
    seq = input_ids
    total = input_ids.shape[1] + max_new    # the length the sequence will reach picks its RoPE
    for _ in range(max_new):
        tok = model(seq, rope_len=total)[:, -1].argmax(-1)
        seq = torch.cat([seq, tok[:, None]], 1)
    return seq[:, input_ids.shape[1]:]


@torch.no_grad()
def _generate_sp(model, input_ids: torch.Tensor, max_new: int, group) -> torch.Tensor:
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    B, L = input_ids.shape
    Lp = -(-L // sp) * sp
    per = Lp // sp
    dev = input_ids.device
    if Lp != L:
        # (B, L) -> (B, Lp): pad at the end; any id works, causality hides it from real tokens
        input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(B, Lp - L)], 1)
    pos = torch.arange(r * per, (r + 1) * per, device=dev).expand(B, per)
    cache = KVCache(_n_layers(model), seq_sharded=True, rope_len=L + max_new)
    owner = (L - 1) // per
    # only the owner of position L-1 needs its logits; the others compute one cheap row
    at = (L - 1) - owner * per if r == owner else -1
    logits = model(input_ids[:, r * per:(r + 1) * per], position_ids=pos, cache=cache, logits_index=at)  # (B, 1, V)
    tok = logits[:, 0].argmax(-1) if r == owner else torch.zeros(B, dtype=torch.long, device=dev)
    tok = tok.contiguous()
    dist.broadcast(tok, src=dist.get_global_rank(group, owner), group=group)
    cache.truncate(L)
    cache.seq_sharded = False
    src0 = dist.get_global_rank(group, 0)
    out = [tok]
    for i in range(max_new - 1):
        pos = torch.full((B, 1), L + i, device=dev, dtype=torch.long)
        logits = model(tok[:, None], position_ids=pos, cache=cache)
        tok = logits[:, -1].argmax(-1).contiguous()
        dist.broadcast(tok, src=src0, group=group)
        out.append(tok)
    return torch.stack(out, 1)


def cut_at_eot(ids: list[int], eot_id: Optional[int]) -> list[int]:
    if eot_id is not None and eot_id in ids:
        return ids[:ids.index(eot_id)]
    return ids
