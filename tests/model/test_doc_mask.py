"""data.doc_mask in the model: a packed row of documents == each document run alone.

Reference: every document of the row through the same model on its own, positions from 0
(doc_positions=restart), no mask at all (plain causal SDPA). Compared per token (logits)
and for the gradient of every parameter of the summed loss, fp32 on CPU (the dense
doc-mask kernel; the GPU kernels are tested against SDPA in tests/ops/test_doc_attention.py).
"""

import pytest
import torch

from megablu.config.schema import MemoryConfig, ModelConfig, RopeConfig, YarnConfig
from megablu.memory.apply import apply_memory
from megablu.memory.offload import ActivationOffload
from megablu.model.decoder import BluModel, KVCache
from megablu.model.packing import document_lengths, document_positions, row_lengths
from megablu.ops.cross_entropy import IGNORE_INDEX

VOCAB = 61
ROPE = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=2.0, original_max_position=32))
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32: the packed and per-document sums run in other orders


def cfg(h=9, kv=3):
    return ModelConfig(n_layers=2, d_model=8 * h, n_heads=h, n_kv_heads=kv, ffn_dim=48, vocab_size=VOCAB)


def build(model_cfg=None, rope=ROPE, memory=None):
    m = apply_memory(BluModel(model_cfg or cfg(), rope), memory)
    m.reset_parameters(seed=0)
    return m


