"""Typed configuration: one pydantic model per section, YAML is data only.

Every section forbids unknown keys, and fields whose silent default once cost a run (the
seed's YaRN original length defaulting to 1024 cost 27 pp) have no default at all.
Cross-field invariants live in `check_invariants`, which returns *every* violation with
the field, the values and the fix, so `megablu config check` can list them all at once.
"""
from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from ..utils.liger import liger_chunk_tokens
from .eval_tasks import PRESETS, TaskSpec, default_max_new, min_words, needs_text_haystack
from .ruler_tasks import SUITES


class Section(BaseModel):
    # inf and nan are never a setting (lr: .inf trained to a NaN loss after the ranks started)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Seeds feed numpy's and torch's generators, whose seeds are unsigned (numpy's legacy API: 32 bits).
SEED_MAX = 2 ** 32 - 1
# More optimizer steps than any run megablu is for; a bigger value is a typo (1e30).
MAX_STEPS_MAX = 10 ** 9


# --------------------------------------------------------------------------- model
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


# --------------------------------------------------------------------------- rope
class YarnConfig(Section):
    """YaRN (Peng et al. 2023), computed exactly as transformers' `_compute_yarn_parameters`."""

    factor: float = Field(gt=1.0)
    original_max_position: int = Field(gt=0, description="the length the parent was ACTUALLY trained at; no "
                                       "default, on purpose (the seed's default of 1024 cost 27 pp)")
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


# --------------------------------------------------------------------------- tokenizer
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


# --------------------------------------------------------------------------- parallel
class ParallelConfig(Section):
    sp: int = Field(default=1, ge=1, description="Ulysses sequence-parallel degree")
    zero_stage: Literal[0, 1, 2, 3] = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_scatter: bool = Field(default=True, description="ZeRO-3 reduce-scatter; it changes how gradients "
                                 "are averaged, and megablu corrects the loss scale for either choice "
                                 "(parallel/sequence.py), so this is free to set")

    @model_validator(mode="after")
    def _offload(self):
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"parallel.offload_params needs parallel.zero_stage=3 (got {self.zero_stage})")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("parallel.offload_optimizer needs parallel.zero_stage >= 1 (got 0)")
        return self


# --------------------------------------------------------------------------- data
def _bucket_spec(v: str, where: str) -> str:
    parts = [p.strip() for p in v.split(",")]
    if v.strip() == "all":
        return "all"
    if not parts or any(not p or p == "all" or any(c in p for c in "/\\ ") for p in parts):
        raise ValueError(f"{where}={v!r}: expected 'all', a bucket name like 'b3', or a comma list 'b2,b3'")
    return ",".join(parts)


Mode = Literal["fit", "truncate", "pack"]


class MixSource(Section):
    """One source of `data.mix`: a dataset's bucket(s) read in one mode, drawn by its share of loss tokens."""

    name: str = Field(description="label of the source in logs, errors and mixture.json; unique in data.mix")
    path: str = Field(description="dataset dir made by `megablu data build/import/synth`")
    bucket: str = Field(default="all", description="length bucket (b0..b6, several as 'b2,b3') or 'all'")
    split: Literal["train", "val"] = "train"
    mode: Mode = Field(description="fit | truncate | pack, as data.mode (no default: it decides what a row holds)")
    # inf/nan reach mix_invariants, whose message says what a weight is
    weight: float = Field(allow_inf_nan=True, description="share of the run's loss tokens (labels that are not "
                          "padding) relative to the other sources' weights: 0.6/0.4 = 60%/40% of trained tokens; "
                          "0 leaves it unused")
    max_epochs: Optional[float] = Field(default=None, gt=0, allow_inf_nan=True, description="error if the run would "
                                        "cycle this source more; default data.max_epochs (.inf: no limit)")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        return _bucket_spec(v, "data.mix[].bucket")


class DataConfig(Section):
    window: int = Field(gt=0, description="training sequence length T in tokens")
    path: Optional[str] = Field(default=None, description="dataset dir made by `megablu data build/import`")
    bucket: str = Field(default="all", description="length bucket (b0..b6, several as 'b2,b3') or 'all'")
    split: Literal["train", "val"] = "train"
    mode: Mode = Field(default="pack", description="fit: only documents that fit, padded; truncate: longer "
                       "documents cut to the window; pack: documents concatenated with EOT and cut into windows")
    mix: Optional[list[MixSource]] = Field(
        default=None, description="several sources instead of path/bucket/split/mode: each sequence of the "
        "global order comes from one source, drawn (seeded) so that each source's share of loss tokens matches "
        "its weight (docs/DATA.md#mixtures)")
    max_epochs: float = Field(default=2.0, gt=0, allow_inf_nan=True,
                              description="error if the run would cycle the data more (.inf: no limit)")
    doc_mask: bool = Field(default=False, description="packed sequences: a token attends only within its own "
                           "document (the loader emits doc_ids; attention masks across document boundaries)")
    doc_positions: Literal["restart", "continue"] = Field(
        default="restart", description="with doc_mask: position ids restart at 0 for every document (ProLong) "
        "or continue across the packed sequence")
    prefetch: int = Field(default=4, ge=0, description="batches prepared ahead by a background thread; 0 = none")
    seed: int = Field(default=0, ge=0, le=SEED_MAX)
    verify: Literal["cache", "full"] = Field(
        default="cache", description="cache: a shard's sha256 is trusted while its size, mtime and inode are "
        "unchanged (a byte flipped in place keeps all three: `megablu data verify` finds it); full: the entry "
        "hashes every selected file before any rank starts")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str) -> str:
        return _bucket_spec(v, "data.bucket")


