"""data.doc_mask through forward_backward under Ulysses (sp=2) and dp (sp=1) == one rank running
each document alone: the token-mean loss and every parameter's gradient, gradient clipping 0.

The reference never sees a mask: every document of every row is its own sequence (positions
from 0 for doc_positions=restart, the row's positions for continue), on one rank without
DeepSpeed. Under sp=2 each rank holds half of a row but the attention, after the all-to-all,
sees the whole row on half the heads: the full doc ids must reach it.
"""

from __future__ import annotations

import pytest
import torch

from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.model.decoder import BluModel
from tests.dist_utils import run_distributed

VOCAB = 64
ALWAYS = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=2.0, original_max_position=16))
BEYOND = RopeConfig(theta=10000.0, yarn=YarnConfig(factor=2.0, original_max_position=16, apply="beyond_original"))


def _model(c):
    m = BluModel(
        ModelConfig(n_layers=2, d_model=8 * c["h"], n_heads=c["h"], n_kv_heads=c["kv"], ffn_dim=40, vocab_size=VOCAB),
        c["rope"],
    )
    m.reset_parameters(seed=0)
    return m


def _rows(c):
    """One packed row per dp replica: (ids, labels, doc_ids), each (n_rows, T)."""
    g = torch.Generator().manual_seed(7)
    rows = c["rows"]
    T = sum(rows[0])
    toks = torch.randint(0, VOCAB, (len(rows), T + 1), generator=g)
    labels = toks[:, 1:].clone()
    labels[0, 1] = -100
    doc = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(r)]) for r in rows]).to(torch.int32)
    return toks[:, :-1], labels, doc


def _reference(c):
    model = _model(c)
    ids, labels, _ = _rows(c)
    total, count = 0.0, int((labels != -100).sum())
    for b, lengths in enumerate(c["rows"]):
        s = 0
        for n in lengths:
            pos = torch.arange(s, s + n)[None] if c["positions"] == "continue" else None
            total = total + model(ids[b : b + 1, s : s + n], position_ids=pos, labels=labels[b : b + 1, s : s + n])[0]
            s += n
    loss = total / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, cases):
    import deepspeed

    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses
    from megablu.train.step import forward_backward

    results = []
    for c in cases:
        g = build_groups(c["sp"])
        model = apply_ulysses(_model(c), g)
        ds = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": c["stage"]},
            "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
        }
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds, mpu=g
        )
        ids, labels, doc = _rows(c)
        d = g.dp_rank
        micro = [{"input_ids": ids[d : d + 1], "labels": labels[d : d + 1], "doc_ids": doc[d : d + 1]}]
        loss = forward_backward(engine, micro, g, c["stage"], True, doc_mask=True, doc_positions=c["positions"])
        params = list(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=c["stage"] == 3):
            grads = {n: before[n] - p.detach().clone() for n, p in params}  # SGD lr 1: update == -grad
        results.append((loss, grads))
    return results


CASES = [
    # T=31: not divisible by sp (a pad document); documents 17 > 16 (YaRN) and <= 16 (original RoPE)
    dict(h=4, kv=2, sp=2, stage=2, rope=BEYOND, positions="restart", rows=[[5, 1, 17, 8]]),
    # SmolLM2-like uneven heads (padded to 10 under sp=2), a document boundary inside each rank's half
    dict(h=9, kv=3, sp=2, stage=1, rope=ALWAYS, positions="continue", rows=[[10, 3, 19]]),
    dict(h=4, kv=4, sp=2, stage=3, rope=ALWAYS, positions="restart", rows=[[16, 16]]),  # boundary at the split
    # sp=1, dp=2: each replica its own packed row, gradients averaged over dp
    dict(h=4, kv=2, sp=1, stage=0, rope=BEYOND, positions="restart", rows=[[20, 4, 8], [1, 31]]),
]


def test_doc_mask_sp2_and_dp2_match_documents_alone():
    results = run_distributed(_worker, 2, CASES)
    for c, (loss, grads) in zip(CASES, results):
        ref_loss, ref_grads = _reference(c)
        what = {k: v for k, v in c.items() if k != "rope"} | {"apply": c["rope"].yarn.apply}
        assert loss == pytest.approx(ref_loss, rel=1e-5), what
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=2e-4, atol=2e-6, msg=lambda m: f"{what} {n}: {m}")


def test_shard_batch_layout():
    """What each sp rank gets: its slice of ids/labels/positions/rope_len, the FULL padded doc ids.
    (Loss-level tests cannot see restart vs continue: RoPE is relative, so inside a masked
    document both give the same attention up to rounding.)"""
    from megablu.parallel.groups import Groups
    from megablu.parallel.sequence import shard_batch

    ids = torch.arange(7)[None]
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2]])
    batch = {"input_ids": ids, "labels": ids, "doc_ids": doc}
    got = []
    for r in range(2):
        g = Groups(world_size=2, rank=r, sp=2, dp=1, sp_rank=r, dp_rank=0)
        got.append(shard_batch(batch, g, doc_mask=True))
    assert [m["input_ids"].tolist() for m in got] == [[[0, 1, 2, 3]], [[4, 5, 6, 0]]]
    assert [m["position_ids"].tolist() for m in got] == [[[0, 1, 2, 0]], [[1, 0, 1, 7]]]
    assert [m["rope_len"].tolist() for m in got] == [[[3, 3, 3, 2]], [[2, 2, 2, 0]]]
    for m in got:  # the pad token is a document of its own, after the last one
        assert m["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 3]]
    g = Groups(world_size=2, rank=1, sp=2, dp=1, sp_rank=1, dp_rank=0)
    assert shard_batch(batch, g, doc_mask=True, doc_positions="continue")["position_ids"].tolist() == [[4, 5, 6, 7]]
    plain = shard_batch(batch, g)
    assert "doc_ids" not in plain and plain["rope_len"].tolist() == [[7, 7, 7, 0]]
    # a fit row: one document of 4 real tokens, then padding with the same id (so the row keeps
    # plain causal attention); its length is the real one, never the padded one
    fit = {
        "input_ids": ids,
        "labels": torch.tensor([[1, 2, 3, -100, -100, -100, -100]]),
        "doc_ids": torch.zeros(1, 7, dtype=torch.int32),
    }
    one = Groups(world_size=1, rank=0, sp=1, dp=1, sp_rank=0, dp_rank=0)
    assert shard_batch(fit, one, doc_mask=True)["rope_len"].tolist() == [[3] * 7]
    with pytest.raises(ValueError, match="no doc_ids"):
        shard_batch({"input_ids": ids, "labels": ids}, g, doc_mask=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        shard_batch({**batch, "doc_ids": doc.flip(1)}, g, doc_mask=True)
