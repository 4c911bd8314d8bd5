"""The held-out loss (eval/loss.py sequence_nll) under the Ulysses-sharded forward (sp=2, gloo) with
rope.yarn.apply=beyond_original: each rank's slice must be rotated by the rope of the WHOLE sequence
(its length decides YaRN or the original RoPE), so sp=2 equals one rank, which equals the always-YaRN
model for a sequence longer than original_max_position."""

import math

import torch

from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.eval.loss import sequence_nll
from megablu.model.decoder import BluModel
from tests.dist_utils import run_distributed

ORIG, T = 16, 30  # each rank's slice (15) fits the original positions, the sequence (30) does not
ROPES = {
    a: RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=ORIG, apply=a))
    for a in ("always", "beyond_original")
}
ROPES["native"] = RopeConfig(theta=10000.0)


def _model(rope):
    m = BluModel(
        ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=257, init_std=0.5),
        ROPES[rope],
    )
    m.reset_parameters(seed=5)
    return m.double().eval()


IDS = torch.randint(0, 257, (T,), generator=torch.Generator().manual_seed(3)).tolist()


def _worker(rank, world):
    torch.set_num_threads(1)
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    g = build_groups(2)
    with torch.no_grad():
        return sequence_nll(apply_ulysses(_model("beyond_original"), g), IDS, sp_group=g.sp_group, tail_from=20)


def test_sp2_held_out_loss_uses_the_whole_sequences_rope():
    with torch.no_grad():
        one = sequence_nll(_model("beyond_original"), IDS, tail_from=20)
        yarn = sequence_nll(_model("always"), IDS, tail_from=20)
        native = sequence_nll(_model("native"), IDS, tail_from=20)
    assert one[1] == T - 1 and math.isclose(one[0], yarn[0], rel_tol=1e-9), (one, yarn)
    assert not math.isclose(one[0], native[0], rel_tol=1e-6), "both ropes give the same loss; the test cannot tell"
    got = run_distributed(_worker, 2)  # rank 0's (the all-reduced sums)
    assert got[1] == one[1] and got[3] == one[3]
    assert math.isclose(got[0], one[0], rel_tol=1e-9) and math.isclose(got[2], one[2], rel_tol=1e-9), (got, one)
