"""Document-causal attention kernels == causal SDPA run on each document alone, fwd and bwd.

CPU: the dense reference (fwd+bwd, fp64 and fp32) and eager FlexAttention (forward only: it
has no CPU backward) against per-document SDPA; the hand-built BlockMask against torch's
create_block_mask, tile by tile (eager flex applies mask_mod everywhere, so only this
catches a tile wrongly marked full or skipped). GPU (skips without CUDA): the compiled
FlexAttention and varlen kernels against per-document SDPA in bf16, fwd and bwd.
"""

import pytest
import torch
import torch.nn.functional as F

from megablu.ops.doc_attention import DocMask, check_doc_ids, doc_attention, doc_attention_reference, use_impl

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def docs_of(lengths_per_row):
    """[[5, 30, 65], [100]] -> doc_ids (B, S): row b holds documents of those lengths."""
    rows = [torch.cat([torch.full((n,), d) for d, n in enumerate(ls)]) for ls in lengths_per_row]
    assert len({r.numel() for r in rows}) == 1
    return torch.stack(rows)


def per_document(q, k, v, doc_ids):
    """The independent reference: plain causal SDPA on every document's own tokens."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for d in doc_ids[b].unique():
            idx = (doc_ids[b] == d).nonzero().squeeze(1)
            s, e = int(idx[0]), int(idx[-1]) + 1
            qd, kd, vd = (x[b : b + 1, s:e].transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=qd.shape[1] != kd.shape[1])
            out[b : b + 1, s:e] = o.transpose(1, 2)
    return out


def qkv(B, S, H, Hkv, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(B, S, h, D, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    return mk(H).requires_grad_(), mk(Hkv).requires_grad_(), mk(Hkv).requires_grad_()


LAYOUTS = [
    [[5, 30, 65], [100]],  # S=100: not a multiple of any block; one row a single document
    [[1, 1, 14, 16, 16, 52], [40, 60]],  # one-token documents, documents exactly on 16-token tiles
    [[37], [20, 17]],  # S=37 < 3 tiles of 16
    [[64, 64], [16] * 8],  # S % 16 == 0: full tiles in the last q block too
]


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_block_mask_tiles_equal_create_block_mask(lengths):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = docs_of(lengths)
    B, S = doc.shape
    mine = DocMask(doc, impl="flex", block=16).block_mask

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    ref = create_block_mask(mask_mod, B, None, S, S, device="cpu", BLOCK_SIZE=16)

    def dense(num, idx):
        n = idx.shape[-1]
        out = torch.zeros(*idx.shape[:-1], n, dtype=torch.bool)
        for b in range(idx.shape[0]):
            for i in range(idx.shape[2]):
                out[b, 0, i, idx[b, 0, i, : num[b, 0, i]].long()] = True
        return out

    assert torch.equal(dense(mine.kv_num_blocks, mine.kv_indices), dense(ref.kv_num_blocks, ref.kv_indices)), (
        "partial tiles differ"
    )
    assert torch.equal(
        dense(mine.full_kv_num_blocks, mine.full_kv_indices), dense(ref.full_kv_num_blocks, ref.full_kv_indices)
    ), "full tiles differ"
    assert mine.seq_lengths == (S, S)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_dense_reference_fwd_bwd_equals_per_document(H, Hkv, dtype, tol):
    doc = docs_of(LAYOUTS[1])
    q, k, v = qkv(2, doc.shape[1], H, Hkv, 16, dtype)
    out = doc_attention_reference(q, k, v, doc)
    ref = per_document(q, k, v, doc)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_flex_forward_on_cpu_equals_per_document(lengths):
    doc = docs_of(lengths)
    q, k, v = (x.detach() for x in qkv(2, doc.shape[1], 6, 2, 16))  # eager flex: no CPU backward
    with torch.no_grad():
        out = doc_attention(q, k, v, DocMask(doc, impl="flex", block=16))
        ref = per_document(q, k, v, doc)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


def test_one_document_rows_take_plain_causal_and_every_kernel_agrees():
    q, k, v = qkv(2, 50, 4, 2, 8)
    one = torch.stack([torch.zeros(50, dtype=torch.long), torch.full((50,), 3)])  # each row one document
    assert DocMask(one).impl == "causal"  # auto: no mask needed
    assert DocMask(docs_of([[20, 30], [50]])).impl == "dense"  # auto on CPU with documents to mask
    ref = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    for impl in ("causal", "dense"):
        torch.testing.assert_close(doc_attention(q, k, v, DocMask(one, impl=impl)), ref, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        qd, kd, vd = (x.detach() for x in (q, k, v))
        torch.testing.assert_close(
            doc_attention(qd, kd, vd, DocMask(one, impl="flex", block=16)), ref.detach(), rtol=1e-5, atol=1e-5
        )
    with use_impl("flex"):
        assert DocMask(torch.zeros(1, 8, dtype=torch.long)).impl == "flex"  # forced: no shortcut


def test_bad_doc_ids_are_refused():
    with pytest.raises(ValueError, match="non-decreasing"):
        check_doc_ids(torch.tensor([[0, 0, 1, 0]]))
    with pytest.raises(ValueError, match="integer"):
        check_doc_ids(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="needs CUDA"):
        DocMask(torch.zeros(1, 4, dtype=torch.long), impl="varlen")
    q, k, v = qkv(1, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="full .padded. sequence"):
        doc_attention(q, k, v, DocMask(torch.zeros(1, 16, dtype=torch.long)))


# --------------------------------------------------------------------------- GPU
GPU_LAYOUTS = {
    "mixed": [[1000, 37, 3000, 1, 2058], [6096]],  # S=6096: not a multiple of 128; a one-token document
    "short": [[517] * 8 + [1960]],
}


@cuda
@pytest.mark.parametrize("impl", ["flex", "varlen"])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (16, 4), (5, 5)])  # SmolLM2, blu-0.5b, a Ulysses rank of 9 heads at sp=2
@pytest.mark.parametrize("layout", sorted(GPU_LAYOUTS))
def test_cuda_kernel_fwd_bwd_equals_sdpa_per_document(impl, H, Hkv, layout):
    """bf16, d=64. Tolerance: the kernel's max error against an fp32 per-document reference may
    be at most 2x SDPA-bf16's own error against it + 1e-3 (FlashAttention's test rule), for the
    output and each of dq, dk, dv."""
    if impl == "varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    doc = docs_of(GPU_LAYOUTS[layout]).cuda()
    B, S = doc.shape
    q, k, v = qkv(B, S, H, Hkv, 64, torch.bfloat16, "cuda")
    with use_impl(impl):
        m = DocMask(doc)
    assert m.impl == impl
    out = doc_attention(q, k, v, m)
    g = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), g))
    ref_bf16 = per_document(q, k, v, doc)
    base = (ref_bf16, *torch.autograd.grad(ref_bf16, (q, k, v), g))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = per_document(q32, k32, v32, doc)
    exact = (ref, *torch.autograd.grad(ref, (q32, k32, v32), g.float()))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, base, exact):
        err, err_sdpa = (a.float() - r).abs().max().item(), (b.float() - r).abs().max().item()
        assert err <= 2 * err_sdpa + 1e-3, f"{impl} {layout} H={H}/{Hkv} {name}: {err:.3e} vs sdpa {err_sdpa:.3e}"


@cuda
def test_cuda_flex_compiles_once_per_shape_not_per_batch():
    """A new batch's documents are new tensors in a new mask_mod closure: the compiled kernel
    must take them as inputs (one compile per shape), not recompile every step."""
    import torch._dynamo as dynamo
    import torch._dynamo.utils as dutils

    dynamo.reset()  # other tests' shapes must not exhaust the recompile limit first
    q, k, v = qkv(1, 4096, 16, 4, 64, torch.bfloat16, "cuda")
    layouts = ([4096], [1000, 3096], [17, 2000, 2079], [512] * 8)
    for i, lengths in enumerate(layouts):
        out = doc_attention(q, k, v, DocMask(docs_of([lengths]).cuda(), impl="flex"))
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        if i == 0:
            graphs = dutils.counters["stats"]["unique_graphs"]
    assert dutils.counters["stats"]["unique_graphs"] == graphs, "flex recompiled for a new document layout"
