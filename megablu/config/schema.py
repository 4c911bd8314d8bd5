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
    qkv_bias: bool = False  # Qwen2 has q/k/v biases, Llama does not
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
    # No default, on purpose: the length the parent was ACTUALLY trained at.
    original_max_position: int = Field(gt=0)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = Field(default=None, gt=0, description="default 0.1 ln(factor) + 1")


class RopeConfig(Section):
    theta: float = Field(gt=0)
    yarn: Optional[YarnConfig] = None
    allow_theta_change: bool = Field(default=False, description="init_from a parent trained with another "
                                     "rope.theta on purpose (an ABF-style base raise); otherwise a config error")


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
    # ZeRO-3 reduce-scatter changes how gradients are averaged; megablu corrects the loss
    # scale for either choice (see parallel/sequence.py), so this is free to set.
    reduce_scatter: bool = True

    @model_validator(mode="after")
    def _offload(self):
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"parallel.offload_params needs parallel.zero_stage=3 (got {self.zero_stage})")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("parallel.offload_optimizer needs parallel.zero_stage >= 1 (got 0)")
        return self


# --------------------------------------------------------------------------- data
class DataConfig(Section):
    window: int = Field(gt=0, description="training sequence length T in tokens")
    path: Optional[str] = Field(default=None, description="dataset dir made by `megablu data build/import`")
    bucket: str = Field(default="all", description="length bucket (b0..b6, several as 'b2,b3') or 'all'")
    split: Literal["train", "val"] = "train"
    # fit: only documents that fit, padded; truncate: longer documents cut to the window;
    # pack: documents concatenated with EOT and cut into windows.
    mode: Literal["fit", "truncate", "pack"] = "pack"
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
        parts = [p.strip() for p in v.split(",")]
        if v.strip() == "all":
            return "all"
        if not parts or any(not p or p == "all" or any(c in p for c in "/\\ ") for p in parts):
            raise ValueError(f"data.bucket={v!r}: expected 'all', a bucket name like 'b3', or a comma list 'b2,b3'")
        return ",".join(parts)


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
    # Time-sliced jobs (e.g. a SLURM limit): stop after this step, checkpoint, exit 0; the
    # schedule is still the full max_steps one, and `--resume RUN` continues it exactly.
    stop_after: Optional[int] = Field(default=None, gt=0)

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
    save_final: bool = True


class MemoryConfig(Section):
    recompute: Literal["none", "selective", "full"] = "none"
    loss_chunk: int = Field(default=0, ge=0, description="tokens per vocab-loss chunk; 0 = unchunked")
    ops: Literal["auto", "torch", "cuda"] = "auto"
    mlp_tiles: int = Field(default=1, ge=1, description="sequence tiles of the SwiGLU MLP (one tile's "
                           "(tokens, ffn) intermediates alive at a time, fwd and bwd); 1 = untiled")
    offload_activations: bool = Field(default=False, description="each block's saved activations to pinned "
                                      "host memory in the forward, prefetched back one block ahead in the "
                                      "backward (CUDA side stream)")


class GateConfig(Section):
    parent: Optional[str] = Field(default=None, description="parent eval json to gate against")
    short_lengths: list[PositiveInt] = [1024, 4096]
    margin_pp: float = Field(default=5.0, ge=0)


class EvalConfig(Section):
    lengths: list[PositiveInt] = Field(default=[], description="prompt lengths in tokens; each must hold every "
                                       "task's prompt without filler (checked against the tokenizer)")
    max_new: int = Field(default=24, gt=0)
    pad: int = Field(default=256, gt=0)
    tasks: list[Literal["passkey", "needle", "multikey"]] = ["passkey"]
    n: int = Field(default=50, gt=0, description="prompts per (task, length)")
    seed: int = Field(default=0, ge=0)
    at_steps: list[int] = []
    final: bool = False
    haystack: Optional[str] = Field(default=None, description="dataset dir whose val text is the haystack")
    gate: GateConfig = GateConfig()


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

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        why = run_name_problem(v)
        if why:
            raise ValueError(why)
        return v


def run_name_problem(name: str) -> Optional[str]:
    """Why `name` cannot name run dirs (runs/<name>-NNNN), or None. Shared with train/runs.py."""
    if not name or any(c in name for c in "/\\ \t\n") or name.startswith("."):
        return (f"name={name!r} must be non-empty, without slashes or spaces, and not start with '.' "
                f"(it names run dirs, and a dot-dir is hidden from `megablu ckpt list` and the run tools)")
    return None