def packed(lengths, seed=0):
    """One row of documents of these lengths: ids, labels (next token; some ignored), doc_ids."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    toks = torch.randint(0, VOCAB, (1, T + 1), generator=g)
    labels = toks[:, 1:].clone()
    labels[0, 2] = IGNORE_INDEX
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    return toks[:, :-1], labels, doc


def bounds(lengths):
    s = 0
    for n in lengths:
        yield s, s + n
        s += n


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def alone(model, ids, labels, lengths):
    """(per-token logits (1, T, V), summed loss) with each document run on its own."""
    logits = torch.cat([model(ids[:, s:e]) for s, e in bounds(lengths)], 1)
    loss = sum(model(ids[:, s:e], labels=labels[:, s:e])[0] for s, e in bounds(lengths))
    return logits, loss


LENGTHS = [7, 1, 20, 12]  # T=40 > original 32: one-token document included


@pytest.mark.parametrize("h,kv", [(9, 3), (4, 4), (8, 2)])
def test_packed_row_equals_documents_alone(h, kv):
    m = build(cfg(h, kv))
    ids, labels, doc = packed(LENGTHS)
    pos = document_positions(doc)
    logits = m(ids, position_ids=pos, doc_ids=doc)
    loss, n = m(ids, position_ids=pos, labels=labels, doc_ids=doc)
    g = grads_of(m, loss)
    ref_logits, ref_loss = alone(m, ids, labels, LENGTHS)
    ref_g = grads_of(m, ref_loss)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert int(n) == int((labels != IGNORE_INDEX).sum())
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k], **TOL, msg=lambda s: f"grad {k}: {s}")


def test_continue_positions_equal_documents_alone_at_their_row_positions():
    m = build()
    ids, labels, doc = packed(LENGTHS, seed=1)
    T = ids.shape[1]
    logits = m(ids, doc_ids=doc)  # default positions 0..T-1: continue
    pos = torch.arange(T)[None]
    ref = torch.cat([m(ids[:, s:e], position_ids=pos[:, s:e]) for s, e in bounds(LENGTHS)], 1)
    torch.testing.assert_close(logits, ref, **TOL)


def test_one_document_equals_plain_causal():
    m = build()
    ids, labels, _ = packed([40], seed=2)
    doc = torch.zeros_like(ids)
    loss, _ = m(ids, labels=labels, doc_ids=doc)
    g = grads_of(m, loss)
    ref_loss, _ = m(ids, labels=labels)
    ref_g = grads_of(m, ref_loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "memory",
    [
        MemoryConfig(recompute="selective"),
        MemoryConfig(recompute="full"),
        MemoryConfig(recompute="selective", mlp_tiles=3, loss_chunk=16),
        MemoryConfig(recompute="full", mlp_tiles=3, offload_activations=True),
        MemoryConfig(offload_activations=True, mlp_tiles=2),
    ],
    ids=["selective", "full", "selective+tiles+chunk", "full+tiles+offload", "none+offload"],
)
def test_doc_mask_composes_with_memory_switches(memory):
    ids, labels, doc = packed(LENGTHS, seed=3)
    pos = document_positions(doc)
    ref_m = build()
    ref = grads_of(ref_m, ref_m(ids, position_ids=pos, labels=labels, doc_ids=doc)[0])
    m = build(memory=memory)
    if m.offload is not None:  # every saved tensor through the pack/unpack path, on CPU
        m.offload = ActivationOffload(min_bytes=0, copy_cpu=True)
    got = grads_of(m, m(ids, position_ids=pos, labels=labels, doc_ids=doc)[0])
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL, msg=lambda s: f"{memory} {k}: {s}")


def test_doc_ids_with_a_cache_are_refused():
    m = build()
    with pytest.raises(ValueError, match="KV cache"):
        m(
            torch.zeros(1, 4, dtype=torch.long),
            doc_ids=torch.zeros(1, 4, dtype=torch.long),
            cache=KVCache(m.cfg.n_layers),
        )


def test_packing_layout():
    doc = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], list(range(8))]
    assert document_lengths(doc).tolist() == [[3, 3, 3, 1, 4, 4, 4, 4], [8] * 8]
    labels = torch.tensor([[5, 5, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 6, [5] * 6])
    assert row_lengths(labels).tolist() == [4, 0, 6]


# --------------------------------------------------------------------------- GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("impl", ["flex", "varlen"])
@pytest.mark.parametrize(
    "memory",
    [
        MemoryConfig(),
        MemoryConfig(recompute="full", offload_activations=True),
        MemoryConfig(recompute="selective", mlp_tiles=2, offload_activations=True),
    ],
    ids=["plain", "full+offload", "selective+tiles+offload"],
)
def test_cuda_model_fast_kernel_equals_dense(impl, memory):
    """The whole model on CUDA with the GPU kernel (compiled FlexAttention or varlen) == the dense
    reference kernel: loss and every gradient, bf16, under recompute and the offload streams
    (saved-tensor hooks around a compiled kernel). bf16 tolerance: 2e-2 relative on the loss,
    grads within 5e-2 of the largest entry of each (two bf16 paths, not one against fp32)."""
    from megablu.ops.doc_attention import use_impl

    if impl == "varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    mc = ModelConfig(n_layers=3, d_model=576, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=VOCAB)
    ids, labels, doc = (t.cuda() for t in packed([300, 1, 200, 499, 47], seed=5))
    pos = document_positions(doc)
    out = {}
    for name, mem, kernel in (("dense", MemoryConfig(), "dense"), (impl, memory, impl)):
        m = apply_memory(BluModel(mc, ROPE), mem)
        m.reset_parameters(seed=0)
        m = m.to("cuda", torch.bfloat16)
        if m.offload is not None:
            m.offload = ActivationOffload(min_bytes=0)
        with use_impl(kernel):
            loss, n = m(ids, position_ids=pos, labels=labels, doc_ids=doc)
        out[name] = (float(loss / n), grads_of(m, loss / n))
        if m.offload is not None:
            assert m.offload.host_bytes > 0
    assert out[impl][0] == pytest.approx(out["dense"][0], rel=2e-2)
    for k, ref in out["dense"][1].items():
        err = (out[impl][1][k].float() - ref.float()).abs().max()
        assert err <= 5e-2 * ref.float().abs().max() + 1e-6, f"{impl} {memory} grad {k}: {err}"
