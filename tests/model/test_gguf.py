"""GGUF import (model/gguf.py) == transformers' own GGUF loader on the same file, fp32 logits <= 1e-4.

Each file is written in the test the way llama.cpp's convert_hf_to_gguf.py writes a transformers
checkpoint: tensor names from gguf's own TensorNameMap, q/k rows permuted for the llama arch
(LlamaModel.permute), Gemma 3 norms stored as 1 + w, 2-D tensors quantized (Q8_0) or F32, every
parameter random (`randomised`: norms, q/k norms, biases). The oracle is
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`; for F32 files the source model too.
Architectures: llama (untied, and tied as SmolLM2 ships), qwen2 (q/k/v biases), qwen3 (q/k norms),
gemma3 (sliding and global layers, sandwich norms, GeGLU). Two model-specific choices follow what
transformers' GGUF loader leaves at its config defaults: qwen3's head_dim 128 (it does not read
attention.key_length for qwen3) and gemma3's query_pre_attn_scalar 256 (so head_dim 256 here).
"""

from __future__ import annotations

import json

import gguf  # requirements.txt pins it (setup.py extra `gguf`): a missing install fails here, not skips
import numpy as np
import pytest
import torch
import transformers

from megablu.model.gguf import GGUFError, load_gguf, read_gguf

from .test_hf_parity import randomised

VOCAB = 96
BASE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
# arch -> (transformers config class, its arguments, gguf arch name)
ARCHS = {
    "llama": (transformers.LlamaConfig, dict(head_dim=16, rope_theta=50000.0, tie_word_embeddings=False)),
    "smollm2": (transformers.LlamaConfig, dict(head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=128, rope_theta=1e6, tie_word_embeddings=True)),
    # 6 layers: llama.cpp's and transformers' Gemma 3 pattern (layers 0-4 slide, 5 is global)
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=24,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}
GGUF_ARCH = {"llama": "llama", "smollm2": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def source_model(name: str, seed: int = 0):
    cls, kw = ARCHS[name]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**BASE, **kw}))
    with torch.no_grad():
        return randomised(hf.eval(), seed)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (half-split rotary rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, arch: str, path, qtype=None, skip=(), extra=None, meta=None):
    """hf's weights as convert_hf_to_gguf.py writes them (qtype: 2-D tensors quantized to it)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test {arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rp = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rp["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    for k, v in (meta or {}).items():
        w.add_key_value(k, *v)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), c.num_hidden_layers
    )
    for hf_name, t in hf.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        a = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = permute(a, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0
        if name in skip:
            continue
        if qtype is not None and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    for name, a in (extra or {}).items():
        w.add_tensor(name, *a) if isinstance(a, tuple) else w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_gguf(path):
    """transformers' GGUF loader: what from_pretrained(dir, gguf_file=...) runs (its config from the file's
    metadata, load_gguf_checkpoint's dequantized and un-permuted tensors), without the accelerate package
    that from_pretrained requires for gguf_file and megablu does not install."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    sd = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set()), (
        missing,
        unexpected,
    )
    hf.tie_weights()
    return hf.float().eval()


IDS = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))  # 150 > gemma3's window 24


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_logits_match_transformers_gguf_loader(tmp_path, name, qtype):
    hf = source_model(name)
    path = write_gguf(hf, GGUF_ARCH[name], tmp_path / "m.gguf", qtype)
    mine = load_gguf(path).eval()
    theirs = transformers_gguf(path)
    assert mine.cfg.tie_embeddings == theirs.config.tie_word_embeddings == hf.config.tie_word_embeddings
    with torch.no_grad():
        out, ref = mine(IDS), theirs(IDS).logits
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        if qtype is None:  # F32 holds the source's weights exactly
            torch.testing.assert_close(out, hf(IDS).logits, rtol=1e-4, atol=1e-4)
        else:  # quantized: a different model than the source (the test above is not vacuous)
            assert (out - hf(IDS).logits).abs().max() > 1e-4


def test_gemma3_layer_kinds_and_ropes(tmp_path):
    g = read_gguf(write_gguf(source_model("gemma3"), "gemma3", tmp_path / "m.gguf"))
    assert g.model.sliding_layers == [0, 1, 2, 3, 4] and g.model.sliding_window == 24
    assert (g.rope.theta, g.rope.local_theta) == (1e6, 10000.0)
    assert g.model.resolved_family == "gemma3" and g.max_position == 256
    # float32 metadata read as the decimal the converter wrote (a config saying 1e-6 matches the import)
    assert g.model.norm_eps == BASE["rms_norm_eps"] == 1e-6


