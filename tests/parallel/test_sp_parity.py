"""Ulysses SP (and dp x sp) under every ZeRO stage == a one-rank reference: loss and every grad.

Gradient clipping is 0 so a wrong gradient scale cannot hide (DESIGN.md: the trap).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.model.decoder import BluModel
from tests.dist_utils import run_distributed

VOCAB = 64


def _model_cfg(h, kv):
    return ModelConfig(n_layers=2, d_model=8 * h, n_heads=h, n_kv_heads=kv, ffn_dim=40, vocab_size=VOCAB)


ROPE = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=2.0, original_max_position=16))


def _global_batch(n_seq, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, VOCAB, (n_seq, T + 1), generator=g)
    labels = toks[:, 1:].clone()
    labels[0, :3] = -100  # some ignored targets, unevenly placed
    return toks[:, :-1], labels


def _reference(h, kv, T, n_seq):
    model = BluModel(_model_cfg(h, kv), ROPE)
    model.reset_parameters(seed=0)
    ids, labels = _global_batch(n_seq, T)
    loss_sum, count = model(ids, labels=labels)
    loss = loss_sum / count
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def engine_grads(model, g, stage: int, T: int, ga: int = 1, rs: bool = True, zero: Optional[dict] = None):
    """One DeepSpeed step of `model` (already Ulysses-wrapped) on this rank's share of the global
    batch: (token-mean loss, every parameter's reduced gradient). `zero`: more zero_optimization keys
    (e.g. stage3_param_persistence_threshold=0: ZeRO-3 partitions even these tiny weights, which it
    otherwise keeps whole on every rank below 1e5 elements).

    Plain SGD at lr 1: the update of every parameter IS minus its reduced gradient, read back
    through ZeRO's own gather (robust for stages 0-3)."""
    import deepspeed

    from megablu.train.step import forward_backward

    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **({"reduce_scatter": rs} if stage == 3 else {}), **(zero or {})},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds, mpu=g)
    ids, labels = _global_batch(g.dp * ga, T)
    # dp replica d takes sequences [d*ga, (d+1)*ga): one per micro-batch
    micro = [
        {"input_ids": ids[g.dp_rank * ga + i][None], "labels": labels[g.dp_rank * ga + i][None]} for i in range(ga)
    ]
    loss = forward_backward(engine, micro, g, stage, rs)
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
        grads = {n: before[n] - p.detach().clone() for n, p in params}
    engine.destroy() if hasattr(engine, "destroy") else None
    return loss, grads


def _worker(rank, world, cases):
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    results = []
    for c in cases:
        g = build_groups(c["sp"])
        model = BluModel(_model_cfg(c["h"], c["kv"]), ROPE)
        model.reset_parameters(seed=0)
        apply_ulysses(model, g)
        results.append(engine_grads(model, g, c["stage"], c["T"], c.get("ga", 1), c.get("rs", True)))
    return results


CASES_2 = [
    dict(h=4, kv=4, sp=2, T=32, stage=0),
    dict(h=4, kv=4, sp=2, T=32, stage=1),
    dict(h=4, kv=2, sp=2, T=31, stage=2),  # window not divisible by sp
    dict(h=4, kv=4, sp=2, T=32, stage=3, rs=True),
    dict(h=4, kv=4, sp=2, T=32, stage=3, rs=False),
    dict(h=9, kv=3, sp=2, T=32, stage=2),  # heads not divisible by sp (SmolLM2-like)
]
CASES_4 = [
    dict(h=8, kv=2, sp=4, T=30, stage=1),  # kv < sp, T % sp != 0
    dict(h=6, kv=3, sp=4, T=32, stage=3, rs=True),  # uneven heads, ZeRO-3
    dict(h=4, kv=4, sp=4, T=32, stage=0),  # MHA sp=4
    dict(h=4, kv=2, sp=2, T=32, stage=2, ga=2),  # hybrid dp=2 x sp=2 with grad accumulation
    dict(h=4, kv=2, sp=2, T=32, stage=3, rs=True),  # hybrid under ZeRO-3
]


def _check(cases, results, world):
    for c, (loss, grads) in zip(cases, results):
        n_seq = (world // c["sp"]) * c.get("ga", 1)
        ref_loss, ref_grads = _reference(c["h"], c["kv"], c["T"], n_seq)
        assert loss == pytest.approx(ref_loss, rel=1e-5), c
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=2e-4, atol=2e-6, msg=lambda m: f"{c} {n}: {m}")


def test_sp2_all_zero_stages_match_one_rank():
    results = run_distributed(_worker, 2, CASES_2)
    _check(CASES_2, results, 2)


def test_sp4_and_hybrid_match_one_rank():
    results = run_distributed(_worker, 4, CASES_4)
    _check(CASES_4, results, 4)


class _RecordingFA4:
    """flash_attn_func computed by SDPA, recording the shapes Ulysses hands the local kernel."""

    def __init__(self):
        self.shapes = []

    def __call__(self, q, k, v, causal=False, **kw):
        from megablu.ops.attention import sdpa_causal

        assert causal and not kw
        self.shapes.append((tuple(q.shape), tuple(k.shape)))
        return sdpa_causal(q, k, v), None


_LIGER_ROWS: list = []


def _fake_liger(h, w, y, ignore_index, reduction, accum_dtype):
    """liger_fused_linear_cross_entropy's contract (the summed CE of this rank's tokens) in torch; loss_chunk 0
    passes no chunk_mem_const (Liger's own chunks)."""
    assert reduction == "sum" and accum_dtype == torch.float32
    _LIGER_ROWS.append(h.shape[0])
    return torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=ignore_index, reduction="sum")


def _worker_fa4(rank, world, cases):
    """memory.attention=fa4 and memory.loss=liger under Ulysses: the kernel DistributedAttention wraps
    is FA4, on the full sequence and this rank's heads, and the head's loss is Liger's sum over this
    rank's tokens, normalised by the count reduced over the sp group (stand-ins here: no GPU)."""
    from megablu.config.schema import MemoryConfig
    from megablu.memory.apply import apply_memory
    from megablu.ops import attention, cross_entropy
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    fake = _RecordingFA4()
    attention._fa4_func = lambda: fake
    attention.fa4_problem = lambda q, k: None
    cross_entropy._liger_func = lambda: _fake_liger
    results = []
    for c in cases:
        g = build_groups(c["sp"])
        model = apply_memory(BluModel(_model_cfg(c["h"], c["kv"]), ROPE), MemoryConfig(attention="fa4", loss="liger"))
        model.reset_parameters(seed=0)
        apply_ulysses(model, g)
        fake.shapes.clear()
        _LIGER_ROWS.clear()
        results.append((*engine_grads(model, g, c["stage"], c["T"]), sorted(set(fake.shapes)), list(_LIGER_ROWS)))
    return results


def test_fa4_and_liger_under_ulysses():
    cases = [dict(h=4, kv=2, sp=2, T=31, stage=1), dict(h=9, kv=3, sp=2, T=32, stage=1)]
    results = run_distributed(_worker_fa4, 2, cases)
    _check(cases, [r[:2] for r in results], 2)
    # (B, T, H/sp, D): the whole (padded) sequence, this rank's heads; 9 heads -> 10 padded MHA heads
    assert results[0][2] == [((1, 32, 2, 8), (1, 32, 1, 8))]
    assert results[1][2] == [((1, 32, 5, 8), (1, 32, 5, 8))]
    # the head's loss went through Liger once per step, on this rank's 16 tokens
    assert results[0][3] == results[1][3] == [16]
