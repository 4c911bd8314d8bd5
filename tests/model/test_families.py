"""Each family model/hf.py imports == transformers' own model of that family, fp32, every parameter
randomised (norms, q/k norms, biases: `randomised`), and export -> transformers -> the same logits.

Lengths run past every window: llama3's band length, YaRN's original window, the sliding window.
Families: Llama with rope_type llama3 / linear (Llama 3.x), Mistral (with and without its window),
Qwen3 (per-head q/k norms), OLMo 2 (q/k norms over the projection, post-norms), SmolLM3 (NoPE
layers), Gemma 3 (1 + w norms, sqrt(d) embedding, GeGLU, sandwich norms, sliding and global layers
with their own rope bases; YaRN and linear on the global layers only, as transformers does).
"""

import pytest
import torch
import transformers

from megablu.config.schema import RopeConfig, RopeScalingConfig, YarnConfig
from megablu.model.hf import RopeExportError, configs_from_hf, from_hf, hf_config_dict, to_hf
from megablu.model.rope import default_inv_freq, scaled_inv_freq, yarn_inv_freq

from .test_hf_parity import randomised

VOCAB = 97
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=80,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 96}

# Gemma 3: a 24-token window on layers 0 and 1, a global layer 2, each kind its own rope base
GEMMA = dict(
    sliding_window=24,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    query_pre_attn_scalar=16,
    tie_word_embeddings=True,
)
LOCAL = {"rope_type": "default", "rope_theta": 10000.0}

# (name, transformers config class, its keyword arguments)
FAMILIES = {
    "llama-llama3": (transformers.LlamaConfig, dict(rope_parameters=LLAMA3)),
    "llama-linear": (transformers.LlamaConfig, dict(rope_parameters=LINEAR)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "mistral-yarn": (transformers.MistralConfig, dict(sliding_window=None, rope_parameters=YARN)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True)),
    "qwen3-yarn": (transformers.Qwen3Config, dict(rope_parameters=YARN)),
    "olmo2": (transformers.Olmo2Config, dict()),
    "olmo2-yarn": (transformers.Olmo2Config, dict(rope_parameters=YARN)),
    "smollm3": (transformers.SmolLM3Config, dict(no_rope_layers=[1, 0, 1], rope_theta=10000.0)),
    "smollm3-yarn": (transformers.SmolLM3Config, dict(no_rope_layers=[0, 1, 1], rope_parameters=YARN)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=24)),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            GEMMA,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": LOCAL},
        ),
    ),
    "gemma3-linear": (
        transformers.Gemma3TextConfig,
        dict(GEMMA, rope_parameters={"full_attention": {**LINEAR, "rope_theta": 1e6}, "sliding_attention": LOCAL}),
    ),
    "gemma3-yarn": (
        transformers.Gemma3TextConfig,
        dict(GEMMA, rope_parameters={"full_attention": YARN, "sliding_attention": LOCAL}),
    ),
}


def hf_family(name: str, seed: int = 0):
    cls, kw = FAMILIES[name]
    cfg = cls(**{**SMALL, **kw})
    torch.manual_seed(seed)
    return randomised(transformers.AutoModelForCausalLM.from_config(cfg).eval(), seed)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers(name):
    hf = hf_family(name)
    model = from_hf(hf).eval()
    # 150 > llama3's 64-token band length and YaRN's original 96
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_export_round_trip_same_class_same_logits(name):
    hf = hf_family(name)
    back = to_hf(from_hf(hf)).eval()
    assert type(back) is type(hf)
    mine, theirs = back.config.rope_parameters, hf.config.rope_parameters
    # the export also spells out YaRN's default betas; Gemma 3 has one rope dict per layer kind
    pairs = [(mine[k], theirs[k]) for k in theirs] if "full_attention" in theirs else [(mine, theirs)]
    for m, t in pairs:
        assert {k: m.get(k) for k in t} == t
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_family_switches_are_imported():
    expect = {
        "qwen3": ("head", "pre", []),
        "olmo2": ("proj", "post", []),
        "smollm3": ("none", "pre", [1]),
        "mistral": ("none", "pre", []),
        "llama-llama3": ("none", "pre", []),
        "gemma3": ("head", "sandwich", []),
    }
    for name, (qk, layout, nope) in expect.items():
        m, r = configs_from_hf(hf_family(name).config)
        assert (m.qk_norm, m.norm_layout, m.nope_layers) == (qk, layout, nope), name
    _, r = configs_from_hf(hf_family("llama-llama3").config)
    assert r.scaling == RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64
    )


