"""What `from_hf` / `to_hf` refuse, keep and say about a transformers config (the audit's gaps):
a sliding-window Qwen2 is refused (its logits differ beyond the window), max_position_embeddings
survives a round trip, a YaRN factor of 1.0 imports as the plain RoPE it equals, and an
unsupported rope names the model when the config lists no architecture."""

import pytest
import torch
import transformers

from megablu.model.hf import configs_from_hf, from_hf, rope_record_from_hf, to_hf

from .test_hf_parity import randomised

SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=80,
    vocab_size=97,
)


def _qwen2(**kw):
    torch.manual_seed(0)
    return randomised(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, **kw)).eval())


def test_sliding_window_qwen2_is_refused():
    # every layer slides (max_window_layers=0): beyond 8 tokens HF's logits differ from full attention
    hf = _qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding"):
        from_hf(hf)


def test_sliding_window_flag_without_a_sliding_layer_imports_exactly():
    # use_sliding_window with max_window_layers >= the layer count: no layer slides (HF's layer_types)
    hf = _qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=2)
    ids = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(hf).eval()(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_to_hf_keeps_max_position_embeddings():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMALL, max_position_embeddings=8192)
    back = to_hf(from_hf(transformers.LlamaForCausalLM(cfg).eval()))
    assert back.config.max_position_embeddings == 8192
    # an explicit max_position still wins
    assert (
        to_hf(from_hf(transformers.LlamaForCausalLM(cfg).eval()), max_position=2048).config.max_position_embeddings
        == 2048
    )


def test_yarn_factor_one_imports_as_the_plain_rope_it_equals():
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 128}
    cfg = transformers.LlamaConfig(**SMALL, max_position_embeddings=128, rope_parameters=rope)
    torch.manual_seed(0)
    hf = randomised(transformers.LlamaForCausalLM(cfg).eval())
    model_cfg, rope_cfg = configs_from_hf(hf.config)
    assert rope_cfg.yarn is None and rope_cfg.theta == 10000.0
    ids = torch.randint(0, 97, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(hf).eval()(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    rec, window = rope_record_from_hf(cfg.to_dict())
    assert rec.yarn is None and window == 128


def test_yarn_factor_one_with_an_attention_factor_is_refused_clearly():
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 1.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 1.3,
    }
    cfg = transformers.LlamaConfig(**SMALL, max_position_embeddings=128, rope_parameters=rope)
    with pytest.raises(ValueError, match=r"factor 1\.0.*attention_factor 1\.3") as e:
        configs_from_hf(cfg)
    assert "validation error" not in str(e.value).lower()


def test_unsupported_rope_names_the_model_without_architectures():
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    cfg = transformers.LlamaConfig(**SMALL, rope_parameters=rope)
    cfg.architectures = None
    with pytest.raises(ValueError) as e:
        configs_from_hf(cfg)
    msg = str(e.value)
    assert "'dynamic'" in msg and "llama" in msg and not msg.rstrip().endswith("arch")