# --------------------------------------------------------------------------- train
class TrainConfig(Section):
    max_steps: int = Field(gt=0, le=MAX_STEPS_MAX)
    tokens_per_step: int = Field(gt=0, description="= micro_batch * window * grad_accum * dp, exactly")
    micro_batch: int = Field(default=1, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="Adam's (beta1, beta2), each in [0, 1)")
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping")
    seed: int = Field(default=1234, ge=0, le=SEED_MAX)
    dtype: Literal["bf16", "fp32"] = "bf16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(default=1, gt=0)
    probe_steps: int = Field(default=3, ge=0, description="first steps of the run measured as the "
                             "memory/speed probe (probe.json in the run dir; 0 = off)")
    stop_after: Optional[int] = Field(default=None, gt=0, description="time-sliced jobs (e.g. a SLURM limit): "
                                      "stop after this step, checkpoint, exit 0; the schedule is still the full "
                                      "max_steps one, and `--resume RUN` continues it exactly")
    stop_after_s: Optional[float] = Field(
        default=None, gt=0, description="wall-clock budget of this session in seconds: the run stops (checkpoint, "
        "exit 0) after the last step that, with a checkpoint, still ends within it; `--resume RUN` continues "
        "exactly. For time-sliced jobs (a SLURM limit, a device call)")
    profile_step: Optional[int] = Field(
        default=None, gt=0, description="run this step under torch.profiler: its wall time split by phase (data, "
        "forward, backward, optimizer step, ...) and the top kernels in profile/step_<N>.md of the run dir, a chrome "
        "trace beside it; every other step runs unprofiled")
    profile_trace_mib: float = Field(default=64.0, gt=0, description="with profile_step: the largest gzip'd trace "
                                     "kept (a 32k step of a 0.5B model is tens of MiB)")
    fused_grad_check: bool = Field(
        default=True, description="ZeRO-1/2 without optimizer offload: DeepSpeed's per-tensor gradient checks before "
        "each step (NaN/inf, L2 norm for the clip) as multi-tensor passes, not ~14 kernels per tensor "
        "(megablu/train/grad_check.py); the same answers, the norm in float32 instead of float64 per tensor. "
        "false: DeepSpeed's own")
    tracker: Literal["none", "wandb", "trackio"] = Field(
        default="none", description="an experiment tracker beside metrics.csv and TensorBoard, "
        "local-first: wandb in offline mode (files under the run dir; `wandb sync` uploads them later) or trackio "
        "(its local store). Optional packages: pip install 'megablu[wandb]' or 'megablu[trackio]'")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        bad = [f"beta{i + 1}={b}" for i, b in enumerate(v) if not 0 <= b < 1]
        if bad:
            raise ValueError(f"train.betas: {', '.join(bad)} outside [0, 1) (Adam divides by 1 - beta**t); "
                             f"the usual values are (0.9, 0.95)")
        return v


class ScheduleConfig(Section):
    kind: Literal["wsd", "cosine"]
    lr: float = Field(gt=0, description="peak learning rate")
    min_lr: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(ge=0)
    decay_start: Optional[int] = Field(default=None, ge=0, description="wsd: first step of the decay tail")
    decay_shape: Literal["cosine", "linear"] = "cosine"


class CheckpointConfig(Section):
    every_steps: int = Field(default=0, ge=0, description="0: only the final checkpoint")
    keep: int = Field(default=2, ge=1)
    keep_every: int = Field(
        default=0, ge=0, description="keep-N never deletes a checkpoint whose step is a positive multiple of "
        "keep_every; `keep` counts only the other checkpoints and keeps the newest `keep` of them (the run's "
        "newest checkpoint is always kept, counted in `keep` unless its step is such a multiple). keep=1, "
        "keep_every=3, every_steps=1, 10 steps: 3, 6, 9, 10 remain. A multiple of every_steps, which must be > 0. "
        "0 = off")
    save_final: bool = True


class MemoryConfig(Section):
    recompute: Literal["none", "selective", "full"] = "none"
    loss_chunk: int = Field(default=0, ge=0, description="tokens per vocab-loss chunk. chunked: 0 = unchunked "
                            "(fp32 [T, V] logits); liger: its chunk is the largest power of two of at most "
                            "loss_chunk tokens it can make, or all the rank's tokens (Liger's chunk_mem_const), "
                            "never below its own sizing "
                            "(~T*d/V tokens; 0 = that). Larger chunks hold more bf16 logits (2*V B per token of "
                            "the chunk) and read-modify-write the fp32 (V, d) weight-gradient sum fewer times: "
                            "blu-0.5b at 32k, 4096 vs Liger's 512, +1.9% tokens/s for +0.3 GB peak "
                            "(docs/BENCHMARKS.md, issue 17)")
    ops: Literal["auto", "torch", "cuda"] = "auto"
    mlp_tiles: int = Field(default=1, ge=1, description="sequence tiles of the SwiGLU MLP (one tile's "
                           "(tokens, ffn) intermediates alive at a time, fwd and bwd); 1 = untiled")
    offload_activations: bool = Field(default=False, description="each block's saved activations to pinned "
                                      "host memory in the forward, prefetched back one block ahead in the "
                                      "backward (CUDA side stream)")
    offload_keep: int = Field(default=1, ge=1, description="with offload_activations: the last offload_keep "
                              "blocks keep their saved activations on the GPU (the backward needs them first; "
                              "each kept block gives the prefetch of the offloaded ones a block's backward of "
                              "head start, for one block's saved set of GPU memory: megablu plan shows both)")
    offload_fraction: float = Field(default=1.0, gt=0, le=1, description="with offload_activations: the share of "
                                    "the blocks before the last offload_keep that offload, spread evenly (0.75: "
                                    "three of every four); the kept ones stay on the GPU and their compute hides "
                                    "the others' copies, where the host link is slower than a block's forward "
                                    "(blu-0.5b with FlashAttention-4 at 32k on an H200: docs/BENCHMARKS.md)")
    loss: Literal["auto", "chunked", "liger"] = Field(
        default="auto", description="the lm head's vocab loss: chunked = megablu's own (ops/cross_entropy.py; "
        "loss_chunk tokens at a time, fp32 logits, dW summed in fp32); liger = Liger-Kernel's fused linear "
        "cross-entropy (optional package liger-kernel, CUDA only; dW accumulated in fp32: accum_dtype=fp32), "
        "same sum over labelled tokens, ignore_index -100 and tied-embedding grads; auto (the default) = liger "
        "when the run is on CUDA and liger_kernel imports, else chunked (chosen once per run, logged with its "
        "reason, recorded in probe.json's setup as loss, the configured value as loss_config). The H200 "
        "validated liger in the model on 2026-12-04 (tests/model/test_kernel_choices.py and the liger tests "
        "of tests/ops/test_cross_entropy.py pass; a blu-0.5b 32k step, selective+offload, ran 35,222 vs "
        "33,732 tokens/s (1.04x), loss 46.8 vs 96.5 ms per step, peak 4.4 vs 8.0 GB; docs/BENCHMARKS.md); "
        "loss_chunk sizes the chunks of both")
    attention: Literal["auto", "sdpa", "fa4"] = Field(
        default="auto", description="the local causal attention kernel (also the one Ulysses wraps): sdpa = "
        "torch's scaled_dot_product_attention (cuDNN on the H200); fa4 = FlashAttention-4 (optional package "
        "flash-attn-4, CuTe DSL; SM90 GPUs, bf16/fp16, head_dim a multiple of 8 in 8..256; not with "
        "data.doc_mask, whose FlexAttention path is unchanged); auto (the default) = fa4 where it can take the "
        "tensors (CUDA SM90, bf16/fp16, its head sizes) and flash_attn.cute imports, else sdpa, chosen at the "
        "first call and logged with its reason (probe.json's setup: attention, attention_config); with "
        "data.doc_mask the masked path runs as before. The H200 validated fa4 in the model on 2026-12-04 "
        "(tests/ops/test_attention.py, tests/model/test_kernel_choices.py: 40 passed; a blu-0.5b 32k step "
        "1.12x faster, 1.17x with liger; docs/BENCHMARKS.md)")


