"""Ulysses sp=2 and sp=4 with each family's switches == one rank: the token-mean loss and every gradient.

q/k norms (per head and over the projection), post-norms, NoPE layers, a llama3 parent rope with
YaRN on top, Gemma 3's switches with a sliding window crossing the ranks' boundary and a Mistral
window in every layer; uneven heads (9 heads on 2 ranks) included. Every norm weight is randomised (the init's
ones cannot tell a norm applied on the wrong side of the all-to-all). Gradient clipping 0.
"""

from __future__ import annotations

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig, RopeScalingConfig, YarnConfig
from megablu.model.decoder import BluModel
from tests.dist_utils import run_distributed
from tests.parallel.test_sp_parity import VOCAB, _global_batch, engine_grads

LLAMA3_YARN = RopeConfig(
    theta=10000.0,
    scaling=RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8
    ),
    yarn=YarnConfig(factor=2.0, original_max_position=16),
)
PLAIN = RopeConfig(theta=10000.0)
GEMMA3 = dict(qk_norm="head", norm_layout="sandwich", norm_offset=True, embed_scale=True, activation="gelu_tanh")
SWITCHES = (
    "family",
    "qk_norm",
    "norm_layout",
    "nope_layers",
    "norm_offset",
    "embed_scale",
    "activation",
    "sliding_window",
    "sliding_layers",
)

CASES = [
    dict(family="qwen3", qk_norm="head", h=4, kv=2, T=31, rope=LLAMA3_YARN),
    dict(family="olmo2", qk_norm="proj", norm_layout="post", h=9, kv=3, T=32, rope=PLAIN),  # uneven heads
    dict(family="smollm3", nope_layers=[1], h=4, kv=4, T=32, rope=LLAMA3_YARN),
    # an 8-token window over 31 tokens (each rank holds 16): the window crosses the ranks' boundary
    dict(
        family="gemma3",
        **GEMMA3,
        sliding_window=8,
        sliding_layers=[0],
        h=9,
        kv=3,
        T=31,
        rope=RopeConfig(theta=1e6, local_theta=1e4, yarn=YarnConfig(factor=2.0, original_max_position=16)),
    ),
    dict(family="mistral", sliding_window=8, sliding_layers=[0, 1], h=4, kv=2, T=32, rope=PLAIN),
]


def _model(c) -> BluModel:
    switches = {k: c[k] for k in SWITCHES if k in c}
    m = BluModel(
        ModelConfig(
            n_layers=2, d_model=8 * c["h"], n_heads=c["h"], n_kv_heads=c["kv"], ffn_dim=40, vocab_size=VOCAB, **switches
        ),
        c["rope"],
    )
    m.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return m


def _reference(c):
    model = _model(c)
    ids, labels = _global_batch(1, c["T"])
    s, n = model(ids, labels=labels)
    (s / n).backward()
    return float((s / n).detach()), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


CASES_4 = [
    # 6 heads on 4 ranks (padded), kv 3; a 8-token window over 30 tokens held 8 per rank
    dict(
        family="gemma3",
        **GEMMA3,
        sliding_window=8,
        sliding_layers=[0],
        h=6,
        kv=3,
        T=30,
        rope=RopeConfig(theta=1e6, local_theta=1e4),
    ),
    dict(family="olmo2", qk_norm="proj", norm_layout="post", h=8, kv=2, T=32, rope=LLAMA3_YARN),  # kv < sp
]


def _worker(rank, world, cases):
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    out = []
    for c in cases:
        g = build_groups(world)
        out.append(engine_grads(apply_ulysses(_model(c), g), g, 1, c["T"]))
    return out


@pytest.mark.parametrize("sp,cases", [(2, CASES), (4, CASES_4)], ids=["sp2", "sp4"])
def test_families_match_one_rank(sp, cases):
    results = run_distributed(_worker, sp, cases)
    for c, (loss, grads) in zip(cases, results):
        ref_loss, ref = _reference(c)
        assert loss == pytest.approx(ref_loss, rel=1e-5), c["family"]
        assert set(grads) == set(ref)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref[n], rtol=2e-4, atol=2e-6, msg=lambda m: f"{c['family']} {n}: {m}")
