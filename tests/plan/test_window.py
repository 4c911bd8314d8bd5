"""The planner counts what a sliding-window layer's blocks save for backward (ops/window_attention.py): the
key/value chunks each block concatenates, (nb + 1) copies of k and v per token, hand-checked, added to the
sliding layers' activations, and held against the bytes autograd saves on CPU."""

import pytest
import torch

from megablu import plan
from megablu.config.schema import ModelConfig
from megablu.model.decoder import LocalAttention
from megablu.utils.window import block_rows, earlier_chunks

BASE = dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=1000, family="mistral")
KV = 2 * 16  # kv heads x head_dim


def sliding(window: int, layers=(0, 1, 2)) -> ModelConfig:
    return ModelConfig(**BASE, sliding_window=window, sliding_layers=list(layers))


def test_copies_hand_checked():
    # window 200: blocks of 256 rows, one earlier chunk: 2 chunks x (k, v) x bf16 x KV per token
    assert (block_rows(200), earlier_chunks(200, 256)) == (256, 1)
    assert plan.window_copies_per_token(sliding(200), 257) == 2 * 2 * 2 * KV
    # one block or less: the dense call on the keys the window reaches, no copies
    assert plan.window_copies_per_token(sliding(200), 256) == 0
    # window 1: no earlier chunk, each block's keys are its own chunk (still copied out of k by the split)
    assert plan.window_copies_per_token(sliding(1), 4096) == 1 * 2 * 2 * KV
    assert plan.window_copies_per_token(ModelConfig(**BASE), 4096) == 0
    # Ulysses: kv heads replicated to a multiple of sp (2 kv heads on 4 ranks: x2)
    assert plan.window_copies_per_token(sliding(200), 4096, sp=4) == 2 * 2 * 2 * KV * 2


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_estimate_adds_the_copies_of_the_sliding_layers(recompute):
    T = 4096
    full_attention, windowed = (
        plan.estimate(plan.Setup(m, T, recompute=recompute, loss_chunk=256, optimizer=False))
        for m in (ModelConfig(**BASE), sliding(512))
    )
    copies = plan.window_copies_per_token(sliding(512), T)
    assert copies > 0
    if recompute == "full":  # the layer input is saved; the rebuilt sliding layer holds its copies once
        assert windowed.per_token == full_attention.per_token
        assert windowed.phase == full_attention.phase == "backward"
        assert windowed.allocated - full_attention.allocated == pytest.approx(copies * T)
    else:  # three sliding layers of four save them
        assert windowed.per_token - full_attention.per_token == pytest.approx(3 * copies)


def saved_bytes(att, q, k, v) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        att(q, k, v)
    return sum(storages.values())


def test_copies_are_what_the_blocks_save():
    """bf16 on CPU, 8 blocks: beyond what causal SDPA saves over the same q, k, v (q, k, v, output, LSE),
    the blocks save their concatenated keys/values (block 0 reads its one chunk in place: 7/8 of the
    planner's (nb + 1) copies) and the one (C, (nb + 1) C) mask."""
    T, H, Hkv, D, window = 1024, 4, 2, 16, 100
    C, nb = block_rows(window), earlier_chunks(window, block_rows(window))
    n = T // C
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, h, D, generator=g).bfloat16().requires_grad_() for h in (H, Hkv, Hkv))
    extra = saved_bytes(LocalAttention(window=window), q, k, v) - saved_bytes(LocalAttention(), q, k, v)
    m = ModelConfig(**{**BASE, "n_layers": 1}, sliding_window=window, sliding_layers=[0])
    planned = plan.window_copies_per_token(m, T) * T
    assert extra == planned * (n - 1) / n + C * (nb + 1) * C * 2
