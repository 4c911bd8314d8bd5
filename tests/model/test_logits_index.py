"""logits_index: one position's logits equal that row of the full logits (prefill never holds [T, V])."""

import torch

from megablu.config.schema import ModelConfig, RopeConfig
from megablu.model.decoder import BluModel


def test_logits_index_equals_full_row():
    torch.manual_seed(0)
    m = BluModel(
        ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97),
        RopeConfig(theta=10000.0),
    )
    m.reset_parameters(seed=0)
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        full = m(ids)
        for i in (0, 7, 18, -1):
            one = m(ids, logits_index=i)
            assert one.shape == (2, 1, 97)
            torch.testing.assert_close(one[:, 0], full[:, i], rtol=0, atol=1e-6)
