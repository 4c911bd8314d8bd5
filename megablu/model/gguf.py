"""GGUF (llama.cpp's file format) -> BluModel configs and weights, the same math llama.cpp runs.

A GGUF file holds a model's hyperparameters as `{arch}.*` metadata and its tensors under
llama.cpp's names, some quantized. `read_gguf` reads both with the `gguf` package (an optional
dependency: `pip install 'megablu[gguf]'`), dequantizes every tensor to fp32 (gguf.quants) and
undoes the two changes llama.cpp's convert_hf_to_gguf.py makes to a transformers checkpoint:

  - llama arch: q_proj and k_proj rows are permuted per head from transformers' half-split rotary
    layout to llama.cpp's interleaved pairs (`LlamaModel.permute`: reshape (H, 2, D/2, in),
    swap axes 1 and 2); qwen2, qwen3 and gemma3 are written unpermuted (NEOX-style RoPE in llama.cpp).
  - gemma3: every `*norm.weight` is stored as 1 + w (Gemma's RMSNorm scales by 1 + w); BluModel's
    norm_offset switch adds the 1, so the import subtracts it.

The architecture maps to a megablu family (ARCH_FAMILY) through a transformers-style config dict,
so model/hf.py's checks and refusals apply unchanged. What llama.cpp computes that BluModel does
not is refused with the reason: a `rope_freqs` tensor (Llama 3.1+'s llama3 rope, whose parameters
the file does not record), YaRN from GGUF metadata, per-layer head counts, soft-capping, a
partial rotary dimension, and any tensor that has no place in BluModel.

Where a key is absent, llama.cpp's loader (llama-model.cpp) decides, and so does this reader:
rope.freq_base 10000, head_count_kv = head_count, Gemma 3's sliding layers every layer but each
sixth (its set_swa_pattern(6)) with a local rope base of 10000 (rope_freq_base_train_swa).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Union

import torch

from ..config.schema import ModelConfig, RopeConfig
from .hf import configs_from_hf

PathLike = Union[str, Path]

# GGUF general.architecture -> the transformers model_type model/hf.py imports (its family)
ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# llama.cpp's Gemma 3 rules where the file records none (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0
# llama.cpp's rope base when a file records none
DEFAULT_THETA = 10000.0

# llama.cpp tensor name (without blk.N. and .weight/.bias) -> BluModel module; ffn_norm is the
# pre-MLP norm: BluModel's post_attention_layernorm (Llama layout) or pre_feedforward_layernorm (Gemma 3)
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


class GGUFError(ValueError):
    """A GGUF file megablu cannot import; the message names the file, the field and the fix."""


@dataclass
class GGUFModel:
    """What one GGUF file holds, in megablu's terms."""

    model: ModelConfig
    rope: RopeConfig
    max_position: int  # {arch}.context_length: the window it was trained at
    state: dict[str, torch.Tensor]  # BluModel names, fp32, dequantized (no lm_head when tied)
    hf_config: dict[str, Any]  # the transformers-style dict the configs came from
    meta: dict[str, Any] = field(default_factory=dict)  # architecture, name, licence, file_type


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            f"{path}: reading GGUF needs the `gguf` package: pip install 'megablu[gguf]' (requirements.txt pins it)"
        ) from None
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors on a file that is not GGUF
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _fields(reader) -> dict[str, Any]:
    """Every metadata key -> its value (str, int, float, bool, or a list of them); the tokenizer's
    long arrays are skipped (the tokenizer is not part of the weights)."""
    import numpy as np
    from gguf import GGUFValueType

    out = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        v = f.contents()
        if f.types == [GGUFValueType.FLOAT32]:
            # the shortest decimal that is this float32 (1e-06, not 9.999999974752427e-07): the number the
            # converter wrote, so the config matches the model card's; fp32 compute sees the same value
            v = float(np.format_float_positional(np.float32(v), unique=True, trim="-"))
        out[k] = v
    return out