class GateConfig(Section):
    parent: Optional[str] = Field(default=None, description="parent eval json to gate against")
    short_lengths: list[PositiveInt] = [1024, 4096]
    margin_pp: float = Field(default=5.0, ge=0)
    loss_margin_rel: float = Field(default=0.02, ge=0, description="short-document validation loss (eval.loss) "
                                   "may rise at most this fraction above the parent's: 0.02 = +2% nats/token")


class LossEvalConfig(Section):
    """Held-out language-modelling loss beside the retrieval tasks (megablu/eval/loss.py)."""

    data: Optional[str] = Field(default=None, description="dataset dir ('DIR' or 'DIR@bucket') whose val split is "
                                "scored: loss per token at each eval length, and on whole short documents")
    n: int = Field(default=8, gt=0, description="sequences of exactly L val tokens per eval length")
    short_docs: int = Field(default=200, ge=0, description="val documents of short_min..short_max tokens scored "
                            "whole (the gate's short-context loss); 0 = none")
    short_min: int = Field(default=1024, gt=0)
    short_max: int = Field(default=4096, gt=0)


# STRING's attention factor in the authors' code (HKUNLP/STRING string_for_llama.py replace_with_string and
# vllm_string's rotary_embedding.py: 0.1 * ln(2) + 1, YaRN's mscale at scale 2): it multiplies the rotary cos and
# sin, so q and k alike, and the attention logits by its square, at every distance, whenever STRING is on.
STRING_AUTHORS_FACTOR = 0.1 * math.log(2) + 1
STRING_AUTHORS_RATIO = 0.33   # shifted_ratio: ruler/test_ruler_llama.py's default and the README's
STRING_AUTHORS_LOCAL = 128    # local_value / small_local_value: their Llama default


class StringConfig(Section):
    """STRING at evaluation (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?",
    arXiv 2410.18745; megablu/model/string.py): each relative distance d >= S is attended as d - S + W
    (local), so the largest distances reuse well-trained positions; distances below S are unchanged, and the
    attention logits are multiplied by attention_factor**2 (the factor multiplies q and k). Inference only.

    Two variants (docs/EVAL.md):
      authors      (default) the authors' code (HKUNLP/STRING): S = int(shift_ratio * L) for an input built to
                   L tokens (an eval length, a held-out sequence's length), shift_ratio 0.33, local 128,
                   attention_factor 1 + 0.1 ln 2;
      fixed_shift  megablu's earlier variant: S = `shift` tokens at every length, attention_factor 1."""

    variant: Literal["authors", "fixed_shift"] = Field(default="authors", description="authors: S = shift_ratio x "
                                                       "the input's length, the authors' factor; fixed_shift: S = "
                                                       "shift tokens at every length, no factor")
    shift_ratio: Optional[float] = Field(default=None, gt=0, lt=1, description="authors: S = int(shift_ratio * L) "
                                         f"for an input of L tokens (default {STRING_AUTHORS_RATIO})")
    shift: Optional[int] = Field(default=None, strict=True, gt=0, description="fixed_shift: S in tokens, the same "
                                 "at every length (required there)")
    local: Optional[int] = Field(default=None, strict=True, ge=0, description="W: the position a distance of "
                                 f"exactly S becomes; W < S (authors default {STRING_AUTHORS_LOCAL}; fixed_shift: "
                                 "required)")
    attention_factor: Optional[float] = Field(default=None, gt=0, description="multiplies q and k (the logits by "
                                              "its square) whenever STRING is on (default: authors "
                                              f"{STRING_AUTHORS_FACTOR:.6f} = 1 + 0.1 ln 2, fixed_shift 1)")
    beyond: int = Field(default=0, strict=True, ge=0, description="STRING only for prompts (and held-out loss "
                        "sequences) longer than this many tokens; shorter ones are evaluated plain. 0: every "
                        "length")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data):
        """The variant's defaults written into the setting, so a resolved config and a result record the
        values that ran (a before-validator: assigning in an after-validator would validate again)."""
        if not isinstance(data, dict):
            return data
        d = dict(data)
        defaults = {"authors": {"shift_ratio": STRING_AUTHORS_RATIO, "local": STRING_AUTHORS_LOCAL,
                                "attention_factor": STRING_AUTHORS_FACTOR},
                    "fixed_shift": {"attention_factor": 1.0}}.get(d.get("variant", "authors"), {})
        for k, v in defaults.items():
            if d.get(k) is None:
                d[k] = v
        return d

    @model_validator(mode="after")
    def _fields(self):
        if self.variant == "authors":
            if self.shift is not None:
                raise ValueError(f"eval.string: shift={self.shift} (tokens at every length) is variant fixed_shift's "
                                 f"field; variant authors (the default) takes S = shift_ratio x the input's length: "
                                 f"set eval.string.variant=fixed_shift to keep S={self.shift}, or drop shift (and set "
                                 f"shift_ratio, default {STRING_AUTHORS_RATIO})")
            return self
        if self.shift_ratio is not None:
            raise ValueError(f"eval.string: shift_ratio={self.shift_ratio} with variant fixed_shift, whose S is "
                             f"`shift` tokens; set variant=authors for S = shift_ratio x the input's length, or drop "
                             f"shift_ratio")
        missing = [f for f in ("shift", "local") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"eval.string: variant fixed_shift needs {' and '.join(missing)} (no default: S and W in "
                             f"tokens, e.g. shift=10922, local=128), or use variant authors (S = "
                             f"{STRING_AUTHORS_RATIO} x the input's length, W = {STRING_AUTHORS_LOCAL})")
        if self.local >= self.shift:
            raise ValueError(f"eval.string: local={self.local} >= shift={self.shift}; STRING maps distances d >= "
                             f"shift to d - shift + local, which only moves them closer when local < shift: set "
                             f"local < shift (e.g. shift=10922, local=128)")
        return self

    def applies(self, length: int) -> bool:
        """Whether STRING runs on a prompt or a sequence of `length` tokens (eval.string.beyond)."""
        return length > self.beyond

    def shift_for(self, length: int) -> int:
        """S for an input built to `length` tokens: `shift` (fixed_shift) or int(shift_ratio * length) (authors,
        as their eval scripts compute shifted_offset from the test length)."""
        return self.shift if self.variant == "fixed_shift" else int(self.shift_ratio * length)


