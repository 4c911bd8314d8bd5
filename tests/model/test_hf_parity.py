"""BluModel == transformers LlamaForCausalLM / Qwen2ForCausalLM with the same weights (fp32).

transformers' own init sets every RMSNorm weight to 1 and every bias to 0, so a model built by
it cannot tell the two norms of a block apart or see a dropped q/k/v bias: `randomised` gives
every parameter (norms and biases included) its own random values before any comparison.
"""

import pytest
import torch
import transformers

from megablu.config.schema import MemoryConfig
from megablu.memory.apply import apply_memory
from megablu.model.decoder import KVCache
from megablu.model.hf import from_hf, to_hf


def _llama(yarn: bool, tie: bool, kv: int = 2, heads: int = 4):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 96}
    cfg = transformers.LlamaConfig(
        hidden_size=16 * heads,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=88,
        vocab_size=113,
        max_position_embeddings=192,
        rope_parameters=rope,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return randomised(transformers.LlamaForCausalLM(cfg).eval())


@torch.no_grad()
def randomised(hf, seed: int = 0):
    """Every parameter its own values: norms around 1 (+-0.5), biases around 0 (0.5), matrices
    as transformers drew them. Distinct per tensor, so swapping two of them changes the output."""
    g = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return hf


@pytest.mark.parametrize("yarn,tie,kv,heads", [(True, False, 2, 4), (False, True, 4, 4), (True, True, 3, 9)])
def test_logits_match_llama(yarn, tie, kv, heads):
    hf = _llama(yarn, tie, kv, heads)
    model = from_hf(hf).eval()
    ids = torch.randint(0, 113, (2, 150))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_round_trip_to_hf_and_qwen2():
    hf = _llama(True, False)
    back = to_hf(from_hf(hf), max_position=hf.config.max_position_embeddings)
    for (k, v), (k2, v2) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
        assert k == k2 and torch.equal(v, v2), k
    assert back.config.rope_parameters["rope_type"] == "yarn"
    assert back.config.rope_parameters["original_max_position_embeddings"] == 96

    qcfg = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=80,
        vocab_size=97,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    q = randomised(transformers.Qwen2ForCausalLM(qcfg).eval(), seed=1)
    m = from_hf(q).eval()
    assert m.cfg.qkv_bias
    ids = torch.randint(0, 97, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), q(ids).logits, rtol=1e-5, atol=1e-5)


def test_labels_loss_equals_hf_loss_and_chunked_grads_equal():
    hf = _llama(True, False)
    ids = torch.randint(0, 113, (2, 100))
    labels = ids.clone()
    labels[:, :5] = -100
    ref = hf(ids, labels=labels).loss  # HF shifts internally
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    grads = {}
    for chunk in (0, 37):
        m = apply_memory(from_hf(hf), MemoryConfig(loss_chunk=chunk))
        s, n = m(ids, labels=shifted)
        (s / n).backward()
        assert float((s / n).detach()) == pytest.approx(float(ref), rel=1e-5)
        grads[chunk] = {k: p.grad for k, p in m.named_parameters()}
    for k in grads[0]:
        torch.testing.assert_close(grads[37][k], grads[0][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_same_grads(mode):
    hf = _llama(True, False)
    ids = torch.randint(0, 113, (2, 64))
    out = {}
    for m_ in ("none", mode):
        m = apply_memory(from_hf(hf), MemoryConfig(recompute=m_))
        s, n = m(ids, labels=ids)
        (s / n).backward()
        out[m_] = {k: p.grad for k, p in m.named_parameters()}
    for k in out["none"]:
        torch.testing.assert_close(out[mode][k], out["none"][k], rtol=1e-5, atol=1e-7)


def test_kv_cache_decode_equals_full_forward():
    model = from_hf(_llama(True, False)).eval()
    ids = torch.randint(0, 113, (1, 40))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.cfg.n_layers)
        pre = model(ids[:, :30], cache=cache)
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(30, 40)]
    torch.testing.assert_close(pre, full[:, :30], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 30:], rtol=1e-5, atol=1e-5)


def test_model_does_not_import_deepspeed():
    """Architecture only: no deepspeed, and neither the memory switches (megablu.memory) nor
    activation checkpointing -- they are applied from outside, as Ulysses is."""
    import ast
    import pathlib

    import megablu.model as pkg

    for f in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.startswith("deepspeed") for n in names), f"{f.name} imports deepspeed"
                assert not any(n.startswith(("memory", "megablu.memory", "torch.utils.checkpoint")) for n in names), (
                    f"{f.name} imports a memory switch"
                )


def test_parity_models_have_no_default_norms_or_biases():
    """The guard on the guard: every norm weight differs from 1 and every bias from 0, and no
    two norms of a block are equal (a swap of the two would then change the logits)."""
    q = randomised(
        transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=80,
                vocab_size=97,
            )
        ).eval(),
        seed=1,
    )
    for h in (_llama(True, False), q):
        named = dict(h.named_parameters())
        norms = [p for n, p in named.items() if n.endswith("norm.weight")]
        biases = [p for n, p in named.items() if n.endswith(".bias")]
        assert norms and all((p != 1).all() for p in norms)
        assert all((p != 0).all() for p in biases)
        for layer in h.model.layers:
            assert not torch.equal(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    assert any(n.endswith("q_proj.bias") for n, _ in q.named_parameters())
