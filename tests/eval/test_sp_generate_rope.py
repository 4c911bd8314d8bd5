"""rope.yarn.apply=beyond_original under the Ulysses-sharded prefill and replicated decode (sp=2, gloo):
the RoPE is chosen once from prompt + max_new (KVCache.rope_len) on every rank, so sp=2 generation
equals one-rank generation, which equals the native model's when the sequence stays within
original_max_position and the always-YaRN model's when it grows past it while generating."""

import torch

from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.eval.generate import greedy_generate
from megablu.model.decoder import BluModel
from tests.dist_utils import run_distributed

ORIG, MAX_NEW = 16, 6
ROPES = {
    a: RopeConfig(theta=10000.0, yarn=YarnConfig(factor=4.0, original_max_position=ORIG, apply=a))
    for a in ("always", "beyond_original")
}
ROPES["native"] = RopeConfig(theta=10000.0)
CASES = [(3, 1, 9), (4, 2, 13)]  # (heads, kv heads, prompt length): 9 + 6 <= 16 (original); 13 + 6 > 16 (YaRN)


def _model(h, kv, rope):
    # a large init so that attention (hence the rope) decides the argmax of a random model
    m = BluModel(
        ModelConfig(n_layers=2, d_model=8 * h, n_heads=h, n_kv_heads=kv, ffn_dim=64, vocab_size=257, init_std=0.5),
        ROPES[rope],
    )
    m.reset_parameters(seed=5)
    return m.double().eval()


def _prompts(L):
    return torch.randint(0, 257, (2, L), generator=torch.Generator().manual_seed(L))


def _worker(rank, world):
    torch.set_num_threads(1)
    from megablu.parallel.groups import build_groups
    from megablu.parallel.ulysses import apply_ulysses

    g = build_groups(2)
    return [
        greedy_generate(apply_ulysses(_model(h, kv, "beyond_original"), g), _prompts(L), MAX_NEW, sp_group=g.sp_group)
        for h, kv, L in CASES
    ]


def test_sp2_beyond_original_generation_equals_one_rank_and_its_rope():
    gens = run_distributed(_worker, 2)
    for (h, kv, L), got in zip(CASES, gens):
        one = greedy_generate(_model(h, kv, "beyond_original"), _prompts(L), MAX_NEW)
        assert torch.equal(got, one), (h, kv, L)
        ref = greedy_generate(_model(h, kv, "always" if L + MAX_NEW > ORIG else "native"), _prompts(L), MAX_NEW)
        assert torch.equal(one, ref), (h, kv, L)
        other = greedy_generate(_model(h, kv, "native" if L + MAX_NEW > ORIG else "always"), _prompts(L), MAX_NEW)
        assert not torch.equal(one, other), f"{(h, kv, L)}: both ropes generate the same tokens; the test cannot tell"