class EvalConfig(Section):
    lengths: list[PositiveInt] = Field(default=[], description="prompt lengths in tokens; each must hold every "
                                       "task's prompt without filler (checked against the tokenizer)")
    max_new: int = Field(default=24, gt=0, description="tokens generated for passkey/needle/multikey (the other "
                         "tasks have their own budget, megablu.config.eval_tasks.default_max_new)")
    pad: int = Field(default=256, gt=0)
    tasks: list[str] = Field(default=["passkey"], description="task names: the built-in ones "
                             "(megablu.config.eval_tasks.PRESETS) or names defined in task_defs")
    task_defs: dict[str, TaskSpec] = Field(default={}, description="tasks of your own, by name: a family and its "
                                           "options (megablu/config/eval_tasks.py)")
    n: int = Field(default=50, gt=0, description="prompts per (task, length)")
    seed: int = Field(default=0, ge=0)
    at_steps: list[int] = []
    final: bool = False
    haystack: Optional[str] = Field(default=None, description="dataset dir whose val text is the haystack")
    loss: LossEvalConfig = LossEvalConfig()
    gate: GateConfig = GateConfig()
    string: Optional[StringConfig] = Field(default=None, description="STRING position remapping at evaluation "
                                           "({variant: authors | fixed_shift, ...}; megablu/model/string.py); "
                                           "null = off")
    suite: Optional[str] = Field(default=None, description="a named set of tasks added to eval.tasks (alone when "
                                 "eval.tasks is not given): 'ruler' = RULER's 11 synthetic tasks as published, "
                                 "ruler_niah_single_1 ... ruler_fwe (megablu/config/ruler_tasks.py)")
    chat_template: Literal["auto", "on", "off"] = Field(default="auto", description="wrap the ruler_* prompts in the "
                                                        "tokenizer's chat template, as RULER does for a chat model: "
                                                        "auto = when the tokenizer has one; on = required (an error "
                                                        "without one); off = plain text")

    @model_validator(mode="before")
    @classmethod
    def _suite(cls, data):
        """eval.suite -> its tasks, after eval.tasks when given (in place of the default otherwise)."""
        if not isinstance(data, dict) or data.get("suite") is None:
            return data
        name = data["suite"]
        if name not in SUITES:
            raise ValueError(f"eval.suite={name!r} is not a suite; known: {sorted(SUITES)} ('ruler': RULER's 11 "
                             f"synthetic tasks as published); or list the tasks in eval.tasks")
        tasks = list(data.get("tasks") or [])
        return {**data, "tasks": tasks + [t for t in SUITES[name] if t not in tasks]}

    @model_validator(mode="after")
    def _tasks(self):
        clash = sorted(set(self.task_defs) & set(PRESETS))
        if clash:
            raise ValueError(f"eval.task_defs: {clash} are built-in task names (they mean the same prompts in every "
                             f"config); give your variant another name")
        unknown = [t for t in self.tasks if t not in PRESETS and t not in self.task_defs]
        if unknown:
            raise ValueError(f"eval.tasks: unknown task(s) {unknown}; known tasks: {sorted(PRESETS)}"
                             + (f" and task_defs {sorted(self.task_defs)}" if self.task_defs else "")
                             + "; or define one under eval.task_defs")
        if not self.tasks:
            raise ValueError("eval.tasks is empty: name at least one task")
        return self

    def spec(self, task: str):
        """The task's typed spec (a built-in preset or an eval.task_defs entry)."""
        return self.task_defs.get(task) or PRESETS[task]

    def task_max_new(self, task: str) -> int:
        return default_max_new(self.spec(task)) or self.max_new

    def task_prompt_len(self, task: str, length: int) -> int:
        """Prompt tokens of task@length: the length itself, except RULER's tasks, whose length counts the
        generation budget too (RULER's max_seq_length), so their prompts are length - tokens_to_generate."""
        return length - self.task_max_new(task) if self.spec(task).family == "ruler" else length


class HubConfig(Section):
    repo: Optional[str] = None
    private: bool = True


