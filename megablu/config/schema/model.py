"""The model's sections: its shape (model), its positions (rope, with YaRN) and its tokenizer."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import Section

# The transformers families BluModel imports and exports (model/hf.py): the switches each one fixes
# (any switch not named is off: qk_norm none, norm_layout pre, qkv_bias / norm_offset / embed_scale false,
# activation silu) and the ones it leaves to its config (FAMILY_FREE). docs/MODELS.md has the table.
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": "head"},
    "olmo2": {"qk_norm": "proj", "norm_layout": "post"},
    "smollm3": {},
    "gemma3": {
        "qk_norm": "head",
        "norm_layout": "sandwich",
        "norm_offset": True,
        "embed_scale": True,
        "activation": "gelu_tanh",
    },
}
FAMILY_FREE: dict[str, set] = {"smollm3": {"nope_layers"}, "gemma3": {"sliding"}, "mistral": {"sliding"}}
_SWITCH_OFF = {
    "qk_norm": "none",
    "norm_layout": "pre",
    "qkv_bias": False,
    "norm_offset": False,
    "embed_scale": False,
    "activation": "silu",
}


# the transformers families an export can write (model.family)
Family = Literal["llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3", "gemma3"]


class ModelConfig(Section):
    """A Llama-style decoder with the switches other families need. Defaults are none: an arm states
    its shape; every switch is off by default (a Llama/Qwen2 block)."""

    n_layers: int = Field(gt=0)
    d_model: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: Optional[int] = Field(default=None, gt=0, description="default d_model // n_heads")
    ffn_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_embeddings: bool = False
    norm_eps: float = Field(default=1e-5, gt=0)
    qkv_bias: bool = Field(default=False, description="q/k/v projection biases (Qwen2 has them, Llama does not)")
    init_std: float = Field(default=0.02, gt=0)
    qk_norm: Literal["none", "head", "proj"] = Field(
        default="none",
        description="RMSNorm of q and k before RoPE. head: over each head's head_dim, one weight "
        "shared by the heads (Qwen3, Gemma 3); proj: over the whole q (n_heads*head_dim) and k "
        "(n_kv_heads*head_dim) projection, before the split into heads (OLMo 2)",
    )
    norm_layout: Literal["pre", "post", "sandwich"] = Field(
        default="pre",
        description="pre: h = x + attn(norm(x)), then the MLP alike (Llama). post: h = x + "
        "norm(attn(x)), then x + norm(mlp(h)), no norm on a block's input (OLMo 2). sandwich: both, "
        "h = x + norm(attn(norm(x))), then h + norm(mlp(norm(h))) (Gemma 3)",
    )
    nope_layers: list[int] = Field(
        default_factory=list,
        description="layer indices (from 0) whose attention "
        "uses no positional encoding (SmolLM3's no_rope_layers zeros); the rest use RoPE",
    )
    norm_offset: bool = Field(
        default=False, description="every RMSNorm scales by (1 + weight), its weight stored as an offset from 1 (Gemma)"
    )
    embed_scale: bool = Field(
        default=False, description="token embeddings * sqrt(d_model), the factor in the embedding's dtype (Gemma)"
    )
    activation: Literal["silu", "gelu_tanh"] = Field(
        default="silu", description="the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)"
    )
    sliding_window: Optional[int] = Field(
        default=None,
        gt=0,
        description="the window of the layers in sliding_layers: a query at i attends to keys j with i - W < j <= i",
    )
    sliding_layers: list[int] = Field(
        default_factory=list,
        description="layer indices (from 0) that attend "
        "within sliding_window (Gemma 3's sliding_attention); the rest attend to "
        "everything before them",
    )
    family: Optional[Family] = Field(
        default=None,
        description="the transformers family an export writes (model/hf.py); it fixes the "
        "switches docs/MODELS.md lists. Default: qwen2 with qkv_bias, else llama",
    )

    @model_validator(mode="after")
    def _family(self):
        fam = self.resolved_family
        fixed, free = {**_SWITCH_OFF, **FAMILIES[fam]}, FAMILY_FREE.get(fam, set())
        errs = [
            f"model.{k}={getattr(self, k)!r} (family {fam} has {v!r})"
            for k, v in fixed.items()
            if getattr(self, k) != v
        ]
        if self.nope_layers and "nope_layers" not in free:
            errs.append(f"model.nope_layers={self.nope_layers} (family {fam} has RoPE in every layer)")
        if self.sliding_layers and "sliding" not in free:
            errs.append(
                f"model.sliding_layers={self.sliding_layers} (family {fam} attends to the whole sequence "
                f"in every layer)"
            )
        if errs:
            fams = "; ".join(
                f"{f}: "
                + (", ".join(f"{k}={v}" for k, v in FAMILIES[f].items()) or "all off")
                + "".join(f", {x} allowed" for x in sorted(FAMILY_FREE.get(f, ())))
                for f in FAMILIES
            )
            raise ValueError(
                f"{'; '.join(errs)}: a model is exported as one transformers family, which computes "
                f"with fixed switches; set model.family to the family these switches describe "
                f"({fams}) or the switches to model.family's"
            )
        for name in ("nope_layers", "sliding_layers"):
            idx = getattr(self, name)
            if any(not 0 <= i < self.n_layers for i in idx) or len(set(idx)) != len(idx):
                raise ValueError(f"model.{name}={idx}: each a distinct layer index in [0, n_layers={self.n_layers})")
        if bool(self.sliding_layers) != (self.sliding_window is not None):
            raise ValueError(
                f"model.sliding_window={self.sliding_window} with model.sliding_layers="
                f"{self.sliding_layers}: set both (a window and the layers that use it) or neither"
            )
        return self

    @property
    def resolved_family(self) -> str:
        return self.family or ("qwen2" if self.qkv_bias else "llama")

    @model_validator(mode="after")
    def _heads(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}; "
                f"GQA needs each kv head shared by a whole number of query heads"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                f"set model.head_dim explicitly"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"model head_dim={self.resolved_head_dim} must be even for RoPE")
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def n_params(self) -> int:
        d, hd = self.d_model, self.resolved_head_dim
        attn = d * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * d
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * d * self.ffn_dim
        block = attn + mlp + d * {"pre": 2, "post": 2, "sandwich": 4}[self.norm_layout]
        if self.qk_norm == "head":
            block += 2 * hd
        elif self.qk_norm == "proj":
            block += hd * (self.n_heads + self.n_kv_heads)
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + emb + d


class YarnConfig(Section):
    """YaRN (Peng et al. 2023), computed exactly as transformers' `_compute_yarn_parameters`."""

    factor: float = Field(gt=1.0)
    original_max_position: int = Field(
        gt=0,
        description="the length the parent was ACTUALLY trained at; no "
        "default, on purpose (a wrong default silently costs the extension tens of "
        "points)",
    )
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = Field(default=None, gt=0, description="default 0.1 ln(factor) + 1")

    @model_validator(mode="after")
    def _betas(self):
        # the ramp runs from the dim where beta_fast rotations fit the original length to the one of
        # beta_slow; beta_fast <= beta_slow leaves it empty or inverted: no dimension is interpolated
        if not (self.beta_fast > self.beta_slow > 0):
            raise ValueError(
                f"beta_fast={self.beta_fast:g} <= beta_slow={self.beta_slow:g} (or a beta "
                f"<= 0): YaRN's ramp runs from beta_fast rotations (extrapolated) down to beta_slow "
                f"(interpolated), so it needs beta_fast > beta_slow > 0; the paper's values are "
                f"beta_fast=32, beta_slow=1"
            )
        return self

    apply: Literal["always", "beyond_original"] = Field(
        default="always",
        description="always: every sequence uses YaRN (static YaRN, as transformers). "
        "beyond_original: a sequence of at most original_max_position tokens uses the original RoPE (no YaRN "
        "frequencies, no attention factor), a longer one YaRN (LongRoPE2 arXiv 2502.20082; Qwen's warning that "
        "static YaRN hurts short inputs). A sequence is a document under data.doc_mask, else a row by its real "
        "length (megablu/model/packing.py); in generation the prompt + max_new, chosen once at prefill "
        "(KVCache.rope_len). Training data with no sequence longer than original_max_position is refused (YaRN "
        "would never train; megablu/data/mix.py beyond_original_problems). No transformers rope type reproduces "
        "it: `megablu ckpt export` refuses it unless --rope-as-yarn (model/hf.py says why)",
    )


