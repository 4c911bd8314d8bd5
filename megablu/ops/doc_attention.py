"""Document-causal attention for packed rows: a token attends only to earlier tokens of its
own document (cross-document masking, as ProLong arXiv 2410.02660 and Llama 3 train).

Mask: query i may see key j  iff  j <= i  and  doc[j] == doc[i], with doc_ids (B, S)
non-decreasing along S (each EOT separator starts the document that follows it). Because
documents are contiguous, the mask is block-diagonal-causal and most of the (S, S) tiles
are empty: a kernel that skips them does the work of the documents alone (sum of L_d^2/2
instead of S^2/2).

Implementations (chosen once per DocMask; `use_impl` forces one in a block, for tests):
  flex    FlexAttention (torch.nn.attention.flex_attention) with a BlockMask built here
          straight from the documents' block ranges (O(S + (S/128)^2), no (S, S) mask, no
          compile); the kernel is torch.compile'd on CUDA. CPU: forward only (eager flex has
          no backward on CPU), used by the tests to check the block mask.
  varlen  torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen, CUDA, torch >= 2.10):
          the batch flattened to (B*S, H, D) with one cu_seqlens entry per document.
  dense   the reference: SDPA with an explicit (B, 1, S, S) boolean mask (any device; the CPU
          training path; O(S^2) memory, so only for tests and short rows).
  causal  plain causal SDPA, exact when every row is one document.
"auto" is flex on CUDA and dense elsewhere, and causal when every row of the batch holds a
single document (a window inside one long document: most rows of long-document data), so
those rows run the fastest causal kernel with no mask at all.

Layout: q (B, S, H, D), k/v (B, S, Hkv, D) in and (B, S, H, D) out, like LocalAttention; GQA
without materialising repeated kv heads (enable_gqa) in every implementation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F

IMPLS = ("auto", "flex", "varlen", "dense", "causal")
BLOCK = 128  # FlexAttention's sparse block (its default _DEFAULT_SPARSE_BLOCK_SIZE)
_override: Optional[str] = None


@contextlib.contextmanager
def use_impl(name: str) -> Iterator[None]:
    """Force an implementation for every DocMask built inside the block (tests, benchmarks)."""
    global _override
    if name not in IMPLS:
        raise ValueError(f"doc attention: impl must be one of {IMPLS}, got {name!r}")
    prev, _override = _override, name
    try:
        yield
    finally:
        _override = prev


def check_doc_ids(doc_ids: torch.Tensor) -> None:
    """doc_ids (B, S) integer, non-decreasing along S (the block mask relies on it)."""
    if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be an integer (B, S) tensor, got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    if doc_ids.shape[1] > 1 and not bool((doc_ids[:, 1:] >= doc_ids[:, :-1]).all()):
        raise ValueError(
            "doc_ids must be non-decreasing along the sequence (documents are contiguous, the "
            "document index of each token within its row)"
        )


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def tile_lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (..., n_q, n_kv) boolean tile map -> BlockMask.from_kv_blocks' (count (..., n_q), indices
    (..., n_q, n_kv)) int32: each q tile's valid kv tiles first, in ascending order."""
    num = m.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~m).to(torch.int32), dim=-1, stable=True).to(torch.int32)
    return num, idx.contiguous()


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # one compile per (shape, dtype, heads) signature; training shapes are fixed
    return torch.compile(flex_attention, dynamic=False)