# --------------------------------------------------------------------------- root
class Config(Section):
    name: str
    model: ModelConfig
    rope: RopeConfig
    tokenizer: TokenizerConfig
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig
    train: TrainConfig
    schedule: ScheduleConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    memory: MemoryConfig = MemoryConfig()
    eval: EvalConfig = EvalConfig()
    hub: HubConfig = HubConfig()
    init_from: Optional[str] = Field(default=None, description="parent checkpoint (weights only)")
    runs_dir: str = "runs"

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError(f"init_from={v!r} is empty (an unset shell variable?); give the parent (a run dir, a "
                             f"step dir or an exported model dir), or null to train from scratch")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        why = run_name_problem(v)
        if why:
            raise ValueError(why)
        return v


# The longest `name` in bytes: a run dir is <name>-NNNN and a file name holds at most 255 bytes (NAME_MAX on
# ext4, xfs, btrfs, tmpfs); 7 go to the id suffix ('-' and up to 6 digits) and 6 to the '_probe' that
# `megablu probe` appends: 255 - 7 - 6 = 242.
RUN_NAME_MAX = 255 - len("-999999") - len("_probe")


def run_name_problem(name: str) -> Optional[str]:
    """Why `name` cannot name run dirs (runs/<name>-NNNN), or None. Shared with train/runs.py."""
    if not name or any(c in name for c in "/\\ \t\n\0") or name.startswith("."):
        return (f"name={name!r} must be non-empty, without slashes, spaces or NUL, and not start with '.' "
                f"(it names run dirs, and a dot-dir is hidden from `megablu ckpt list` and the run tools)")
    n = len(name.encode("utf-8", "surrogateescape"))
    if n > RUN_NAME_MAX:
        return (f"name={name[:40]}... is {n} bytes long; it names run dirs (<name>-NNNN, at most 255 bytes a name "
                f"on the usual filesystems, with room for the run number and `megablu probe`'s '_probe'), so it "
                f"may be at most {RUN_NAME_MAX} bytes: shorten it")
    return None


# --------------------------------------------------------------------------- invariants
def eval_padded_len(length: int, max_new: int, pad: int) -> int:
    """prompt + generated tokens, rounded up to a multiple of pad (the seed's PAD rule)."""
    return math.ceil((length + max_new) / pad) * pad