class RopeScalingConfig(Section):
    """The frequency scaling a parent was trained with, transformers' rope_type linear or llama3
    (`modeling_rope_utils._compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`).
    It is part of the parent's frequencies: YaRN (rope.yarn) is applied on top of it, and its
    original_max_position is the parent's own max_position_embeddings, not this one's."""

    type: Literal["linear", "llama3"]
    factor: float = Field(gt=0, description="linear: every frequency / factor. llama3: low frequencies / factor")
    low_freq_factor: Optional[float] = Field(default=None, gt=0, description="llama3 only (Llama 3.x: 1)")
    high_freq_factor: Optional[float] = Field(default=None, gt=0, description="llama3 only (Llama 3.x: 4)")
    original_max_position: Optional[int] = Field(
        default=None, gt=0, description="llama3 only: the length its bands are measured against (Llama 3.x: 8192)"
    )

    @model_validator(mode="after")
    def _fields(self):
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_position")
        if self.type == "llama3":
            missing = [f for f in llama3 if getattr(self, f) is None]
            if missing:
                raise ValueError(
                    f"rope.scaling.type=llama3 needs rope.scaling.{', '.join(missing)} (Llama 3.x: "
                    f"low_freq_factor=1, high_freq_factor=4, original_max_position=8192)"
                )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"rope.scaling.high_freq_factor={self.high_freq_factor:g} <= low_freq_factor="
                    f"{self.low_freq_factor:g}: llama3's smoothing band divides by their difference; "
                    f"Llama 3.x has high 4, low 1"
                )
        else:
            extra = [f for f in llama3 if getattr(self, f) is not None]
            if extra:
                raise ValueError(
                    f"rope.scaling.{', '.join(extra)} has no effect with rope.scaling.type=linear "
                    f"(every frequency / factor); remove it"
                )
        return self


