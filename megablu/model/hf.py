"""Interop with transformers' causal LMs of the families in ARCHITECTURES (same weights, same math).

BluModel's parameter names are HF's without the leading `model.`, so the mapping is a
prefix. transformers is imported lazily: it is an interop dependency, not a core one.
Each family is a set of BluModel switches (config/schema/model.py FAMILIES, docs/MODELS.md);
a config whose computation BluModel cannot reproduce exactly is refused with the reason.
"""

from __future__ import annotations

from typing import Any, Optional, cast

from pydantic import ValidationError

from ..config.schema import FAMILIES, ModelConfig, RopeConfig, RopeScalingConfig, YarnConfig
from ..config.schema.model import Family
from .decoder import BluModel

# family -> the transformers causal-LM class an export writes
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
assert set(ARCHITECTURES) == set(FAMILIES)
# family -> transformers model_type, where they differ (Gemma 3's text-only model; "gemma3" is the multimodal one)
MODEL_TYPES = {"gemma3": "gemma3_text"}
_FAMILY_OF = {t: f for f, t in MODEL_TYPES.items()}


def _rope_params(hf_config) -> dict:
    rp = getattr(hf_config, "rope_parameters", None)
    if rp is None:  # transformers 4.x
        rp = dict(getattr(hf_config, "rope_scaling", None) or {})
        # transformers' default for Llama and Qwen2 (LlamaConfig/Qwen2Config.default_theta)
        rp.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return dict(rp)


def _sliding_layers(hf_config) -> list[int]:
    """Layers that attend within a sliding window (transformers' `layer_types`, or Qwen2's
    use_sliding_window from max_window_layers on when a config predates layer_types)."""
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if getattr(hf_config, "use_sliding_window", False):
        return list(range(getattr(hf_config, "max_window_layers", 0), hf_config.num_hidden_layers))
    return []


def _yarn_from_hf(rp: dict, orig) -> Optional[YarnConfig]:
    """YarnConfig of a transformers yarn rope dict; None for factor 1.0, which IS the plain RoPE
    (interpolated = extrapolated frequencies, attention factor 1); a clear ValueError otherwise."""
    factor = rp.get("factor")
    if factor is None:  # transformers refuses it too (a required key of rope_type yarn)
        raise ValueError("YaRN without a factor")
    if float(factor) == 1.0:
        af = rp.get("attention_factor")
        if af is not None and float(af) != 1.0:
            raise ValueError(
                f"rope_type='yarn' with factor 1.0 and attention_factor {af:g}: YaRN factor 1.0 is the "
                f"plain RoPE, which scales nothing; this combination is not supported"
            )
        return None
    try:
        return YarnConfig(
            factor=factor,
            original_max_position=orig,
            beta_fast=rp.get("beta_fast") or 32.0,
            beta_slow=rp.get("beta_slow") or 1.0,
            truncate=rp.get("truncate", True),
            attention_factor=rp.get("attention_factor"),
        )
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(
            f"rope_type='yarn' with factor {factor!r}, original_max_position_embeddings {orig!r} is not "
            f"supported ({why})"
        ) from None