def test_yarn_on_llama3_blends_the_parents_frequencies():
    """YaRN on a llama3 parent: extrapolated dims keep the parent's (llama3) frequencies, interpolated
    ones take them / factor, over transformers' ramp (which, with no scaling, IS transformers' YaRN)."""
    dim, theta, factor, orig = 32, 10000.0, 4.0, 256
    sc = RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64
    )
    parent = scaled_inv_freq(dim, theta, sc)
    assert not torch.equal(parent, default_inv_freq(dim, theta))
    plain, _ = yarn_inv_freq(dim, theta, factor, orig)
    on_top, att = yarn_inv_freq(dim, theta, factor, orig, base=parent)
    # the blend weight per dim, read off the plain YaRN: 1 = extrapolated, 0 = interpolated
    d = default_inv_freq(dim, theta)
    w = (plain - d / factor) / (d - d / factor)
    torch.testing.assert_close(on_top, parent / factor + w * (parent - parent / factor))
    assert (w > 0.99).any() and (w < 0.01).any()
    assert att == pytest.approx(0.1 * torch.log(torch.tensor(factor)).item() + 1)


def test_yarn_on_a_scaled_parent_is_not_exported():
    from megablu.config.schema import ModelConfig

    m = ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=2, ffn_dim=40, vocab_size=VOCAB)
    rope = RopeConfig(
        theta=1e4,
        scaling=RopeScalingConfig(type="linear", factor=2.0),
        yarn=YarnConfig(factor=2.0, original_max_position=128),
    )
    with pytest.raises(RopeExportError, match="rope.scaling.type=linear.*one rope_type"):
        hf_config_dict(m, rope, 256)


def test_qwen3_with_sliding_layers_is_refused():
    cfg = transformers.Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    with pytest.raises(ValueError, match=r"window 32\) in layers \[1, 2\] is imported for gemma3 and mistral only"):
        configs_from_hf(cfg)


def test_unknown_model_type_and_partial_rope_are_refused():
    g = transformers.GemmaConfig(**{k: v for k, v in SMALL.items()})
    with pytest.raises(
        ValueError,
        match=r"model_type='gemma'.*imports gemma3_text, llama, mistral, olmo2, qwen2, "
        r"qwen3, smollm3",
    ):
        configs_from_hf(g)
    p = transformers.LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        configs_from_hf(p)


def test_qwen3_and_olmo2_with_attention_bias_are_refused():
    for cls in (transformers.Qwen3Config, transformers.Olmo2Config):
        with pytest.raises(ValueError, match="attention_bias=True"):
            configs_from_hf(cls(**SMALL, attention_bias=True))


@pytest.mark.parametrize("name", ["olmo2", "qwen3-yarn", "smollm3", "gemma3"])
def test_memory_switches_same_loss_and_grads(name):
    """recompute (selective, full) and the tiled MLP run each family's block as written (OLMo 2's
    post-norms included): the same loss and every gradient as without them."""
    from megablu.config.schema import MemoryConfig
    from megablu.memory.apply import apply_memory

    hf = hf_family(name)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(3))
    out = {}
    for key, mem in {
        "none": MemoryConfig(),
        "selective": MemoryConfig(recompute="selective"),
        "selective+tiles": MemoryConfig(recompute="selective", mlp_tiles=3),
        "full": MemoryConfig(recompute="full"),
    }.items():
        m = apply_memory(from_hf(hf), mem)
        s, n = m(ids, labels=ids)
        (s / n).backward()
        out[key] = (float(s.detach()), {k: p.grad for k, p in m.named_parameters()})
    for key, (loss, grads) in out.items():
        assert loss == pytest.approx(out["none"][0], rel=1e-6), key
        for k, g in grads.items():
            # tiles sum a row's gradient in another order; Gemma's sqrt(d) embedding scale multiplies it by 8
            torch.testing.assert_close(g, out["none"][1][k], rtol=1e-5, atol=2e-6, msg=lambda s: f"{key} {k}: {s}")