# --------------------------------------------------------------------------- invariants
def eval_padded_len(length: int, max_new: int, pad: int) -> int:
    """prompt + generated tokens, rounded up to a multiple of pad (the seed's PAD rule)."""
    return math.ceil((length + max_new) / pad) * pad


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    dp = world_size // cfg.parallel.sp
    per = cfg.train.micro_batch * cfg.data.window * dp
    return cfg.train.tokens_per_step // per


def planned_sequences(cfg: Config) -> int:
    """Sequences of data.window the whole run consumes over all ranks (max_steps * tokens_per_step / window)."""
    return cfg.train.max_steps * cfg.train.tokens_per_step // cfg.data.window


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

    # Eval lengths: prompt + max_new padded to `pad` must fit the window.
    e = cfg.eval
    for L in e.lengths:
        padded = eval_padded_len(L, e.max_new, e.pad)
        if padded > T:
            fit = (T // e.pad) * e.pad - e.max_new
            errs.append(f"eval.lengths: {L} + max_new {e.max_new} pads to {padded} at pad {e.pad} > data.window "
                        f"{T}; the longest length that fits is {fit}")
    for st in e.at_steps:
        if not 0 < st <= steps:
            errs.append(f"eval.at_steps: {st} is outside 1..train.max_steps={steps}")
    if (e.at_steps or e.final) and not e.lengths:
        errs.append("eval.lengths: empty but eval.at_steps/eval.final ask for evaluation")
    for L in e.gate.short_lengths:
        if e.gate.parent and L not in e.lengths:
            errs.append(f"eval.gate.short_lengths: {L} is not in eval.lengths {e.lengths}; the gate cannot check it")

    # Document masking: only packed sequences hold more than one document.
    d = cfg.data
    if d.doc_mask and d.mode != "pack":
        errs.append(f"data.doc_mask=true with data.mode={d.mode}: a {d.mode} sequence holds one document, "
                    f"so there is nothing to mask; set data.mode=pack or data.doc_mask=false")
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

    # Memory switches (model/tiled.py, model/offload.py).
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
    if device == "cpu" and mem.offload_activations:
        errs.append("memory.offload_activations on a CPU run has no effect (activations already live in host "
                    "memory); set it false")
    return errs


def config_warnings(cfg: Config) -> list[str]:
    """Options that have no effect in this setup: legal, but worth a line on stderr."""
    w = []
    if cfg.checkpoint.every_steps > cfg.train.max_steps:
        w.append(f"checkpoint.every_steps={cfg.checkpoint.every_steps} > train.max_steps={cfg.train.max_steps}: "
                 f"only the final checkpoint will be written")
    if cfg.parallel.zero_stage != 3 and not cfg.parallel.reduce_scatter:
        w.append("parallel.reduce_scatter=false only affects ZeRO stage 3")
    if cfg.eval.gate.parent is None and not (cfg.eval.at_steps or cfg.eval.final) and cfg.eval.lengths:
        w.append("eval.lengths set but neither eval.at_steps nor eval.final: no evaluation will run in training")
    if cfg.rope.yarn is not None and cfg.init_from and not (cfg.eval.final and cfg.eval.gate.parent):
        w.append("a YaRN extension of init_from without eval.final and eval.gate.parent: nothing will tell whether "
                 "it got worse at short context; set eval.final=true and eval.gate.parent=<the parent's eval json>")
    m, sp = cfg.model, cfg.parallel.sp
    if sp > m.n_heads:
        # parallel/ulysses.py pads the query heads with zero heads up to a multiple of sp
        padded = math.ceil(m.n_heads / sp) * sp
        w.append(f"parallel.sp={sp} > model.n_heads={m.n_heads}: Ulysses pads the heads with {padded - m.n_heads} "
                 f"zero heads, so {padded - m.n_heads} of the {sp} ranks of each sp group attend over zero heads "
                 f"only: attention does {padded / m.n_heads:g}x the work of the real heads, the attention time is "
                 f"that of sp={m.n_heads}, and every layer's all-to-all spans {sp} ranks; parallel.sp<={m.n_heads} "
                 f"is as fast in attention and only the rest of the model's activations shard less")
    if cfg.memory.mlp_tiles > 1 and cfg.memory.recompute == "none":
        w.append("memory.mlp_tiles>1 with memory.recompute=none: the tiles recompute the MLP anyway; "
                 "recompute=selective with the same tiles saves h instead of the norm state and its output, "
                 "for one more (cheap) norm")
    return w