def _scaling_from_hf(kind: str, rp: dict) -> RopeScalingConfig:
    """rope_type linear / llama3 as transformers computes them (a missing key: refused, as transformers does)."""
    need = (
        ("factor",)
        if kind == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    missing = [k for k in need if rp.get(k) is None]
    if missing:
        raise ValueError(f"rope_type={kind!r} without {missing}")
    try:
        if kind == "linear":
            return RopeScalingConfig(type="linear", factor=rp["factor"])
        return RopeScalingConfig(
            type="llama3",
            factor=rp["factor"],
            low_freq_factor=rp["low_freq_factor"],
            high_freq_factor=rp["high_freq_factor"],
            original_max_position=rp["original_max_position_embeddings"],
        )
    except ValidationError as e:
        why = "; ".join(err["msg"] for err in e.errors())
        raise ValueError(f"rope_type={kind!r} with {rp} is not supported ({why})") from None


def _rope_from_hf(hf_config) -> RopeConfig:
    """The RoPE transformers computes for this config (`modeling_rope_utils`, 4.x and 5.x
    spellings): default, linear, llama3 or YaRN, anything else refused. For YaRN, as transformers'
    standardize_rope_params / _compute_yarn_parameters read it: original_max_position from a
    top-level `original_max_position_embeddings` first (Phi-3 style), then the rope dict, then
    max_position_embeddings; a factor is required (1.0: the plain RoPE it equals)."""
    rp = _rope_params(hf_config)
    local = _local_theta(hf_config, rp)
    rp = rp.get("full_attention", rp)  # one rope per layer kind (Gemma 3): the global layers'
    kind = rp.get("rope_type", rp.get("type", "default"))
    if rp.get("rope_theta") is None:
        raise ValueError("config.json has no rope_theta")
    partial = rp.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported: "
            f"BluModel rotates the whole head"
        )
    if kind == "default":
        return RopeConfig(theta=rp["rope_theta"], local_theta=local)
    if kind in ("linear", "llama3"):
        return RopeConfig(theta=rp["rope_theta"], scaling=_scaling_from_hf(kind, rp), local_theta=local)
    if kind != "yarn":
        raise ValueError(
            f"rope_type={kind!r} is not supported (default, linear, llama3 or yarn): BluModel "
            f"would compute other frequencies"
        )
    if rp.get("mscale") and rp.get("mscale_all_dim"):
        raise ValueError("YaRN with mscale/mscale_all_dim (DeepSeek style) is not supported")
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    orig = (
        getattr(hf_config, "original_max_position_embeddings", None)
        or rp.get("original_max_position_embeddings")
        or max_pos
    )
    if orig is None:
        raise ValueError("YaRN without original_max_position_embeddings or max_position_embeddings")
    return RopeConfig(theta=rp["rope_theta"], yarn=_yarn_from_hf(rp, orig), local_theta=local)


def _local_theta(hf_config, rp: dict) -> Optional[float]:
    """Gemma 3's sliding layers' own plain RoPE base (rope_parameters['sliding_attention'], 4.x:
    rope_local_base_freq); None for a family with one rope, or a Gemma 3 without sliding layers."""
    if _family_of(hf_config) != "gemma3" or not _sliding_layers(hf_config):
        return None
    local = rp.get("sliding_attention") or {
        "rope_type": "default",
        "rope_theta": getattr(hf_config, "rope_local_base_freq", None),
    }
    if local.get("rope_type", "default") != "default" or local.get("rope_theta") is None:
        raise ValueError(
            f"sliding_attention rope {local}: BluModel gives the sliding layers a plain RoPE with their rope_theta"
        )
    return float(local["rope_theta"])


def _family_of(hf_config) -> Optional[str]:
    """The family of a config's model_type; None for one BluModel does not import (the multimodal
    model_type 'gemma3' included: its text model is 'gemma3_text')."""
    t = getattr(hf_config, "model_type", None)
    if t is None or t in MODEL_TYPES:
        return None
    return _FAMILY_OF.get(t, t)


def _name(hf_config) -> str:
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    return arch or hf_config.model_type  # a config without `architectures` still names its model


