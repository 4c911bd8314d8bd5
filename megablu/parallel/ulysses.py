"""DeepSpeed-Ulysses sequence parallelism applied from outside the model.

`apply_ulysses(model, groups)` replaces every `Attention.core` (a LocalAttention on
(B, T/sp, H, D)) with `UlyssesAttention`, which wraps DeepSpeed's `DistributedAttention`:
all-to-all (B, T/sp, H, D) -> (B, T, H/sp, D), full-sequence local attention on H/sp
heads, all-to-all back (Jacobs et al. 2023, "DeepSpeed Ulysses").

Head layouts DeepSpeed cannot split evenly are made even here, never silently wrong:
- kv heads not a multiple of sp (incl. kv < sp): k/v heads are replicated r times, the
  smallest r with (kv*r) % sp == 0 and n_heads % (kv*r) == 0, which keeps GQA groups
  contiguous so rank i's query heads find their kv heads on rank i;
- query heads not divisible by sp (SmolLM2: 9 heads): k/v are expanded to full MHA and
  q/k/v are padded with zero heads up to a multiple of sp. A zero head attends uniformly
  to zero values, outputs zeros and is dropped. Wall time equals an uneven split
  (each rank runs ceil(H/sp) heads either way) and no global DeepSpeed mpu is needed.

Document masking (data.doc_mask) needs nothing else here: the DocMask over the full
(padded) sequence rides along as a keyword argument to the local attention, whose inputs
after the all-to-all are the full sequence on H'/sp heads; zero pad heads attend within
their documents to zero values and output zeros, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.decoder import Block, BluModel, KVCache, LocalAttention
from ..ops.doc_attention import DocMask
from .groups import Groups
from .heads import head_plan


class UlyssesAttention(nn.Module):
    def __init__(self, local: LocalAttention, groups: Groups, n_heads: int, n_kv_heads: int):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.groups, self.n_heads = groups, n_heads
        self.sp = groups.sp
        self.kv_rep, self.padded_heads = head_plan(n_heads, n_kv_heads, groups.sp)
        kv_heads = self.padded_heads if self.padded_heads != n_heads else n_kv_heads * self.kv_rep
        # kv head count after our expansion is a multiple of sp, so DeepSpeed takes its even path
        self.dist_attn = DistributedAttention(
            local, groups.sp_group, scatter_idx=2, gather_idx=1, num_kv_heads=kv_heads
        )
        self.local = local

    def _even_heads(self, q, k, v):
        if self.kv_rep > 1:
            k = k.repeat_interleave(self.kv_rep, dim=2)
            v = v.repeat_interleave(self.kv_rep, dim=2)
        pad = self.padded_heads - self.n_heads
        if pad:
            # (B, T, H, D) -> (B, T, H + pad, D) with zero heads
            q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        return q, k, v

    def forward(self, q, k, v, cache: Optional[KVCache] = None, docs: Optional[DocMask] = None):
        q, k, v = self._even_heads(q, k, v)
        if cache is None or cache.seq_sharded:
            # (B, T/sp, H', D) -> a2a -> (B, T, H'/sp, D) -> attention -> a2a -> (B, T/sp, H', D).
            # DistributedAttention hands extra kwargs to the local attention: `docs` holds the
            # full-length doc ids, which is what the local attention sees after the all-to-all.
            if cache is not None:
                out = self.dist_attn(q, k, v, 0, None, cache)
            elif docs is not None:
                out = self.dist_attn(q, k, v, 0, docs=docs)
            else:
                out = self.dist_attn(q, k, v, 0)
        else:
            out = self._decode(q, k, v, cache)
        return out[:, :, : self.n_heads] if self.padded_heads != self.n_heads else out

    @torch.no_grad()
    def _decode(self, q, k, v, cache: KVCache):
        """Same new tokens on every rank: attend with this rank's head shard and its cache, gather heads."""
        r, hq, hk = self.groups.sp_rank, q.shape[2] // self.sp, k.shape[2] // self.sp
        out = self.local(
            q[:, :, r * hq : (r + 1) * hq], k[:, :, r * hk : (r + 1) * hk], v[:, :, r * hk : (r + 1) * hk], cache
        ).contiguous()
        parts = [torch.empty_like(out) for _ in range(self.sp)]
        dist.all_gather(parts, out, group=self.groups.sp_group)
        return torch.cat(parts, dim=2)


def apply_ulysses(model: BluModel, groups: Groups) -> BluModel:
    """Swap each attention's inner kernel for the sequence-parallel one (in place)."""
    if groups.sp == 1:
        return model
    cfg = model.cfg
    for layer in cast("Iterable[Block]", model.layers):  # nn.ModuleList iterates as nn.Module
        attn = layer.self_attn
        if isinstance(attn.core, UlyssesAttention):
            raise RuntimeError("apply_ulysses called twice on the same model")
        attn.core = UlyssesAttention(cast(LocalAttention, attn.core), groups, cfg.n_heads, cfg.n_kv_heads)
    return model
