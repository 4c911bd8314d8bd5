"""YaRN inv_freq and attention factor == transformers' _compute_yarn_parameters."""

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import _compute_yarn_parameters

from megablu.model.rope import yarn_inv_freq


@pytest.mark.parametrize(
    "head_dim,theta,factor,orig",
    [
        (64, 500000.0, 2.0, 16384),  # blu-0.5b 16k -> 32k
        (64, 500000.0, 4.0, 16384),  # 16k -> 64k
        (64, 100000.0, 4.0, 8192),  # SmolLM2-style 8k -> 32k
        (128, 10000.0, 8.0, 4096),
        (32, 10000.0, 1.5, 2048),
        (16, 10000.0, 2.0, 16),  # tiny: ramp clamps to the edges
    ],
)
def test_yarn_matches_transformers(head_dim, theta, factor, orig):
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=int(orig * factor),
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": orig,
        },
    )
    ref_inv, ref_scale = _compute_yarn_parameters(cfg, "cpu")
    inv, scale = yarn_inv_freq(head_dim, theta, factor, orig)
    assert torch.equal(inv, ref_inv.float())
    assert scale == pytest.approx(ref_scale, abs=0)
    assert scale == pytest.approx(0.1 * math.log(factor) + 1)


def test_yarn_explicit_attention_factor_and_no_truncate():
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
            "truncate": False,
            "attention_factor": 1.25,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    )
    ref_inv, ref_scale = _compute_yarn_parameters(cfg, "cpu")
    inv, scale = yarn_inv_freq(64, 10000.0, 4.0, 2048, beta_fast=16, beta_slow=2, truncate=False, attention_factor=1.25)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=0, atol=0)
    assert scale == ref_scale == 1.25