def _model_from_hf(hf_config) -> ModelConfig:
    """The ModelConfig of a transformers config of a family in ARCHITECTURES; a clear ValueError for
    another model_type and for what BluModel does not compute (o_proj or MLP biases, another
    activation, sliding-window layers)."""
    name = _name(hf_config)
    fam = _family_of(hf_config)
    if fam not in ARCHITECTURES:
        types = sorted(MODEL_TYPES.get(f, f) for f in ARCHITECTURES)
        raise ValueError(
            f"model_type={hf_config.model_type!r} ({name}) is not supported: BluModel imports "
            f"{', '.join(types)} (docs/MODELS.md)"
        )
    switches = FAMILIES[fam]
    if fam != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{name}: attention_bias=True (q/k/v and o_proj biases) is not supported by BluModel")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by BluModel")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: BluModel implements SwiGLU (silu) only")
    if fam == "gemma3":
        _gemma3_refusals(hf_config, name)
    sliding = _sliding_layers(hf_config)
    if fam == "mistral" and getattr(hf_config, "sliding_window", None) is not None:
        sliding = list(range(hf_config.num_hidden_layers))  # Mistral: every layer slides when a window is set
    if sliding and fam not in ("gemma3", "mistral"):
        raise ValueError(
            f"{name}: sliding-window attention (window {getattr(hf_config, 'sliding_window', None)}) "
            f"in layers {sliding} is imported for gemma3 and mistral only (docs/MODELS.md); "
            f"attending to the whole sequence instead would change the logits beyond the window"
        )
    nope: list[int] = []
    if fam == "smollm3":
        # transformers' no_rope_layers: 1 = the layer uses RoPE, 0 = NoPE
        flags = getattr(hf_config, "no_rope_layers", None)
        if flags is None or len(flags) != hf_config.num_hidden_layers:
            raise ValueError(
                f"{name}: no_rope_layers={flags!r} must list 0/1 for each of the {hf_config.num_hidden_layers} layers"
            )
        nope = [i for i, f in enumerate(flags) if not f]
    return ModelConfig(
        n_layers=hf_config.num_hidden_layers,
        d_model=hf_config.hidden_size,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=getattr(hf_config, "head_dim", None),
        ffn_dim=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        norm_eps=hf_config.rms_norm_eps,
        nope_layers=nope,
        sliding_layers=sliding,
        sliding_window=hf_config.sliding_window if sliding else None,
        family=None if fam in ("llama", "qwen2") else cast(Family, fam),
        **switches,
    )  # fam: an ARCHITECTURES key


def _gemma3_refusals(hf_config, name: str) -> None:
    """What Gemma3ForCausalLM can compute that BluModel does not."""
    act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{name}: hidden_activation={act!r}: BluModel's Gemma 3 MLP is GeGLU with tanh GELU")
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    scalar = getattr(hf_config, "query_pre_attn_scalar", hd)
    if scalar != hd:
        raise ValueError(
            f"{name}: query_pre_attn_scalar={scalar} != head_dim {hd}: BluModel scales attention "
            f"scores by head_dim**-0.5 only"
        )
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf_config, cap, None) is not None:
            raise ValueError(
                f"{name}: {cap}={getattr(hf_config, cap)} (tanh soft-capping) is not supported by "
                f"BluModel (Gemma 3 releases leave it null)"
            )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(f"{name}: use_bidirectional_attention=True (an encoder) is not a causal LM")


def configs_from_hf(hf_config) -> tuple[ModelConfig, RopeConfig]:
    model = _model_from_hf(hf_config)
    try:
        rope = _rope_from_hf(hf_config)
    except ValueError as e:
        raise ValueError(f"{e}; model {_name(hf_config)}") from None
    return model, rope