def eval_problems(e: EvalConfig, window: int) -> list[str]:
    """The eval section against the window, tokenizer-free (check_invariants calls it): the PAD
    rule per task (each task has its own max_new), each task's minimum content (a lower bound:
    megablu.eval.harness.preflight_problems checks it exactly in the run's tokenizer), the
    haystack a task needs, the gate's lengths, the loss section."""
    errs = []
    for task in dict.fromkeys(e.tasks):
        spec, mn = e.spec(task), e.task_max_new(task)
        for L in e.lengths:
            padded = eval_padded_len(e.task_prompt_len(task, L), mn, e.pad)
            if padded > window:
                fit = (window // e.pad) * e.pad - (mn if spec.family != "ruler" else 0)
                errs.append(f"eval.lengths: {task}@{L} + max_new {mn} pads to {padded} at pad {e.pad} > data.window "
                            f"{window}; the longest length that fits is {fit}")
        short = [L for L in e.lengths if L < min_words(spec)]
        if short:
            errs.append(f"eval.lengths: {short} cannot hold task {task}'s content (at least {min_words(spec)} tokens: "
                        f"instruction, needles/list, question); drop those lengths or the task")
        if needs_text_haystack(spec) and not e.haystack:
            errs.append(f"eval.haystack: task {task} needs a real-text haystack; set eval.haystack to a dataset dir "
                        f"(its val split is the haystack, e.g. data_cache/demo@b3) or drop the task")
    if (e.at_steps or e.final) and not e.lengths:
        errs.append("eval.lengths: empty but eval.at_steps/eval.final ask for evaluation")
    for L in e.gate.short_lengths:
        if e.gate.parent and L not in e.lengths:
            errs.append(f"eval.gate.short_lengths: {L} is not in eval.lengths {e.lengths}; the gate cannot check it")
    errs += string_problems(e)
    lo = e.loss
    if lo.short_min > lo.short_max:
        errs.append(f"eval.loss: short_min={lo.short_min} > short_max={lo.short_max}")
    if lo.data and lo.short_docs and lo.short_max > window:
        errs.append(f"eval.loss.short_max={lo.short_max} > data.window {window}: a short document must fit the "
                    f"window")
    return errs


def string_problems(e: EvalConfig) -> list[str]:
    """eval.string against the lengths it runs at (eval_problems and run_eval call it): at each eval length L
    where it applies (L > beyond), S must lie inside the prompt (fixed_shift: shift < L; else no distance of the
    prompt reaches S) and above W (authors: int(shift_ratio * L) > local, else a "shifted" distance would move
    farther). The held-out loss's short documents (authors: S follows each one's length) are checked at the
    shortest one STRING applies to."""
    st = e.string
    if st is None:
        return []
    errs = []
    for L in sorted(set(e.lengths)):
        if not st.applies(L):
            continue
        S = st.shift_for(L)
        if st.variant == "fixed_shift" and S >= L:
            errs.append(f"eval.string.shift={S} >= eval length {L} (variant fixed_shift, beyond={st.beyond}): no "
                        f"distance in a {L}-token prompt reaches S, so STRING would only touch the answer; set "
                        f"eval.string.beyond >= {L} to evaluate that length plain, a shift below {L}, or "
                        f"variant authors (S = shift_ratio x the length)")
        elif S <= st.local:
            errs.append(f"eval.string at length {L}: S = int(shift_ratio {st.shift_ratio:g} x {L}) = {S} <= local="
                        f"{st.local}; STRING moves distances d >= S to d - S + local, closer only when local < S: "
                        f"raise shift_ratio, lower local, or set eval.string.beyond >= {L}")
    lo = e.loss
    if st.variant == "authors" and lo.data and lo.short_docs:
        shortest = max(lo.short_min, st.beyond + 1)
        if shortest <= lo.short_max and st.shift_for(shortest) <= st.local:
            errs.append(f"eval.string with eval.loss short documents: at {shortest} tokens S = int(shift_ratio "
                        f"{st.shift_ratio:g} x {shortest}) = {st.shift_for(shortest)} <= local={st.local}; raise "
                        f"eval.loss.short_min or eval.string.beyond, or lower local")
    return errs


def checkpoint_problems(c: CheckpointConfig) -> list[str]:
    """keep_every against every_steps: a step it keeps must be a step that is saved (check_invariants calls it)."""
    k, e = c.keep_every, c.every_steps
    if not k:
        return []
    if not e:
        return [f"checkpoint.keep_every={k} with checkpoint.every_steps=0: only the final checkpoint is saved, so "
                f"there is no step {k}, {2 * k}, ... to keep; set checkpoint.every_steps={k} (or a divisor of "
                f"it), or checkpoint.keep_every=0"]
    if k % e:
        lo = k // e * e
        near = lo if lo and k - lo <= lo + e - k else lo + e   # a tie goes down: fewer checkpoints kept
        return [f"checkpoint.keep_every={k} is not a multiple of checkpoint.every_steps={e}: checkpoints are "
                f"saved at multiples of {e}, so step {k} is never saved (only multiples of {math.lcm(k, e)} would "
                f"be kept); set checkpoint.keep_every={near} (the nearest multiple of {e})"]
    return []


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    dp = world_size // cfg.parallel.sp
    per = cfg.train.micro_batch * cfg.data.window * dp
    return cfg.train.tokens_per_step // per


def mix_invariants(d: DataConfig) -> list[str]:
    """data.mix without reading files: spelling, weights, names, doc_mask (megablu.data.mix.mix_problems
    checks the datasets themselves)."""
    errs: list[str] = []
    if d.path is not None:
        errs.append(f"data.path={d.path!r} together with data.mix: a mixture names each dataset in "
                    f"data.mix[i].path; remove data.path (or data.mix, for one dataset)")
    for f, default in (("bucket", "all"), ("split", "train"), ("mode", "pack")):
        v = getattr(d, f)
        if v != default:
            errs.append(f"data.{f}={v!r} has no effect with data.mix (each source has its own {f}); remove it "
                        f"and set data.mix[i].{f}")
    if not d.mix:
        errs.append("data.mix is empty: list at least one source {name, path, bucket, mode, weight}, or remove "
                    "data.mix and use data.path")
        return errs
    ws = [s.weight for s in d.mix]
    bad = [f"data.mix[{i}] ({s.name}).weight={s.weight}" for i, s in enumerate(d.mix)
           if not (s.weight >= 0) or math.isinf(s.weight)]
    if bad:
        errs.append(f"{', '.join(bad)}: a weight is a share of loss tokens, a finite number >= 0; set it >= 0 "
                    f"(0 leaves the source unused)")
    elif not sum(ws) > 0:
        errs.append(f"data.mix weights {ws} sum to {sum(ws):g}: nothing to sample; give at least one source a "
                    f"positive weight")
    elif math.isinf(sum(ws)):   # shares w / sum would all read 0.0%
        errs.append(f"data.mix weights {ws} sum to inf (they overflow a float): a weight is relative to the others, "
                    f"so scale them down, e.g. 0.6 and 0.4")
    seen: dict[str, int] = {}
    for i, s in enumerate(d.mix):
        if not s.name or any(c in s.name for c in "/\\ \t\n"):
            errs.append(f"data.mix[{i}].name={s.name!r}: must be non-empty without slashes or spaces (it labels "
                        f"the source in mixture.json and the loader state)")
        if s.name in seen:
            errs.append(f"data.mix[{i}].name={s.name!r} is also data.mix[{seen[s.name]}].name: names must be "
                        f"unique (the loader state keeps each source's position by name); rename one")
        seen.setdefault(s.name, i)
    if d.doc_mask and not any(s.mode == "pack" and s.weight > 0 for s in d.mix):
        modes = ", ".join(f"{s.name}={s.mode}" for s in d.mix)
        errs.append(f"data.doc_mask=true but no source of data.mix with a positive weight is in mode pack "
                    f"({modes}): a fit/truncate sequence holds one document, so there is nothing to mask; set "
                    f"data.doc_mask=false or a source's mode to pack")
    return errs


def check_invariants(cfg: Config, world_size: Optional[int] = None,
                     device: Optional[str] = None) -> list[str]:
    """Every cross-field violation as 'field: values; fix'. Empty list = valid.

    world_size and device are what the launch will use; when given, topology-dependent
    invariants (sp vs world, tokens_per_step exactness, bf16 on CPU) are checked too.
    """
    errs: list[str] = []
    T = cfg.data.window

    # YaRN: factor * original_max_position == window, exactly.
    y = cfg.rope.yarn
    if y is not None:
        prod = y.factor * y.original_max_position
        if prod != T:
            errs.append(
                f"rope.yarn: factor*original_max_position = {y.factor}*{y.original_max_position} = {prod:g} "
                f"!= data.window {T}; set rope.yarn.factor={T / y.original_max_position:g} "
                f"(original_max_position must be the length the parent was actually trained at)")

    ps = cfg.train.profile_step
    if ps is not None and ps > cfg.train.max_steps:
        errs.append(f"train.profile_step: {ps} > train.max_steps {cfg.train.max_steps}: that step never runs; "
                    f"pick a step after the first few (warm-up), e.g. train.profile_step={min(5, cfg.train.max_steps)}")

    # Schedule.
    s, steps = cfg.schedule, cfg.train.max_steps
    if s.kind == "wsd":
        if s.decay_start is None:
            errs.append("schedule.decay_start: required for schedule.kind=wsd (first step of the decay tail)")
        else:
            if s.decay_start > steps - 2:
                errs.append(
                    f"schedule.decay_start={s.decay_start} > train.max_steps-2 = {steps - 2}: leaves no decay "
                    f"tail (need >= 2 steps); set schedule.decay_start <= {steps - 2}")
            if s.warmup_steps >= s.decay_start:
                errs.append(f"schedule.warmup_steps={s.warmup_steps} >= schedule.decay_start={s.decay_start}; "
                            f"warmup must end before the decay starts")
    else:
        if s.decay_start is not None:
            errs.append(f"schedule.decay_start={s.decay_start} has no effect with schedule.kind=cosine; remove it")
        if s.warmup_steps >= steps:
            errs.append(f"schedule.warmup_steps={s.warmup_steps} >= train.max_steps={steps}; nothing left to decay")
    if s.min_lr > s.lr:
        errs.append(f"schedule.min_lr={s.min_lr} > schedule.lr={s.lr}")

    # Checkpoints kept by keep_every exist only where a periodic save lands.
    errs += checkpoint_problems(cfg.checkpoint)

    # Eval: every task at every length fits the window (PAD rule) and holds its content.
    errs += eval_problems(cfg.eval, T)
    for st in cfg.eval.at_steps:
        if not 0 < st <= steps:
            errs.append(f"eval.at_steps: {st} is outside 1..train.max_steps={steps}")
    if cfg.eval.string is not None and cfg.parallel.sp > 1:
        errs.append(f"eval.string with parallel.sp={cfg.parallel.sp}: STRING attention runs on one rank (a "
                    f"sequence-parallel prefill shards the keys it remaps); run the eval with parallel.sp=1 "
                    f"(megablu eval --set parallel.sp=1), or set eval.string=null for this run's own evals")

    # Document masking: only packed sequences hold more than one document.
    d = cfg.data
    if d.doc_mask and d.mix is None and d.mode != "pack":
        errs.append(f"data.doc_mask=true with data.mode={d.mode}: a {d.mode} sequence holds one document, "
                    f"so there is nothing to mask; set data.mode=pack or data.doc_mask=false")
    if d.mix is not None:
        errs += mix_invariants(d)
    if not d.doc_mask and d.doc_positions != "restart":
        errs.append(f"data.doc_positions={d.doc_positions} has no effect without data.doc_mask=true; remove it")

    # Model vs tokenizer / data.
    m = cfg.model
    if m.n_kv_heads > m.n_heads:
        errs.append(f"model.n_kv_heads={m.n_kv_heads} > model.n_heads={m.n_heads}")

    # Topology.
    sp = cfg.parallel.sp
    if world_size is not None:
        if sp > world_size:
            errs.append(f"parallel.sp={sp} > world size {world_size}: launch at least {sp} processes "
                        f"(deepspeed --num_gpus {sp}) or lower parallel.sp")
        elif world_size % sp:
            errs.append(f"parallel.sp={sp} does not divide world size {world_size}; use an sp in "
                        f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")
        else:
            dp = world_size // sp
            per = cfg.train.micro_batch * T * dp
            if cfg.train.tokens_per_step % per:
                lo = max(per, (cfg.train.tokens_per_step // per) * per)
                errs.append(
                    f"train.tokens_per_step={cfg.train.tokens_per_step} is not micro_batch*window*grad_accum*dp "
                    f"= {cfg.train.micro_batch}*{T}*k*{dp} for an integer k; nearest exact values: {lo} "
                    f"(k={lo // per}) or {lo + per} (k={lo // per + 1})")
    if device == "cpu" and cfg.train.dtype == "bf16":
        errs.append("train.dtype=bf16 on a CPU run: set train.dtype=fp32 (bf16 training is for GPUs)")
    if device == "cpu" and cfg.parallel.offload_optimizer:
        errs.append("parallel.offload_optimizer on a CPU run has no effect; set it false")

    # Memory switches (megablu/memory/: tiled.py, offload.py).
    mem = cfg.memory
    rows = cfg.train.micro_batch * math.ceil(T / sp)       # tokens a rank's MLP tiles split
    if mem.mlp_tiles > rows:
        errs.append(f"memory.mlp_tiles={mem.mlp_tiles} > tokens per rank {rows} (train.micro_batch*ceil(data.window"
                    f"/parallel.sp) = {cfg.train.micro_batch}*ceil({T}/{sp})): a tile needs at least one token; "
                    f"set memory.mlp_tiles <= {rows}")
    if mem.offload_activations and mem.recompute == "none" and mem.mlp_tiles == 1:
        # the same GPU saving as selective (about two layers' saved sets stay on the GPU),
        # for ~3x the host link traffic and host memory: the (T, ffn) intermediates
        errs.append(f"memory.offload_activations with memory.recompute=none and memory.mlp_tiles=1 copies every "
                    f"layer's (T, ffn) MLP intermediates ({3 * 2 * m.ffn_dim} B/token/layer in bf16) to host and "
                    f"back each step; set memory.recompute=selective (or full), or memory.mlp_tiles >= 2")
    # how many blocks offload: floor(fraction * (n_layers - offload_keep)), memory/constants.py offloaded_count
    if mem.offload_activations and mem.offload_keep < cfg.model.n_layers \
            and int((cfg.model.n_layers - mem.offload_keep) * mem.offload_fraction + 1e-9) == 0:
        errs.append(f"memory.offload_fraction={mem.offload_fraction:g} of the {cfg.model.n_layers - mem.offload_keep} "
                    f"blocks before the last memory.offload_keep={mem.offload_keep} is none of them: nothing is "
                    f"offloaded; set memory.offload_fraction>={1 / (cfg.model.n_layers - mem.offload_keep):.3g}, or "
                    f"memory.offload_activations=false")
    if mem.offload_activations and mem.offload_keep >= cfg.model.n_layers:
        errs.append(f"memory.offload_keep={mem.offload_keep} with model.n_layers={cfg.model.n_layers}: every block "
                    f"would keep its activations on the GPU, so nothing is offloaded; set memory.offload_keep<="
                    f"{cfg.model.n_layers - 1}, or memory.offload_activations=false")
    if device == "cpu" and mem.offload_activations:
        errs.append("memory.offload_activations on a CPU run has no effect (activations already live in host "
                    "memory); set it false")
    errs += kernel_invariants(cfg, device)
    return errs


# FlashAttention-4's SM90 head sizes (flash_attn/cute/interface.py `_validate_head_dims`, 4.0.0b40: 8..256,
# a multiple of 16 bytes / element size = 8 for bf16 and fp16)
FA4_HEAD_DIM = (8, 256, 8)


def kernel_invariants(cfg: Config, device: Optional[str] = None) -> list[str]:
    """memory.loss / memory.attention against the config and the device, without importing anything
    (train/preflight.py kernel_problems checks that the chosen library imports, where the run will start).
    memory.loss=auto and memory.attention=auto are never errors: they fall back to chunked and sdpa
    (ops/cross_entropy.py auto_loss, ops/attention.py auto_kernel)."""
    mem, errs = cfg.memory, []
    if device == "cpu":
        if mem.loss == "liger":
            errs.append("memory.loss=liger on a CPU run: Liger's fused linear cross-entropy is a Triton GPU kernel; "
                        "set memory.loss=chunked")
        if mem.attention == "fa4":
            errs.append("memory.attention=fa4 on a CPU run: FlashAttention-4 runs on SM90 GPUs only; set "
                        "memory.attention=sdpa")
    if mem.attention != "fa4":
        return errs
    lo, hi, mult = FA4_HEAD_DIM
    hd = cfg.model.resolved_head_dim
    if not (lo <= hd <= hi and hd % mult == 0):
        errs.append(f"memory.attention=fa4 with head_dim {hd}: FlashAttention-4 takes head_dim {lo}..{hi}, a "
                    f"multiple of {mult}, on SM90; set memory.attention=sdpa")
    if cfg.data.doc_mask:
        errs.append("memory.attention=fa4 with data.doc_mask=true: FlashAttention-4 runs plain causal attention "
                    "here, document masking runs on FlexAttention; set memory.attention=sdpa (or data.doc_mask="
                    "false)")
    if cfg.train.dtype != "bf16":
        errs.append(f"memory.attention=fa4 with train.dtype={cfg.train.dtype}: FlashAttention-4 takes bf16/fp16 "
                    f"inputs only; set train.dtype=bf16 or memory.attention=sdpa")
    return errs


def config_warnings(cfg: Config) -> list[str]:
    """Options that have no effect in this setup: legal, but worth a line on stderr."""
    w = []
    if cfg.checkpoint.every_steps > cfg.train.max_steps:
        w.append(f"checkpoint.every_steps={cfg.checkpoint.every_steps} > train.max_steps={cfg.train.max_steps}: "
                 f"only the final checkpoint will be written")
    if cfg.checkpoint.keep_every > cfg.train.max_steps:
        w.append(f"checkpoint.keep_every={cfg.checkpoint.keep_every} > train.max_steps={cfg.train.max_steps}: "
                 f"no step of this run is kept by it")
    for field in ("offload_keep", "offload_fraction"):   # tune the offload: nothing to tune without it
        value = getattr(cfg.memory, field)
        if value != MemoryConfig.model_fields[field].default and not cfg.memory.offload_activations:
            w.append(f"memory.{field}={value:g} without memory.offload_activations has no effect (nothing is "
                     f"offloaded)")
    if cfg.parallel.zero_stage != 3 and not cfg.parallel.reduce_scatter:
        w.append("parallel.reduce_scatter=false only affects ZeRO stage 3")
    if cfg.eval.gate.parent is None and not (cfg.eval.at_steps or cfg.eval.final) and cfg.eval.lengths:
        w.append("eval.lengths set but neither eval.at_steps nor eval.final: no evaluation will run in training")
    if cfg.rope.yarn is not None and cfg.init_from and not (cfg.eval.final and cfg.eval.gate.parent):
        w.append("a YaRN extension of init_from without eval.final and eval.gate.parent: nothing will tell whether "
                 "it got worse at short context; set eval.final=true and eval.gate.parent=<the parent's eval json>")
    y = cfg.rope.yarn
    if y is not None and y.apply == "beyond_original" and cfg.data.mode == "pack" and not cfg.data.doc_mask:
        w.append(f"rope.yarn.apply=beyond_original with data.mode=pack and data.doc_mask=false: every training row "
                 f"is a full window of {cfg.data.window} > original_max_position {y.original_max_position} tokens, "
                 f"so training always uses YaRN (only evaluation of short prompts uses the original RoPE); set "
                 f"data.doc_mask=true to train short documents with the original RoPE")
    for i, src in enumerate(cfg.data.mix or []):
        if src.weight == 0:
            w.append(f"data.mix[{i}] ({src.name}) has weight 0: it is checked but never read")
        elif cfg.data.doc_mask and src.mode != "pack":
            w.append(f"data.doc_mask=true: source data.mix[{i}] ({src.name}) is mode {src.mode}, one document per "
                     f"sequence, so its rows have nothing to mask (doc_ids 0); only the packed sources are masked")
    m, sp = cfg.model, cfg.parallel.sp
    if sp > m.n_heads:
        # parallel/ulysses.py pads the query heads with zero heads up to a multiple of sp
        padded = math.ceil(m.n_heads / sp) * sp
        w.append(f"parallel.sp={sp} > model.n_heads={m.n_heads}: Ulysses pads the heads with {padded - m.n_heads} "
                 f"zero heads, so {padded - m.n_heads} of the {sp} ranks of each sp group attend over zero heads "
                 f"only: attention does {padded / m.n_heads:g}x the work of the real heads, the attention time is "
                 f"that of sp={m.n_heads}, and every layer's all-to-all spans {sp} ranks; parallel.sp<={m.n_heads} "
                 f"is as fast in attention and only the rest of the model's activations shard less")
    if cfg.memory.loss == "liger" and cfg.memory.loss_chunk > 0:
        m, tokens = cfg.model, cfg.train.micro_batch * math.ceil(cfg.data.window / cfg.parallel.sp)
        own = liger_chunk_tokens(tokens, m.d_model, m.vocab_size)
        if cfg.memory.loss_chunk < own:
            w.append(f"memory.loss_chunk={cfg.memory.loss_chunk} with memory.loss=liger has no effect here: Liger's "
                     f"own chunk at {tokens} tokens per rank is {own} tokens, and loss_chunk only widens it; set "
                     f"memory.loss_chunk=0 or a value >= {own}")
    if cfg.memory.mlp_tiles > 1 and cfg.memory.recompute == "none":
        w.append("memory.mlp_tiles>1 with memory.recompute=none: the tiles recompute the MLP anyway; "
                 "recompute=selective with the same tiles saves h instead of the norm state and its output, "
                 "for one more (cheap) norm")
    return w
