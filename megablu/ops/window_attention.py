"""Sliding-window causal attention (Gemma 3's sliding_attention, Mistral's window): a query at i sees
keys i - window < j <= i, with q bottom-right aligned on k (a prefill chunk or a decode step over a
KV cache: query row r sits at key position r + tk - tq), as transformers' sliding_window_causal mask.

Implementations (`use_impl` forces one in a block, for tests and benchmarks):
  dense    the reference: SDPA over all tk keys with a (tq, tk) boolean mask. O(tq * tk) memory
           and work although each query sees `window` keys: 4 GiB of mask alone at T = 65536.
  blocked  the same function by blocks of C query rows (`block_rows`): block [s, e) attends to
           keys [max(0, s + off - C*nb), e + off) (off = tk - tq, nb = ceil((window - 1) / C)
           earlier key chunks: every key its rows may see, and at most nb*C + C keys) with a
           slice of one (C, nb*C + C) additive mask shared by every block. O(T * (C + window))
           work, O(C * (C + window)) mask, one SDPA call per block.
"auto" is blocked when tq > C; with one block's rows or fewer (a decode step, a short input or
prefill chunk) it is the dense call on the keys the window reaches, [tk - tq - window + 1, tk): the
same single SDPA call without the (C, nb*C + C) mask of the loop to build, and a decode step reads
`window` cached keys, not the whole cache.

Why C = the window rounded up to a multiple of 128: a block then needs its own chunk and one
earlier chunk (nb = 1), so it computes 2C keys per row against the `window` it uses (at most
2x the minimal work when the window is a multiple of 128, the Gemma 3 windows 512 and 1024);
a smaller C wastes less (C + window keys per row) but makes T/C SDPA calls of C rows each,
and a GPU kernel fills its SMs with (C/64 row tiles) x heads x batch work items (512 rows x 16
heads: 128 of them, one wave on 132 SMs); multiples of 128 keep the key chunks on the kernels'
tile and alignment boundaries.

Under autograd the blocks read q and k/v through `split` (their backward is one concatenation)
rather than slices (each slice's backward writes a zero tensor as large as the whole input:
O(T^2 / C) in all), and the masks are views of one tensor, so what the blocks save for backward
is the q, k, v, output and LSE SDPA saves anyway, + the chunks each block concatenates (nb + 1
key/value chunks per block: (nb + 1) x k and v), + the one mask.

Layout: q (B, T, H, D), k/v (B, tk, Hkv, D) in and (B, T, H, D) out, like LocalAttention; GQA
without materialising repeated kv heads (enable_gqa).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F

from ..utils.window import block_rows, earlier_chunks

IMPLS = ("auto", "dense", "blocked")
_override: Optional[tuple[str, Optional[int]]] = None


@contextlib.contextmanager
def use_impl(name: str, block: Optional[int] = None) -> Iterator[None]:
    """Force an implementation (and, for blocked, the rows per block) inside the block (tests, benchmarks)."""
    global _override
    if name not in IMPLS:
        raise ValueError(f"window attention: impl must be one of {IMPLS}, got {name!r}")
    if block is not None and block < 1:
        raise ValueError(f"window attention: block must be >= 1 query rows, got {block}")
    prev, _override = _override, (name, block)
    try:
        yield
    finally:
        _override = prev


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """q (B, T, H, D) over k, v (B, tk, Hkv, D), tk >= T, bottom-right aligned -> (B, T, H, D)."""
    if window < 1:
        raise ValueError(f"window attention: window must be >= 1 token, got {window}")
    if k.shape[1] < q.shape[1]:
        raise ValueError(f"window attention: {k.shape[1]} keys for {q.shape[1]} queries (bottom-right needs tk >= T)")
    name, block = _override or ("auto", None)
    if name == "dense":
        return dense(q, k, v, window)
    block = block or block_rows(window)
    if name == "auto" and q.shape[1] <= block:
        lo = max(0, k.shape[1] - q.shape[1] - window + 1)  # the first key the first query sees
        return dense(q, k[:, lo:], v[:, lo:], window)
    return blocked(q, k, v, window, block)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """The reference: SDPA with the whole (tq, tk) boolean mask."""
    tq, tk = q.shape[1], k.shape[1]
    i = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
    j = torch.arange(tk, device=q.device)[None, :]
    mask = (j <= i) & (j > i - window)  # (tq, tk)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D) -> (B, H, T, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _block_mask(rows: int, nb: int, block: int, window: int, like: torch.Tensor) -> torch.Tensor:
    """(rows, nb*block + rows) additive mask (0 / -inf in q's dtype) of a full block: row r is the query
    at key position p + r, column c the key at p - nb*block + c, visible iff 0 <= (p + r) - key < window."""
    r = torch.arange(rows, device=like.device)[:, None]
    c = torch.arange(nb * block + rows, device=like.device)[None, :]
    dist = r + nb * block - c  # query position - key position
    keep = (dist >= 0) & (dist < window)
    return torch.zeros(keep.shape, dtype=like.dtype, device=like.device).masked_fill_(~keep, float("-inf"))


def blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block: int) -> torch.Tensor:
    """The same function as `dense` by blocks of `block` query rows (module docstring)."""
    tq, tk = q.shape[1], k.shape[1]
    off = tk - tq
    gqa = q.shape[2] != k.shape[2]
    nb = earlier_chunks(window, block)  # earlier key chunks a block's first row reaches
    rows = min(block, tq)
    mask = _block_mask(rows, nb, block, window, q)  # (rows, nb*block + rows), every block's is a view
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D) -> (B, H, T, D)
    # key chunk m holds positions [off + (m - pre) * block, ...), cut at the query blocks' boundaries
    # (shifted by off), the first of the cached prefix [0, off) partial: block b's own keys are chunk pre + b
    pre = math.ceil(off / block)
    cuts = [0] + [off + m * block for m in range(1 - pre, math.ceil(tq / block))] + [tk]
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if grad:
        # views whose backward is one cat (module docstring); a block's keys are a cat of nb + 1 of them
        kc, vc = k.split(sizes, dim=2), v.split(sizes, dim=2)
        qb = q.split(block, dim=2)
    outs = []
    for b in range(math.ceil(tq / block)):
        s, e = b * block, min(tq, (b + 1) * block)
        first = max(0, pre + b - nb)  # the first key chunk block b needs
        lo, hi = cuts[first], e + off  # its keys [lo, hi)
        c0 = lo - (s + off - nb * block)  # > 0 only where the chunks before were clipped at key 0
        m = mask[: e - s, c0 : nb * block + e - s]
        if grad:
            kb = torch.cat(kc[first : pre + b + 1], dim=2) if pre + b > first else kc[first]
            vb = torch.cat(vc[first : pre + b + 1], dim=2) if pre + b > first else vc[first]
            outs.append(F.scaled_dot_product_attention(qb[b], kb, vb, attn_mask=m, enable_gqa=gqa))
        else:
            q_s, k_s, v_s = q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi]
            outs.append(F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=m, enable_gqa=gqa))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)
