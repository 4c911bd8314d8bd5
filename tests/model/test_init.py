"""BluModel's init: the seeded constructor writes every parameter itself (the skipped nn default
init leaves nothing behind), equals reset_parameters(seed), and puts nn.init back."""

import math

import pytest
import torch
from torch import nn

from megablu.config.schema import ModelConfig, RopeConfig
from megablu.model.decoder import BluModel

CFG = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
def test_seeded_constructor_equals_reset(tie):
    a = BluModel(ModelConfig(**CFG, tie_embeddings=tie), RopeConfig(theta=10000.0), seed=3)
    b = BluModel(ModelConfig(**CFG, tie_embeddings=tie), RopeConfig(theta=10000.0))
    b.reset_parameters(seed=3)
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], rtol=0, atol=0, msg=n)
    std = a.cfg.init_std
    for n, p in pa.items():  # each parameter holds what reset_parameters writes, none left empty
        if n.endswith("norm.weight"):
            assert torch.all(p == 1.0), n
        else:
            want = std / math.sqrt(2 * a.cfg.n_layers) if n.endswith(("o_proj.weight", "down_proj.weight")) else std
            assert abs(p.std().item() - want) < 0.2 * want, n


def test_nn_init_restored_even_when_the_build_fails(monkeypatch):
    before = (nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_)

    def boom(*a, **k):
        assert nn.init.normal_ is not before[2]  # patched while building
        raise RuntimeError("build failed")

    monkeypatch.setattr(BluModel, "_build", boom)
    with pytest.raises(RuntimeError, match="build failed"):
        BluModel(ModelConfig(**CFG), RopeConfig(theta=10000.0))
    assert (nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_) == before
    lin = nn.Linear(4, 4, bias=False)  # the default init works again
    with torch.no_grad():
        lin.weight.zero_()
    lin.reset_parameters()
    assert lin.weight.abs().sum() > 0
