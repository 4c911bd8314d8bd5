"""Sliding-window layers (LocalAttention with a window, ops/window_attention.py): the blocked computation
equals a mask built here and the math written out (no SDPA), forward and the grads of q, k and v, for
tq == tk and tq < tk (a KV cache), windows smaller than, equal to and larger than the block, lengths that
are not a multiple of it, MHA and GQA; what it saves for backward does not grow as tq * tk; Gemma 3 with
blocks smaller than its window still matches transformers."""

import math

import pytest
import torch

from megablu.model.decoder import KVCache, LocalAttention
from megablu.model.hf import from_hf
from megablu.ops import window_attention as wa
from megablu.utils.window import block_rows

from .test_families import VOCAB, hf_family


def reference(q, k, v, window):
    """softmax(q k^T / sqrt(D) + mask) v with the window mask built here; kv heads repeated for GQA."""
    tq, tk, H, D = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k, v = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (k, v))
    pos_q = torch.arange(tk - tq, tk)[:, None]  # query row r is key position r + tk - tq
    pos_k = torch.arange(tk)[None, :]
    visible = (pos_k <= pos_q) & (pos_q - pos_k < window)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def qkv(tq, tk, H, Hkv, D=8, B=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, t, h, D, generator=g, dtype=dtype, requires_grad=True)
        for t, h in ((tq, H), (tk, Hkv), (tk, Hkv))
    ]


# (tq, tk, H, Hkv, window, block): the window below / equal to / above the block (up to three earlier key
# chunks), T not a multiple of the block, a cached prefix (tq < tk) that is and is not a multiple of it
CASES = [
    (40, 40, 4, 2, 5, 8),
    (40, 40, 4, 4, 8, 8),
    (37, 37, 4, 1, 20, 8),
    (37, 37, 2, 2, 37, 8),
    (37, 37, 2, 2, 100, 16),
    (23, 51, 4, 2, 6, 8),
    (23, 55, 4, 2, 19, 8),
    (29, 45, 6, 3, 16, 8),
    (1, 50, 4, 2, 7, 8),
    (9, 9, 2, 1, 1, 4),
]


def grads(out, ins, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, ins, g)


@pytest.mark.parametrize("tq,tk,H,Hkv,window,block", CASES)
@pytest.mark.parametrize("impl", ["blocked", "auto"])
def test_equals_the_window_mask_forward_and_grads(tq, tk, H, Hkv, window, block, impl):
    q, k, v = qkv(tq, tk, H, Hkv)
    ref = reference(q, k, v, window)
    with wa.use_impl(impl, block if impl == "blocked" else None):
        out = LocalAttention(window=window)(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("block", [8, 16])
def test_kv_cache_prefill_chunks_then_decode(block):
    """Chunks of 11 then one token at a time through LocalAttention's cache path == one pass over the whole."""
    T, H, Hkv, window = 45, 4, 2, 13
    q, k, v = qkv(T, T, H, Hkv, seed=3)
    ref = reference(q, k, v, window)
    att, cache = LocalAttention(window=window), KVCache(1)
    cuts = [0, 11, 22, 33] + list(range(34, T + 1))
    with wa.use_impl("blocked", block):
        outs = [att(q[:, a:b], k[:, a:b], v[:, a:b], cache) for a, b in zip(cuts, cuts[1:], strict=False)]
    out = torch.cat(outs, 1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_no_grad_path_equals_the_grad_path():
    """Without autograd the blocks slice k and v instead of splitting them: the same numbers."""
    q, k, v = qkv(37, 50, 4, 2, seed=4)
    with wa.use_impl("blocked", 8):
        out = LocalAttention(window=11)(q, k, v)
        with torch.no_grad():
            again = LocalAttention(window=11)(q, k, v)
    torch.testing.assert_close(again, out.detach(), rtol=1e-12, atol=1e-12)


def saved_bytes(impl, block, q, k, v, window):
    """Bytes of the distinct storages autograd saves for the backward of one call."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with wa.use_impl(impl, block), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LocalAttention(window=window)(q, k, v)
    return sum(storages.values())


def test_saved_for_backward_does_not_grow_with_the_mask():
    """The dense reference saves its (T, T) mask (SDPA's float copy); the blocks save q, k, v, the output,
    the key/value chunks each block concatenates (nb + 1 chunks of `block`) and the one (block, 2 block)
    mask: nothing of size T * T."""
    T, H, window, block = 512, 2, 32, 32
    q, k, v = qkv(T, T, H, H, D=4, B=1, dtype=torch.float32)
    one = q.numel() * q.element_size()  # q, k, v and the output have the same size here
    nb = math.ceil((window - 1) / block)
    mask = block * (nb + 1) * block * q.element_size()
    lse = H * T * 4
    bound = 4 * one + 2 * (nb + 1) * one + mask + lse
    assert saved_bytes("dense", None, q, k, v, window) >= T * T * q.element_size()
    assert saved_bytes("blocked", block, q, k, v, window) <= bound < T * T * q.element_size()


@pytest.mark.parametrize("block", [8, 16])
def test_gemma3_with_blocks_smaller_than_its_window_matches_transformers(block):
    """transformers' Gemma 3 (a 24-token window) against BluModel whose sliding layers run blocks of 8
    (three earlier key chunks) or 16 rows over 150 tokens (not a multiple of either)."""
    hf = hf_family("gemma3")
    model = from_hf(hf).eval()
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), wa.use_impl("blocked", block):
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_block_rows_and_refusals():
    assert [block_rows(w) for w in (1, 24, 128, 129, 512, 1024)] == [128, 128, 128, 256, 512, 1024]
    with pytest.raises(ValueError, match="impl must be one of"), wa.use_impl("flash"):
        pass
    with pytest.raises(ValueError, match="block must be >= 1 query rows, got 0"), wa.use_impl("blocked", 0):
        pass
    q, k, v = qkv(5, 4, 2, 2)
    with pytest.raises(ValueError, match="4 keys for 5 queries"):
        wa.window_attention(q, k, v, 3)
    with pytest.raises(ValueError, match="window must be >= 1 token, got 0"):
        wa.window_attention(q, q, q, 0)