def test_linear_rope_from_metadata(tmp_path):
    """rope.scaling.type=linear (llama.cpp applies the factor; transformers' GGUF loader does not read it): the
    oracle is the source model itself, a transformers Llama with rope_type linear."""
    cls, kw = ARCHS["llama"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        cls(**{**BASE, **kw, "rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}})
    )
    with torch.no_grad():
        hf = randomised(hf.eval(), 0)
    path = write_gguf(
        hf,
        "llama",
        tmp_path / "m.gguf",
        meta={
            "llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
            "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
        },
    )
    mine = load_gguf(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(mine(IDS), hf(IDS).logits, rtol=1e-4, atol=1e-4)
    assert mine.rope_cfg.scaling.type == "linear" and mine.rope_cfg.scaling.factor == 4.0


def test_import_dir_loads_in_transformers(tmp_path):
    """`ckpt import-gguf`'s folder: transformers' from_pretrained on it == megablu's import of the file."""
    from megablu.cli import main

    path = write_gguf(source_model("qwen2"), "qwen2", tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert main(["ckpt", "import-gguf", str(path), "--out", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "megablu_import.json").read_text())
    assert rec["architecture"] == "qwen2" and "Q8_0" in rec["tensor_types"]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, load_gguf(path)(IDS), rtol=1e-5, atol=1e-5)
    # init_from's reader (checkpoint.load_weights, with its architecture check against config.json)
    from megablu.checkpoint.weights import load_weights
    from megablu.model.decoder import BluModel

    g = read_gguf(path)
    blu = BluModel(g.model, g.rope).eval()
    load_weights(blu, tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(blu(IDS), back(IDS).logits, rtol=1e-5, atol=1e-5)
    # an existing import is replaced only on request
    assert main(["ckpt", "import-gguf", str(path), "--out", str(tmp_path / "out")]) == 2
    assert main(["ckpt", "import-gguf", str(path), "--out", str(tmp_path / "out"), "--force"]) == 0
    # a folder megablu did not write is never replaced, --force or not
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["ckpt", "import-gguf", str(path), "--out", str(tmp_path / "mine"), "--force"]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


# ------------------------------------------------------------------ what is refused, and how it says so
def test_unknown_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError,
        match=r"g\.gguf: general\.architecture='gpt2' is not imported.*gemma3, llama, "
        r"qwen2, qwen3.*transformers folder",
    ):
        read_gguf(tmp_path / "g.gguf")


def test_missing_tensor(tmp_path):
    path = write_gguf(source_model("llama"), "llama", tmp_path / "m.gguf", skip={"blk.1.ffn_up.weight"})
    with pytest.raises(GGUFError, match=r"m\.gguf: tensor\(s\) \['blk\.1\.ffn_up\.weight'\] missing.*re-convert"):
        read_gguf(path)


def test_quant_type_gguf_cannot_dequantize(tmp_path):
    q81 = gguf.GGMLQuantizationType.Q8_1
    block, nbytes = gguf.GGML_QUANT_SIZES[q81]
    raw = np.zeros((4, 64 // block * nbytes), np.uint8)  # a (4, 64) tensor in Q8_1 blocks
    path = write_gguf(
        source_model("llama"),
        "llama",
        tmp_path / "m.gguf",
        skip={"blk.0.attn_v.weight"},
        extra={"blk.0.attn_v.weight": (raw, None, q81)},
    )
    with pytest.raises(
        GGUFError,
        match=r"m\.gguf: tensor 'blk\.0\.attn_v\.weight' is stored as Q8_1.*cannot "
        r"dequantize.*llama-quantize",
    ):
        read_gguf(path)


def test_llama3_rope_freqs_refused(tmp_path):
    path = write_gguf(
        source_model("llama"), "llama", tmp_path / "m.gguf", extra={"rope_freqs.weight": np.ones(8, np.float32)}
    )
    with pytest.raises(GGUFError, match=r"rope_freqs\.weight.*llama3.*transformers folder"):
        read_gguf(path)


def test_tensor_without_a_place_refused(tmp_path):
    path = write_gguf(
        source_model("llama"), "llama", tmp_path / "m.gguf", extra={"blk.0.attn_output.bias": np.zeros(64, np.float32)}
    )
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_output\.bias.*no place in BluModel"):
        read_gguf(path)


def test_yarn_metadata_refused(tmp_path):
    path = write_gguf(
        source_model("qwen2"),
        "qwen2",
        tmp_path / "m.gguf",
        meta={"qwen2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)},
    )
    with pytest.raises(GGUFError, match=r"qwen2\.rope\.scaling\.type='yarn' is not imported"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not gguf at all" * 10)
    with pytest.raises(GGUFError, match=r"x\.gguf: not a readable GGUF file"):
        read_gguf(tmp_path / "x.gguf")