class DocMask:
    """The documents of one batch and the mask its kernel needs, built once per forward and
    shared by every layer (and, under Ulysses, by every sp rank: each sees the full S).

    doc_ids (B, S): S is the length attention sees -- the full, padded sequence under
    sequence parallelism, not a rank's slice.
    """

    def __init__(self, doc_ids: torch.Tensor, impl: Optional[str] = None, block: int = BLOCK):
        check_doc_ids(doc_ids)
        impl = impl or _override or "auto"
        if impl not in IMPLS:
            raise ValueError(f"doc attention: impl must be one of {IMPLS}, got {impl!r}")
        if impl == "auto":
            # non-decreasing ids: a row is one document iff its first and last ids agree
            single = doc_ids.shape[1] == 0 or bool((doc_ids[:, 0] == doc_ids[:, -1]).all())
            impl = "causal" if single else "flex" if doc_ids.is_cuda else "dense"
        if impl == "varlen" and (not doc_ids.is_cuda or _varlen_fn() is None):
            raise ValueError(
                f"doc attention: impl='varlen' needs CUDA tensors and torch.nn.attention.varlen "
                f"(torch >= 2.10; this is {torch.__version__}, tensors on {doc_ids.device})"
            )
        self.impl, self.block = impl, block
        self.doc_ids = doc_ids.to(torch.int32).contiguous()
        self.B, self.S = doc_ids.shape
        self.block_mask = self._block_mask() if impl == "flex" else None
        self.cu_seqlens: Optional[torch.Tensor]
        self.cu_seqlens, self.max_len = self._cu_seqlens() if impl == "varlen" else (None, 0)
        self.dense = self._dense() if impl == "dense" else None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the kernels may save for backward: shared by all layers, so an
        activation offload keeps them by reference (memory/offload.py `keep`)."""
        out = [self.doc_ids]
        if self.block_mask is not None:
            bm = self.block_mask
            out += [
                t
                for t in (
                    bm.kv_num_blocks,
                    bm.kv_indices,
                    bm.full_kv_num_blocks,
                    bm.full_kv_indices,
                    bm.q_num_blocks,
                    bm.q_indices,
                    bm.full_q_num_blocks,
                    bm.full_q_indices,
                )
                if t is not None
            ]
        if self.cu_seqlens is not None:
            out.append(self.cu_seqlens)
        if self.dense is not None:
            out.append(self.dense)
        return tuple(out)

    # ---------------------------------------------------------------- builders
    def _block_classes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) (B, 1, n, n) booleans over (q block, kv block) tiles of `block` tokens.

        Documents are contiguous, so tile (i, j) holds a same-document pair iff the doc ranges
        of its q rows and kv columns overlap: kv_max[j] >= q_min[i] (j <= i implies
        kv_min[j] <= q_max[i]). It is full (no mask needed) iff j < i and every token of both
        is one document; the last q tile is never full when S % block != 0 (its rows past S
        are padding, as create_block_mask marks it). Everything else is partial (mask_mod runs).
        """
        d, bs = self.doc_ids, self.block
        n = -(-self.S // bs)
        pad = n * bs - self.S
        if pad:
            d = torch.cat([d, d[:, -1:].expand(self.B, pad)], 1)  # repeat the last id
        t = d.view(self.B, n, bs)
        lo, hi = t[:, :, 0], t[:, :, -1]  # (B, n): non-decreasing ids
        i = torch.arange(n, device=d.device)
        lower = i[:, None] >= i[None, :]  # causal tiles j <= i
        overlap = hi[:, None, :] >= lo[:, :, None]  # kv_max[j] >= q_min[i]
        one_doc = lo == hi  # (B, n)
        same = one_doc[:, :, None] & one_doc[:, None, :] & (lo[:, :, None] == lo[:, None, :])
        full = same & (i[:, None] > i[None, :])
        if pad:
            full[:, -1, :] = False
        partial = lower & overlap & ~full
        return partial[:, None], full[:, None]

    def _block_mask(self):
        from torch.nn.attention.flex_attention import BlockMask

        partial, full = self._block_classes()
        doc = self.doc_ids

        def mask_mod(b, h, q, kv):
            return (q >= kv) & (doc[b, q] == doc[b, kv])

        kv_num, kv_idx = tile_lists(partial)
        full_num, full_idx = tile_lists(full)
        return BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.block, mask_mod=mask_mod, seq_lengths=(self.S, self.S)
        )

    def _cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """Document boundaries of the flattened (B*S) batch: cu_seqlens (n_docs + 1,) int32."""
        d = self.doc_ids
        start = torch.ones_like(d, dtype=torch.bool)
        start[:, 1:] = d[:, 1:] != d[:, :-1]  # a row start is a doc start
        starts = start.reshape(-1).nonzero().squeeze(1)
        cu = torch.cat([starts, starts.new_tensor([d.numel()])]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())

    def _dense(self) -> torch.Tensor:
        d = self.doc_ids
        causal = torch.ones(self.S, self.S, dtype=torch.bool, device=d.device).tril()
        return ((d[:, :, None] == d[:, None, :]) & causal)[:, None]  # (B, 1, S, S)


def doc_attention_reference(q, k, v, doc_ids: torch.Tensor) -> torch.Tensor:
    """SDPA with the explicit mask: q (B, S, H, D), k/v (B, S, Hkv, D) -> (B, S, H, D)."""
    return _dense(q, k, v, DocMask(doc_ids, impl="dense"))


def _dense(q, k, v, m: DocMask):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.dense, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _flex(q, k, v, m: DocMask):
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if q.is_cuda else flex_attention
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D)
    out = fn(q, k, v, block_mask=m.block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=1)
def _varlen_kwargs() -> tuple[bool, bool]:
    """(takes is_causal, takes enable_gqa): the varlen signature changed between torch 2.10 and 2.13."""
    p = inspect.signature(_varlen_fn()).parameters
    return "is_causal" in p, "enable_gqa" in p


def _varlen(q, k, v, m: DocMask):
    B, S, H, D = q.shape
    has_causal, has_gqa = _varlen_kwargs()
    kw = {"is_causal": True} if has_causal else {"window_size": (-1, 0)}  # (-1, 0) = causal
    if has_gqa:
        kw["enable_gqa"] = H != k.shape[2]
    # (B, S, H, D) -> (B*S, H, D): one packed stream, each document its own cu_seqlens segment
    flat = [x.reshape(B * S, x.shape[2], D) for x in (q, k, v)]
    out = _varlen_fn()(*flat, m.cu_seqlens, m.cu_seqlens, m.max_len, m.max_len, **kw)
    return out.view(B, S, H, D)


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocMask) -> torch.Tensor:
    """Document-causal attention: q (B, S, H, D), k/v (B, S, Hkv, D) -> (B, S, H, D)."""
    if q.shape[1] != mask.S or k.shape[1] != mask.S:
        raise ValueError(
            f"doc attention: q/k cover {q.shape[1]}/{k.shape[1]} tokens but doc_ids {mask.S}; under "
            f"sequence parallelism doc_ids must be the full (padded) sequence on every rank"
        )
    if mask.impl == "flex":
        return _flex(q, k, v, mask)
    if mask.impl == "varlen":
        return _varlen(q, k, v, mask)
    if mask.impl == "causal":
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=qt.shape[1] != kt.shape[1])
        return out.transpose(1, 2)
    return _dense(q, k, v, mask)