class RopeConfig(Section):
    theta: float = Field(gt=0)
    local_theta: Optional[float] = Field(
        default=None,
        gt=0,
        description="the RoPE base of model.sliding_layers "
        "(Gemma 3's rope_local_base_freq): plain RoPE, never scaled nor YaRN "
        "(a sliding layer sees distances < sliding_window only). Unset: the "
        "sliding layers share the global rope",
    )
    scaling: Optional[RopeScalingConfig] = Field(
        default=None, description="the parent's linear or llama3 frequency scaling, applied before rope.yarn"
    )
    yarn: Optional[YarnConfig] = None
    allow_theta_change: bool = Field(
        default=False,
        description="init_from a parent trained with another "
        "rope.theta on purpose (an ABF-style base raise); otherwise a config error",
    )
    allow_yarn_from_scratch: bool = Field(
        default=False,
        description="rope.yarn without init_from on purpose: "
        "YaRN frequencies trained from random weights (tests, ablations); "
        "otherwise a config error, since YaRN extends a parent trained at "
        "original_max_position and an empty init_from is usually a typo",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_lives_in_yarn(cls, data):
        # `apply` switches between YaRN and the original RoPE, so it only exists with YaRN
        if isinstance(data, dict) and "apply" in data:
            fix = (
                "move it to rope.yarn.apply"
                if data.get("yarn")
                else "remove it: without rope.yarn every sequence already uses the original RoPE"
            )
            raise ValueError(
                f"rope.apply={data['apply']!r}: no such field; the switch between YaRN and the original "
                f"RoPE is rope.yarn.apply (always | beyond_original); {fix}"
            )
        return data


class TokenizerConfig(Section):
    """Which tokenizer; megablu.data.tokenizer builds it and records its identity."""

    kind: Literal["tiktoken", "tiktoken_file", "sentencepiece", "hf", "byte"]
    name: Optional[str] = Field(default=None, description="tiktoken encoding name, e.g. cl100k_base")
    path: Optional[str] = Field(default=None, description="rank file / .model / tokenizer.json")
    eot: Optional[str] = Field(default=None, description="end-of-text token text, when not the kind's usual one")

    @model_validator(mode="after")
    def _need(self):
        if self.kind == "tiktoken" and not self.name:
            raise ValueError("tokenizer.kind=tiktoken needs tokenizer.name (cl100k_base or o200k_base)")
        if self.kind in ("tiktoken_file", "sentencepiece", "hf") and not self.path:
            raise ValueError(f"tokenizer.kind={self.kind} needs tokenizer.path")
        if self.kind in ("byte", "tiktoken") and self.path:
            raise ValueError(f"tokenizer.path={self.path!r} has no effect with tokenizer.kind={self.kind}; remove it")
        if self.kind != "tiktoken" and self.name:
            raise ValueError(f"tokenizer.name={self.name!r} has no effect with tokenizer.kind={self.kind}; remove it")
        if self.kind in ("byte", "tiktoken") and self.eot:
            raise ValueError(f"tokenizer.eot has no effect with tokenizer.kind={self.kind} (EOT is fixed); remove it")
        return self
