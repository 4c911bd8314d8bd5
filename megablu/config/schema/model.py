"""The model's sections: its shape (model), its positions (rope, with YaRN) and its tokenizer."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import Section


class ModelConfig(Section):
    """A Llama/Qwen2-style decoder. Defaults are none: an arm states its shape."""

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

    @model_validator(mode="after")
    def _heads(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads}; "
                f"GQA needs each kv head shared by a whole number of query heads")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                             f"set model.head_dim explicitly")
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
        block = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + emb + d


class YarnConfig(Section):
    """YaRN (Peng et al. 2023), computed exactly as transformers' `_compute_yarn_parameters`."""

    factor: float = Field(gt=1.0)
    original_max_position: int = Field(gt=0, description="the length the parent was ACTUALLY trained at; no "
                                       "default, on purpose (a wrong default silently costs the extension tens of "
                                       "points)")
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = Field(default=None, gt=0, description="default 0.1 ln(factor) + 1")

    @model_validator(mode="after")
    def _betas(self):
        # the ramp runs from the dim where beta_fast rotations fit the original length to the one of
        # beta_slow; beta_fast <= beta_slow leaves it empty or inverted: no dimension is interpolated
        if not (self.beta_fast > self.beta_slow > 0):
            raise ValueError(f"beta_fast={self.beta_fast:g} <= beta_slow={self.beta_slow:g} (or a beta "
                             f"<= 0): YaRN's ramp runs from beta_fast rotations (extrapolated) down to beta_slow "
                             f"(interpolated), so it needs beta_fast > beta_slow > 0; the paper's values are "
                             f"beta_fast=32, beta_slow=1")
        return self
    apply: Literal["always", "beyond_original"] = Field(
        default="always", description="always: every sequence uses YaRN (static YaRN, as transformers). "
        "beyond_original: a sequence of at most original_max_position tokens uses the original RoPE (no YaRN "
        "frequencies, no attention factor), a longer one YaRN (LongRoPE2 arXiv 2502.20082; Qwen's warning that "
        "static YaRN hurts short inputs). A sequence is a document under data.doc_mask, else a row by its real "
        "length (megablu/model/packing.py); in generation the prompt + max_new, chosen once at prefill "
        "(KVCache.rope_len). Training data with no sequence longer than original_max_position is refused (YaRN "
        "would never train; megablu/data/mix.py beyond_original_problems). No transformers rope type reproduces "
        "it: `megablu ckpt export` refuses it unless --rope-as-yarn (model/hf.py says why)")


class RopeConfig(Section):
    theta: float = Field(gt=0)
    yarn: Optional[YarnConfig] = None
    allow_theta_change: bool = Field(default=False, description="init_from a parent trained with another "
                                     "rope.theta on purpose (an ABF-style base raise); otherwise a config error")
    allow_yarn_from_scratch: bool = Field(default=False, description="rope.yarn without init_from on purpose: "
                                          "YaRN frequencies trained from random weights (tests, ablations); "
                                          "otherwise a config error, since YaRN extends a parent trained at "
                                          "original_max_position and an empty init_from is usually a typo")

    @model_validator(mode="before")
    @classmethod
    def _apply_lives_in_yarn(cls, data):
        # `apply` switches between YaRN and the original RoPE, so it only exists with YaRN
        if isinstance(data, dict) and "apply" in data:
            fix = ("move it to rope.yarn.apply" if data.get("yarn") else
                   "remove it: without rope.yarn every sequence already uses the original RoPE")
            raise ValueError(f"rope.apply={data['apply']!r}: no such field; the switch between YaRN and the original "
                             f"RoPE is rope.yarn.apply (always | beyond_original); {fix}")
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