def model_record_from_hf(config: dict) -> ModelConfig:
    """The architecture a transformers config.json dict describes (ValueError: one BluModel does not
    compute or a config it cannot read)."""
    from types import SimpleNamespace

    missing = [
        k
        for k in (
            "model_type",
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
        )
        if k not in config
    ]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    try:
        return _model_from_hf(SimpleNamespace(**config))
    except ValidationError as e:
        raise ValueError("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None


def rope_record_from_hf(config: dict) -> tuple[RopeConfig, Optional[int]]:
    """(rope, trained window) from a transformers config.json dict (4.x or 5.x spelling).

    The window is max_position_embeddings: the length the model card says it was trained at
    (for a YaRN model, factor * original_max_position_embeddings). megablu's own exports write
    the run's data.window there (`megablu ckpt export`; `to_hf` requires it)."""
    from types import SimpleNamespace

    window = config.get("max_position_embeddings")
    return _rope_from_hf(SimpleNamespace(**config)), int(window) if window else None


def from_hf(hf_model) -> BluModel:
    """BluModel with the weights of a transformers causal LM of ARCHITECTURES (memory switches:
    megablu.memory.apply_memory on the result)."""
    model_cfg, rope_cfg = configs_from_hf(hf_model.config)
    model = BluModel(model_cfg, rope_cfg)
    sd = {}
    for k, v in hf_model.state_dict().items():
        if k.startswith("model."):
            k = k[len("model.") :]
        if "rotary_emb" in k:
            continue
        sd[k] = v
    if model_cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (model_cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"from_hf: missing {missing}, unexpected {unexpected}")
    # the window the model card records: to_hf writes it back
    model.max_position = getattr(hf_model.config, "max_position_embeddings", None)
    return model.to(next(hf_model.parameters()).dtype)


class RopeExportError(ValueError):
    """The rope has no transformers equivalent (rope.yarn.apply=beyond_original, YaRN on a scaled rope)."""


def scaled_yarn_problem(rope_cfg: RopeConfig) -> Optional[str]:
    """Why YaRN on top of a linear/llama3 parent cannot be written as a transformers config: a
    config has one rope_type, and transformers' yarn blends theta's unscaled frequencies."""
    if rope_cfg.yarn is None or rope_cfg.scaling is None:
        return None
    return (
        f"rope.yarn on top of rope.scaling.type={rope_cfg.scaling.type} has no transformers equivalent: a "
        f"transformers config holds one rope_type, and its 'yarn' blends theta's unscaled frequencies, not the "
        f"{rope_cfg.scaling.type}-scaled ones this model was trained with; evaluate with megablu"
    )


def beyond_original_problem(rope_cfg: RopeConfig) -> Optional[str]:
    """Why a rope.yarn.apply=beyond_original model cannot be written as a transformers config.

    transformers (5.x `modeling_rope_utils`) has one rope type that switches on length,
    'longrope' (`longrope_frequency_update`). Its frequencies could carry YaRN's: the per-dim
    blend is inv_freq * ((1 - w) / factor + w), i.e. long_factor = 1 / ((1 - w) / factor + w)
    with short_factor = 1 (equal to fp32 rounding). Three things still differ:
      1. the attention factor: longrope applies ONE attention_factor to short and long
         inputs alike; beyond_original uses YaRN's 0.1 ln(factor) + 1 beyond the original
         length and exactly 1 within it -- no setting gives both;
      2. the unit: longrope decides per forward call from max(position_ids) + 1 over the
         whole batch; beyond_original per document (doc_mask) or per row;
      3. generation: longrope switches when the cache grows past the original length,
         mid-sequence, over keys cached with the short frequencies; beyond_original decides
         once, at prefill, from prompt + max_new.
    So no transformers setting reproduces it. A user exporting wants a model that computes
    what was trained; a silent always-YaRN export would run every short input with a rope
    the model never saw at that length (the regression beyond_original exists to avoid), so
    the export refuses by default. `rope_as_yarn=True` (CLI `--rope-as-yarn`) exports plain
    YaRN on purpose: exact for inputs longer than original_max_position, not for shorter
    ones; the provenance file records it.
    """
    y = rope_cfg.yarn
    if y is None or y.apply != "beyond_original":
        return None
    return (
        f"rope.yarn.apply=beyond_original (original RoPE up to {y.original_max_position} tokens, "
        f"YaRN x{y.factor:g} beyond) has no transformers equivalent: rope_type 'longrope' switches frequencies "
        f"on length but applies one attention_factor to short and long inputs, decides per batch rather than "
        f"per document, and switches mid-generation; the exported model would not compute what was trained. "
        f"Export plain YaRN "
        f"on purpose with `megablu ckpt export --rope-as-yarn` (exact beyond {y.original_max_position} tokens, "
        f"different below), or evaluate with megablu"
    )


def hf_config_dict(
    model_cfg: ModelConfig, rope_cfg: RopeConfig, max_position: Optional[int] = None, rope_as_yarn: bool = False
) -> dict:
    """transformers config dict. rope.yarn.apply=beyond_original raises RopeExportError unless
    rope_as_yarn (then plain YaRN: see beyond_original_problem for why nothing exact exists)."""
    problem = beyond_original_problem(rope_cfg)
    if problem and not rope_as_yarn:
        raise RopeExportError(problem)
    if scaled_yarn_problem(rope_cfg):
        raise RopeExportError(scaled_yarn_problem(rope_cfg))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_cfg.theta}
    sc = rope_cfg.scaling
    if sc is not None:
        rope = {"rope_type": sc.type, "rope_theta": rope_cfg.theta, "factor": sc.factor}
        if sc.type == "llama3":
            rope.update(
                low_freq_factor=sc.low_freq_factor,
                high_freq_factor=sc.high_freq_factor,
                original_max_position_embeddings=sc.original_max_position,
            )
    if rope_cfg.yarn is not None:
        y = rope_cfg.yarn
        rope = {
            "rope_type": "yarn",
            "rope_theta": rope_cfg.theta,
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "truncate": y.truncate,
        }
        if y.attention_factor is not None:
            rope["attention_factor"] = y.attention_factor
        max_position = max_position or int(y.factor * y.original_max_position)
    if max_position is None:
        # no silent default (a 4096 here once claimed every export was trained at 4096): a child's
        # YaRN extension is checked against this number (config/lineage.py)
        raise ValueError(
            "max_position: the window the model was trained at (written as max_position_embeddings, "
            "which a YaRN extension of it is checked against) is required for a plain-RoPE model"
        )
    fam = model_cfg.resolved_family
    extra: dict[str, Any] = {"hidden_act": "silu"}
    if fam == "mistral":
        # MistralConfig's default is 4096: None where BluModel attends to everything
        extra["sliding_window"] = model_cfg.sliding_window
    if fam == "gemma3":
        extra = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": model_cfg.resolved_head_dim,
            "sliding_window": model_cfg.sliding_window,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
            "layer_types": [
                "sliding_attention" if i in model_cfg.sliding_layers else "full_attention"
                for i in range(model_cfg.n_layers)
            ],
        }
        rope = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": rope_cfg.local_theta or rope_cfg.theta},
        }
    if fam in ("qwen2", "qwen3", "smollm3"):
        extra["use_sliding_window"] = False
    if fam == "smollm3":
        extra["no_rope_layers"] = [0 if i in model_cfg.nope_layers else 1 for i in range(model_cfg.n_layers)]
    return dict(
        model_type=MODEL_TYPES.get(fam, fam),
        architectures=[ARCHITECTURES[fam]],
        hidden_size=model_cfg.d_model,
        num_hidden_layers=model_cfg.n_layers,
        num_attention_heads=model_cfg.n_heads,
        num_key_value_heads=model_cfg.n_kv_heads,
        head_dim=model_cfg.resolved_head_dim,
        intermediate_size=model_cfg.ffn_dim,
        vocab_size=model_cfg.vocab_size,
        tie_word_embeddings=model_cfg.tie_embeddings,
        rms_norm_eps=model_cfg.norm_eps,
        attention_bias=False,
        max_position_embeddings=max_position,
        rope_parameters=rope,
        # BluModel's embedding has no padding row (every row trains): none on the way out either (a family's
        # config-class default, SmolLM3's 128004, would not even fit a small vocabulary)
        pad_token_id=None,
        **extra,
    )


def to_hf(model: BluModel, max_position: Optional[int] = None, rope_as_yarn: bool = False):
    """A transformers model with this BluModel's weights, of its model.family (ARCHITECTURES).

    max_position: max_position_embeddings to write; default the one `from_hf` recorded on the
    model, else factor * original_max_position for YaRN; a plain-RoPE model without either is
    refused (hf_config_dict: no silent default)."""
    import transformers

    d = hf_config_dict(model.cfg, model.rope_cfg, max_position or getattr(model, "max_position", None), rope_as_yarn)
    fam = d.pop("model_type")
    d.pop("architectures")
    # token ids belong to the tokenizer, not to these weights: a family's config-class defaults (SmolLM3's
    # pad 128004) would not even fit a small vocabulary
    d.update(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(fam, **d))
    sd = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (model.cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"to_hf: missing {missing}, unexpected {unexpected}")
    return hf.to(next(model.parameters()).dtype)