def _need(meta: dict, path: Path, key: str, kind=int):
    v = meta.get(key)
    if v is None:
        raise GGUFError(
            f"{path}: metadata key {key!r} is missing; it is the model's shape and has no default: "
            f"re-convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    if isinstance(v, list):
        raise GGUFError(f"{path}: {key}={v} varies per layer; BluModel has one value for every layer")
    return kind(v)


def _hf_config(meta: dict, path: Path, tensors: dict) -> dict:
    """The transformers config dict (as model/hf.py reads it) that the file's metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCH_FAMILY:
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not imported; megablu reads GGUF of "
            f"{', '.join(sorted(ARCH_FAMILY))} (docs/MODELS.md). Convert the model to a transformers "
            f"folder and import that, if model/hf.py supports its model_type"
        )
    a = arch + "."
    d_model = _need(meta, path, a + "embedding_length")
    n_heads = _need(meta, path, a + "attention.head_count")
    kv = meta.get(a + "attention.head_count_kv", n_heads)
    if isinstance(kv, list):
        raise GGUFError(f"{path}: {a}attention.head_count_kv={kv} varies per layer; BluModel has one kv head count")
    head_dim = int(meta.get(a + "attention.key_length", d_model // n_heads))
    v_dim = int(meta.get(a + "attention.value_length", head_dim))
    if v_dim != head_dim:
        raise GGUFError(
            f"{path}: {a}attention.value_length={v_dim} != key_length {head_dim}; BluModel's value "
            f"heads are as wide as its key heads"
        )
    rot = int(meta.get(a + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(
            f"{path}: {a}rope.dimension_count={rot} < head dim {head_dim} (RoPE on part of each head); "
            f"BluModel rotates the whole head"
        )
    n_layers = _need(meta, path, a + "block_count")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing: the file holds no embedding")
    rope = _rope(meta, path, a, tensors)
    cfg = dict(
        model_type=ARCH_FAMILY[arch],
        architectures=None,
        num_hidden_layers=n_layers,
        hidden_size=d_model,
        num_attention_heads=n_heads,
        num_key_value_heads=int(kv),
        head_dim=head_dim,
        intermediate_size=_need(meta, path, a + "feed_forward_length"),
        vocab_size=int(embd.shape[0]),
        rms_norm_eps=_need(meta, path, a + "attention.layer_norm_rms_epsilon", float),
        max_position_embeddings=_need(meta, path, a + "context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        rope_parameters=rope,
    )
    if arch == "qwen2":
        cfg["attention_bias"] = True  # Qwen2's q/k/v biases: BluModel's qkv_bias (checked against the tensors)
    if arch == "gemma3":
        cfg.update(_gemma3(meta, path, a, n_layers, d_model, n_heads, head_dim, rope))
    return cfg


def _rope(meta: dict, path: Path, a: str, tensors: dict) -> dict:
    if "rope_freqs.weight" in tensors:
        raise GGUFError(
            f"{path}: tensor 'rope_freqs.weight' holds per-frequency rope factors (Llama 3.1+'s llama3 "
            f"rope); the file does not record the llama3 parameters (factor, low/high_freq_factor, "
            f"original window) that BluModel computes them from: import the model's transformers "
            f"folder instead"
        )
    theta = float(meta.get(a + "rope.freq_base", DEFAULT_THETA))
    kind = meta.get(a + "rope.scaling.type", "none")
    # llama.cpp applies the factor (or the older key rope.scale_linear) as a linear frequency scale
    raw = meta.get(a + "rope.scaling.factor", meta.get(a + "rope.scale_linear"))
    factor = 1.0 if raw is None or float(raw) == 0.0 else float(raw)
    if kind in ("none", "linear") and factor == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    if kind in ("none", "linear"):
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise GGUFError(
        f"{path}: {a}rope.scaling.type={kind!r} is not imported from GGUF (none or linear): the file "
        f"does not record every parameter transformers' and BluModel's {kind} need; import the "
        f"model's transformers folder instead"
    )


def _gemma3(
    meta: dict, path: Path, a: str, n_layers: int, d_model: int, n_heads: int, head_dim: int, rope: dict
) -> dict:
    """Gemma 3's layer kinds, window and second rope, as llama.cpp runs them."""
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.get(a + cap) is not None:
            raise GGUFError(f"{path}: {a}{cap}={meta[a + cap]} (tanh soft-capping) is not supported by BluModel")
    # llama.cpp scales queries by 1/sqrt(d_model / n_heads) for the 62-layer (27B) model, 1/sqrt(head_dim) else
    scalar = d_model // n_heads if n_layers == 62 else head_dim
    if scalar != head_dim:
        raise GGUFError(
            f"{path}: {n_layers} layers is Gemma 3 27B, whose queries llama.cpp scales by "
            f"1/sqrt({scalar}) (d_model/heads), not 1/sqrt(head_dim {head_dim}); BluModel scales by "
            f"head_dim only"
        )
    window = _need(meta, path, a + "attention.sliding_window")
    pattern = meta.get(a + "attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):  # one flag per layer, true = sliding (llama.cpp's swa_layers)
        if len(pattern) != n_layers:
            raise GGUFError(
                f"{path}: {a}attention.sliding_window_pattern has {len(pattern)} flags for {n_layers} layers"
            )
        sliding = [bool(p) for p in pattern]
    else:  # every n-th layer global: llama.cpp's set_swa_pattern(n)
        sliding = [(i % int(pattern)) < int(pattern) - 1 for i in range(n_layers)]
    local = float(meta.get(a + "rope.freq_base_swa", GEMMA3_LOCAL_THETA))
    return dict(
        sliding_window=window,
        query_pre_attn_scalar=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_parameters={"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}},
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's LlamaModel.permute: rows (H, D/2, 2) -> (H, 2, D/2) per head, i.e.
    llama.cpp's interleaved rotary pairs back to transformers' rotate_half halves. w: (H*D, ...)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _blu_name(name: str, gemma: bool) -> Optional[str]:
    """BluModel's parameter name for a llama.cpp tensor name; None if BluModel has no such tensor."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    block = {
        **_BLOCK,
        "ffn_norm": "pre_feedforward_layernorm" if gemma else "post_attention_layernorm",
        **({"post_attention_norm": "post_attention_layernorm"} if gemma else {}),
    }
    mod = block.get(parts[2])
    return f"layers.{parts[1]}.{mod}.{suffix}" if mod else None


def _dequantize(path: Path, t) -> torch.Tensor:
    from gguf import quants

    try:
        arr = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(
            f"{path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which the gguf package "
            f"cannot dequantize; re-quantize the file with llama.cpp's llama-quantize to a type it "
            f"reads (F32, F16, BF16, Q8_0, Q4_K_M, ...)"
        ) from None
    return torch.from_numpy(arr.astype("float32", copy=False).copy())


def read_gguf(path: PathLike) -> GGUFModel:
    """Configs and fp32 BluModel weights of a GGUF file (GGUFError: what cannot be imported, and why)."""
    path = Path(path)
    reader = _reader(path)
    meta = _fields(reader)
    tensors = {t.name: t for t in reader.tensors}
    hf_config = _hf_config(meta, path, {k: t.data for k, t in tensors.items()})
    try:
        model_cfg, rope_cfg = configs_from_hf(SimpleNamespace(**hf_config))
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None
    arch = meta["general.architecture"]
    gemma = arch == "gemma3"
    kv = model_cfg.n_kv_heads
    state = {}
    for name, t in tensors.items():
        blu = _blu_name(name, gemma)
        if blu is None:
            raise GGUFError(
                f"{path}: tensor {name!r} has no place in BluModel ({arch} as megablu imports it); "
                f"this file's model computes something BluModel does not"
            )
        w = _dequantize(path, t)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_qk(w, model_cfg.n_heads if ".attn_q." in name else kv)
        if gemma and name.endswith("norm.weight"):
            w = w - 1.0  # stored as 1 + w (convert_hf_to_gguf.py Gemma3Model: norm_shift)
        state[blu] = w
    _check_tensors(path, model_cfg, rope_cfg, state)
    return GGUFModel(
        model=model_cfg,
        rope=rope_cfg,
        max_position=int(hf_config["max_position_embeddings"]),
        state=state,
        hf_config=hf_config,
        meta={
            "architecture": arch,
            "name": meta.get("general.name"),
            "license": meta.get("general.license"),
            "file_type": meta.get("general.file_type"),
            "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        },
    )


def _check_tensors(path: Path, model_cfg: ModelConfig, rope_cfg: RopeConfig, state: dict) -> None:
    """Every BluModel parameter present with its shape (llama.cpp's name in the message)."""
    from .decoder import BluModel

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in BluModel(model_cfg, rope_cfg).state_dict().items()}
    if model_cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
    gg = {v: k for k, v in _reverse_names(model_cfg).items()}
    missing = [gg.get(k, k) for k in want if k not in state]
    if missing:
        raise GGUFError(
            f"{path}: tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''} missing for the model "
            f"its metadata describes ({model_cfg.n_layers} layers); the file is truncated or its "
            f"metadata does not match its tensors: re-convert it"
        )
    extra = [gg.get(k, k) for k in state if k not in want]
    if extra:
        raise GGUFError(
            f"{path}: tensor(s) {extra[:6]} have no place in BluModel's {model_cfg.resolved_family} "
            f"(e.g. biases it does not compute); this file's model computes something BluModel does not"
        )
    bad = [
        f"{gg.get(k, k)}: {tuple(v.shape)}, expected {want[k]}" for k, v in state.items() if tuple(v.shape) != want[k]
    ]
    if bad:
        raise GGUFError(f"{path}: tensor shapes disagree with the metadata: {'; '.join(bad[:4])}")


def _reverse_names(model_cfg: ModelConfig) -> dict[str, str]:
    """llama.cpp name -> BluModel name for every tensor such a model has (for messages)."""
    gemma = model_cfg.resolved_family == "gemma3"
    names = [f"{g}.weight" for g in _GLOBAL]
    for i in range(model_cfg.n_layers):
        for stem in [*_BLOCK, "ffn_norm", "post_attention_norm"]:
            names += [f"blk.{i}.{stem}.weight", f"blk.{i}.{stem}.bias"]
    return {n: b for n in names if (b := _blu_name(n, gemma)) is not None}


def load_gguf(path: PathLike, dtype: torch.dtype = torch.float32):
    """A BluModel with a GGUF file's weights (its trained window as `max_position`, as from_hf records)."""
    from .decoder import BluModel

    g = read_gguf(path)
    model = BluModel(g.model, g.rope)
    missing, unexpected = model.load_state_dict(g.state, strict=False)
    if unexpected or [m for m in missing if not (g.model.tie_embeddings and m == "lm_head.weight")]:
        raise GGUFError(f"{path}: missing {missing}, unexpected {unexpected}")  # _check_tensors covers this
    model.max_position = g.max_position
    return model.to(dtype)


IMPORT_RECORD = "megablu_import.json"


def import_files(d: Path) -> Optional[set[str]]:
    """What gguf_to_dir wrote in d (its record and the files it lists), or None: what --force may replace."""
    try:
        rec = json.loads((d / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    files = rec.get("files") if isinstance(rec, dict) else None
    if not isinstance(files, dict):
        return None
    return {IMPORT_RECORD, *(k for k in files if isinstance(k, str))}


def gguf_to_dir(path: PathLike, out: PathLike, force: bool = False) -> Path:
    """A transformers folder (model.safetensors in transformers' names, config.json written by
    hf_config_dict, megablu_import.json with the source's sha256 and licence) from a GGUF file: what
    `init_from`, `megablu eval --hf` and transformers' from_pretrained read. Written aside, then renamed."""
    import os
    import shutil

    from safetensors.torch import save_file

    from ..utils.files import replace_problem, sha256_file, swap_in
    from .hf import hf_config_dict

    path, out = Path(path), Path(out)
    why = replace_problem(
        out, what="a megablu GGUF import", flag="--force", replace=force, owned=import_files, inputs=[path]
    )
    if why:
        raise GGUFError(why)
    g = read_gguf(path)
    cfg = hf_config_dict(g.model, g.rope, g.max_position)
    cfg["torch_dtype"] = "float32"
    sd = {k if k == "lm_head.weight" else f"model.{k}": v.contiguous() for k, v in g.state.items()}
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    rec = {
        "source": str(path.resolve()),
        "source_sha256": sha256_file(path),
        **g.meta,
        "dequantized_to": "float32",
        "files": {
            p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir()) if p.is_file()
        },
    }
    (tmp / IMPORT_RECORD).write_text(json.dumps(rec, indent=1) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    swap_in(tmp, out)
    return out