@pytest.mark.parametrize("name", ["llama-llama3", "mistral", "qwen3", "olmo2", "smollm3", "gemma3-yarn"])
def test_files_import_then_ckpt_export_loads_in_transformers(name, tmp_path, monkeypatch):
    """The file path a user takes: a transformers dir (save_pretrained) read as init_from reads it (its
    config.json's architecture and rope, its safetensors by name), then `ckpt export`'s writer, then
    transformers' from_pretrained on the export: the same logits as the original model."""
    import json

    import megablu.checkpoint.weights as w
    from megablu.model.decoder import BluModel
    from megablu.model.hf import model_record_from_hf, rope_record_from_hf

    hf = hf_family(name)
    src = tmp_path / "src"
    hf.save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    model_cfg = model_record_from_hf(cfg)
    rope_cfg, window = rope_record_from_hf(cfg)
    model = BluModel(model_cfg, rope_cfg)
    w.load_weights(model, src)
    monkeypatch.setattr(w, "_export_source", lambda s: tmp_path / "run" / "step")
    monkeypatch.setattr(w, "read_manifest", lambda step: {"run_id": "r", "step": 1, "manifest_sha256": "0"})
    monkeypatch.setattr(w, "_model_configs", lambda manifest, run_dir: (model_cfg, rope_cfg, window))
    monkeypatch.setattr(w, "read_weights", lambda step: dict(model.state_dict()))
    out, *_ = w.export_checkpoint("run", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(model.eval()(ids), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-4, atol=1e-4)


def test_gemma3_yarn_only_on_the_global_layers():
    """The rule for local and global layers: YaRN (and linear/llama3 scaling) where a layer meets
    distances beyond what it was trained at. A sliding layer's distances stay below its window, so
    it keeps its plain RoPE at rope.local_theta, attention factor 1; the global layers get YaRN.
    (test_logits_match_transformers[gemma3-yarn] checks the same against transformers, which
    computes one rope per layer kind.)"""
    model = from_hf(hf_family("gemma3-yarn"))
    assert model.cfg.sliding_layers == [0, 1] and model.rope_cfg.local_theta == 10000.0
    assert model.rope_cfg.yarn is not None and model.rotary.attention_scaling > 1
    torch.testing.assert_close(model.rotary_local.inv_freq, default_inv_freq(16, 10000.0), rtol=0, atol=0)
    assert model.rotary_local.attention_scaling == 1.0


@pytest.mark.parametrize("name", ["gemma3", "mistral-window"])
def test_sliding_window_kv_cache_decode_equals_full_forward(name):
    """Prefill then one token at a time past the window: each step's keys outside the window are masked
    exactly as in the full forward."""
    from megablu.model.decoder import KVCache

    model = from_hf(hf_family(name)).eval()
    ids = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.cfg.n_layers)
        pre = model(ids[:, :30], cache=cache)
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(30, 60)]
    torch.testing.assert_close(pre, full[:, :30], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 30:], rtol=1e-5, atol=1e-5)


def test_gemma3_refusals():
    for kw, msg in [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
        (dict(query_pre_attn_scalar=32), "query_pre_attn_scalar=32 != head_dim 16"),
    ]:
        cls, base = FAMILIES["gemma3"]
        with pytest.raises(ValueError, match=msg):
            configs_from_hf(cls(**{**SMALL, **base, **kw}))
