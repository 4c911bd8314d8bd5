"""The cross-field checks: `check_invariants` runs every named check below on a whole Config and returns every
violation as 'field: values; fix' (each check returns its own problems, [] when it has none), so
`megablu config check` lists them all at once; `config_warnings` runs the named warnings of WARNINGS the same
way (options that have no effect here)."""

from __future__ import annotations

import math
from typing import Optional

from ...utils.liger import liger_chunk_tokens
from .data import mix_invariants
from .eval import eval_problems
from .memory import FA4_HEAD_DIM, MemoryConfig
from .root import Config
from .train import checkpoint_problems


def yarn_window_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """YaRN: factor * original_max_position == window, exactly."""
    y, T = cfg.rope.yarn, cfg.data.window
    if y is None:
        return []
    prod = y.factor * y.original_max_position
    if prod == T:
        return []
    return [
        f"rope.yarn: factor*original_max_position = {y.factor}*{y.original_max_position} = {prod:g} "
        f"!= data.window {T}; set rope.yarn.factor={T / y.original_max_position:g} "
        f"(original_max_position must be the length the parent was actually trained at)"
    ]


def family_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """Sliding-window layers against the kernels and the rope (model/decoder.py LocalAttention._windowed)."""
    m, r, errs = cfg.model, cfg.rope, []
    if m.sliding_layers and cfg.memory.attention == "fa4":
        errs.append(
            f"memory.attention=fa4 with model.sliding_layers {m.sliding_layers}: the sliding window "
            f"runs on SDPA with a window mask here; set memory.attention=sdpa (or auto: windowed layers "
            f"take SDPA)"
        )
    if m.sliding_layers and cfg.data.doc_mask:
        errs.append(
            f"data.doc_mask=true with model.sliding_layers {m.sliding_layers}: no kernel here applies a "
            f"document mask and a sliding window together; set data.doc_mask=false"
        )
    fam = m.resolved_family
    if fam == "gemma3" and m.sliding_layers and r.local_theta is None:
        errs.append(
            f"model.family=gemma3 with model.sliding_layers {m.sliding_layers} needs rope.local_theta: "
            f"Gemma 3's sliding layers have their own plain RoPE base (rope_local_base_freq, 10000 in its "
            f"releases); set rope.local_theta"
        )
    if fam != "gemma3" and r.local_theta is not None:
        errs.append(
            f"rope.local_theta={r.local_theta:g} with model.family={fam}: only Gemma 3 gives its sliding "
            f"layers their own RoPE (a {fam} model's sliding layers share rope.theta); remove it"
        )
    elif r.local_theta is not None and not m.sliding_layers:
        errs.append(
            f"rope.local_theta={r.local_theta:g} has no effect without model.sliding_layers (it is the "
            f"RoPE base of the sliding layers); remove it"
        )
    y = r.yarn
    if y is not None and r.local_theta is not None and (m.sliding_window or 0) > y.original_max_position:
        # the rule: YaRN where a layer meets distances beyond what it was trained at; a sliding layer's
        # distances stay < its window, so it keeps its plain RoPE, which needs the window within the original
        errs.append(
            f"model.sliding_window={m.sliding_window} > rope.yarn.original_max_position="
            f"{y.original_max_position}: the sliding layers keep their plain RoPE (rope.local_theta) under "
            f"YaRN because their distances stay below the window, which must then be within the length "
            f"the parent was trained at; check rope.yarn.original_max_position"
        )
    return errs


def profile_step_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    ps = cfg.train.profile_step
    if ps is not None and ps > cfg.train.max_steps:
        return [
            f"train.profile_step: {ps} > train.max_steps {cfg.train.max_steps}: that step never runs; "
            f"pick a step after the first few (warm-up), e.g. train.profile_step={min(5, cfg.train.max_steps)}"
        ]
    return []


def schedule_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """WSD: a decay start that leaves a tail of >= 2 steps, after the warmup; cosine: no decay start, a warmup
    shorter than the run; min_lr <= lr."""
    errs = []
    s, steps = cfg.schedule, cfg.train.max_steps
    if s.kind == "wsd":
        if s.decay_start is None:
            errs.append("schedule.decay_start: required for schedule.kind=wsd (first step of the decay tail)")
        else:
            if s.decay_start > steps - 2:
                errs.append(
                    f"schedule.decay_start={s.decay_start} > train.max_steps-2 = {steps - 2}: leaves no decay "
                    f"tail (need >= 2 steps); set schedule.decay_start <= {steps - 2}"
                )
            if s.warmup_steps >= s.decay_start:
                errs.append(
                    f"schedule.warmup_steps={s.warmup_steps} >= schedule.decay_start={s.decay_start}; "
                    f"warmup must end before the decay starts"
                )
    else:
        if s.decay_start is not None:
            errs.append(f"schedule.decay_start={s.decay_start} has no effect with schedule.kind=cosine; remove it")
        if s.warmup_steps >= steps:
            errs.append(f"schedule.warmup_steps={s.warmup_steps} >= train.max_steps={steps}; nothing left to decay")
    if s.min_lr > s.lr:
        errs.append(f"schedule.min_lr={s.min_lr} > schedule.lr={s.lr}")
    return errs


def checkpoint_section_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """Checkpoints kept by keep_every exist only where a periodic save lands."""
    return checkpoint_problems(cfg.checkpoint)


def eval_section_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """Every task at every length fits the window (PAD rule) and holds its content; the eval steps lie in the
    run; STRING runs on one rank."""
    errs = eval_problems(cfg.eval, cfg.data.window)
    steps = cfg.train.max_steps
    for st in cfg.eval.at_steps:
        if not 0 < st <= steps:
            errs.append(f"eval.at_steps: {st} is outside 1..train.max_steps={steps}")
    if cfg.eval.string is not None and cfg.parallel.sp > 1:
        errs.append(
            f"eval.string with parallel.sp={cfg.parallel.sp}: STRING attention runs on one rank (a "
            f"sequence-parallel prefill shards the keys it remaps); run the eval with parallel.sp=1 "
            f"(megablu eval --set parallel.sp=1), or set eval.string=null for this run's own evals"
        )
    dec = cfg.eval.decode
    if dec in ("static", "graph"):  # eval/decode.py graph_problem, before any rank starts instead of at the eval
        why = (
            f"parallel.sp={cfg.parallel.sp} (sequence-parallel decode is eager)"
            if cfg.parallel.sp > 1
            else "eval.string is set (STRING's shifted keys are indexed by position)"
            if cfg.eval.string is not None
            else "parallel.zero_stage=3 (its parameters are gathered by hooks at each forward)"
            if cfg.parallel.zero_stage == 3
            else None
        )
        if why:
            errs.append(f"eval.decode={dec} cannot run with {why}: set eval.decode=auto (eager here) or eager")
    if dec == "graph" and device == "cpu":
        errs.append("eval.decode=graph captures CUDA graphs: on a CPU run set eval.decode=auto, eager or static")
    return errs


def data_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """Document masking: only packed sequences hold more than one document; the mixture's own checks."""
    errs = []
    d = cfg.data
    if d.doc_mask and d.mix is None and d.mode != "pack":
        errs.append(
            f"data.doc_mask=true with data.mode={d.mode}: a {d.mode} sequence holds one document, "
            f"so there is nothing to mask; set data.mode=pack or data.doc_mask=false"
        )
    if d.mix is not None:
        errs += mix_invariants(d)
    if not d.doc_mask and d.doc_positions != "restart":
        errs.append(f"data.doc_positions={d.doc_positions} has no effect without data.doc_mask=true; remove it")
    return errs


def head_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    m = cfg.model
    if m.n_kv_heads > m.n_heads:
        return [f"model.n_kv_heads={m.n_kv_heads} > model.n_heads={m.n_heads}"]
    return []


def topology_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """With the launch's world size: sp fits and divides it, and tokens_per_step is an exact number of
    micro-batches over the data-parallel ranks."""
    if world_size is None:
        return []
    sp, T = cfg.parallel.sp, cfg.data.window
    if sp > world_size:
        return [
            f"parallel.sp={sp} > world size {world_size}: launch at least {sp} processes "
            f"(deepspeed --num_gpus {sp}) or lower parallel.sp"
        ]
    if world_size % sp:
        return [
            f"parallel.sp={sp} does not divide world size {world_size}; use an sp in "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        ]
    dp = world_size // sp
    per = cfg.train.micro_batch * T * dp
    if cfg.train.tokens_per_step % per:
        lo = max(per, (cfg.train.tokens_per_step // per) * per)
        return [
            f"train.tokens_per_step={cfg.train.tokens_per_step} is not micro_batch*window*grad_accum*dp "
            f"= {cfg.train.micro_batch}*{T}*k*{dp} for an integer k; nearest exact values: {lo} "
            f"(k={lo // per}) or {lo + per} (k={lo // per + 1})"
        ]
    return []


def cpu_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """Settings a CPU run cannot use."""
    errs = []
    if device == "cpu" and cfg.train.dtype == "bf16":
        errs.append("train.dtype=bf16 on a CPU run: set train.dtype=fp32 (bf16 training is for GPUs)")
    if device == "cpu" and cfg.parallel.offload_optimizer:
        errs.append("parallel.offload_optimizer on a CPU run has no effect; set it false")
    return errs


def memory_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    """The memory switches (megablu/memory/: tiled.py, offload.py) against the shapes and the device."""
    errs = []
    mem, m, T, sp = cfg.memory, cfg.model, cfg.data.window, cfg.parallel.sp
    rows = cfg.train.micro_batch * math.ceil(T / sp)  # tokens a rank's MLP tiles split
    if mem.mlp_tiles > rows:
        errs.append(
            f"memory.mlp_tiles={mem.mlp_tiles} > tokens per rank {rows} (train.micro_batch*ceil(data.window"
            f"/parallel.sp) = {cfg.train.micro_batch}*ceil({T}/{sp})): a tile needs at least one token; "
            f"set memory.mlp_tiles <= {rows}"
        )
    if mem.offload_activations and mem.recompute == "none" and mem.mlp_tiles == 1:
        # the same GPU saving as selective (about two layers' saved sets stay on the GPU),
        # for ~3x the host link traffic and host memory: the (T, ffn) intermediates
        errs.append(
            f"memory.offload_activations with memory.recompute=none and memory.mlp_tiles=1 copies every "
            f"layer's (T, ffn) MLP intermediates ({3 * 2 * m.ffn_dim} B/token/layer in bf16) to host and "
            f"back each step; set memory.recompute=selective (or full), or memory.mlp_tiles >= 2"
        )
    # how many blocks offload: floor(fraction * (n_layers - offload_keep)), memory/constants.py offloaded_count
    if (
        mem.offload_activations
        and mem.offload_keep < m.n_layers
        and int((m.n_layers - mem.offload_keep) * mem.offload_fraction + 1e-9) == 0
    ):
        errs.append(
            f"memory.offload_fraction={mem.offload_fraction:g} of the {m.n_layers - mem.offload_keep} "
            f"blocks before the last memory.offload_keep={mem.offload_keep} is none of them: nothing is "
            f"offloaded; set memory.offload_fraction>={1 / (m.n_layers - mem.offload_keep):.3g}, or "
            f"memory.offload_activations=false"
        )
    if mem.offload_activations and mem.offload_keep >= m.n_layers:
        errs.append(
            f"memory.offload_keep={mem.offload_keep} with model.n_layers={m.n_layers}: every block "
            f"would keep its activations on the GPU, so nothing is offloaded; set memory.offload_keep<="
            f"{m.n_layers - 1}, or memory.offload_activations=false"
        )
    if device == "cpu" and mem.offload_activations:
        errs.append(
            "memory.offload_activations on a CPU run has no effect (activations already live in host "
            "memory); set it false"
        )
    if mem.fuse_block_add and m.norm_layout != "pre":
        # post has no input norm to fuse the add into; sandwich could, but only pre is built and tested
        errs.append(
            f"memory.fuse_block_add with model.norm_layout={m.norm_layout}: the fusion is built for the pre "
            f"layout (Llama's), whose next input_layernorm reads the residual sum; set memory.fuse_block_add=false "
            f"for this model"
        )
    return errs


def kernel_choice_problems(cfg: Config, world_size: Optional[int], device: Optional[str]) -> list[str]:
    return kernel_invariants(cfg, device)


# In this order: the messages come out as the sections read in a config.
CHECKS = (
    yarn_window_problems,
    family_problems,
    profile_step_problems,
    schedule_problems,
    checkpoint_section_problems,
    eval_section_problems,
    data_problems,
    head_problems,
    topology_problems,
    cpu_problems,
    memory_problems,
    kernel_choice_problems,
)


def check_invariants(cfg: Config, world_size: Optional[int] = None, device: Optional[str] = None) -> list[str]:
    """Every cross-field violation as 'field: values; fix'. Empty list = valid.

    world_size and device are what the launch will use; when given, topology-dependent
    invariants (sp vs world, tokens_per_step exactness, bf16 on CPU) are checked too.
    """
    return [problem for check in CHECKS for problem in check(cfg, world_size, device)]


def kernel_invariants(cfg: Config, device: Optional[str] = None) -> list[str]:
    """memory.loss / memory.attention against the config and the device, without importing anything
    (train/preflight.py kernel_problems checks that the chosen library imports, where the run will start).
    memory.loss=auto and memory.attention=auto are never errors: they fall back to chunked and sdpa
    (ops/cross_entropy.py auto_loss, ops/attention.py auto_kernel)."""
    mem, errs = cfg.memory, []
    if device == "cpu":
        if mem.loss == "liger":
            errs.append(
                "memory.loss=liger on a CPU run: Liger's fused linear cross-entropy is a Triton GPU kernel; "
                "set memory.loss=chunked"
            )
        if mem.attention == "fa4":
            errs.append(
                "memory.attention=fa4 on a CPU run: FlashAttention-4 runs on SM90 GPUs only; set memory.attention=sdpa"
            )
    if mem.attention != "fa4":
        return errs
    lo, hi, mult = FA4_HEAD_DIM
    hd = cfg.model.resolved_head_dim
    if not (lo <= hd <= hi and hd % mult == 0):
        errs.append(
            f"memory.attention=fa4 with head_dim {hd}: FlashAttention-4 takes head_dim {lo}..{hi}, a "
            f"multiple of {mult}, on SM90; set memory.attention=sdpa"
        )
    if cfg.data.doc_mask:
        errs.append(
            "memory.attention=fa4 with data.doc_mask=true: FlashAttention-4 runs plain causal attention "
            "here, document masking runs on FlexAttention; set memory.attention=sdpa (or data.doc_mask="
            "false)"
        )
    if cfg.train.dtype != "bf16":
        errs.append(
            f"memory.attention=fa4 with train.dtype={cfg.train.dtype}: FlashAttention-4 takes bf16/fp16 "
            f"inputs only; set train.dtype=bf16 or memory.attention=sdpa"
        )
    return errs


def checkpoint_warnings(cfg: Config) -> list[str]:
    w = []
    if cfg.checkpoint.every_steps > cfg.train.max_steps:
        w.append(
            f"checkpoint.every_steps={cfg.checkpoint.every_steps} > train.max_steps={cfg.train.max_steps}: "
            f"only the final checkpoint will be written"
        )
    if cfg.checkpoint.keep_every > cfg.train.max_steps:
        w.append(
            f"checkpoint.keep_every={cfg.checkpoint.keep_every} > train.max_steps={cfg.train.max_steps}: "
            f"no step of this run is kept by it"
        )
    return w


def offload_tuning_warnings(cfg: Config) -> list[str]:
    """Tuning the offload: nothing to tune without it."""
    w = []
    for field in ("offload_keep", "offload_fraction"):
        value = getattr(cfg.memory, field)
        if value != MemoryConfig.model_fields[field].default and not cfg.memory.offload_activations:
            w.append(
                f"memory.{field}={value:g} without memory.offload_activations has no effect (nothing is offloaded)"
            )
    return w


def reduce_scatter_warnings(cfg: Config) -> list[str]:
    if cfg.parallel.zero_stage != 3 and not cfg.parallel.reduce_scatter:
        return ["parallel.reduce_scatter=false only affects ZeRO stage 3"]
    return []


def eval_warnings(cfg: Config) -> list[str]:
    """Evaluation set up but never run in training, and an extension nothing gates."""
    w = []
    if cfg.eval.gate.parent is None and not (cfg.eval.at_steps or cfg.eval.final) and cfg.eval.lengths:
        w.append("eval.lengths set but neither eval.at_steps nor eval.final: no evaluation will run in training")
    if cfg.rope.yarn is not None and cfg.init_from and not (cfg.eval.final and cfg.eval.gate.parent):
        w.append(
            "a YaRN extension of init_from without eval.final and eval.gate.parent: nothing will tell whether "
            "it got worse at short context; set eval.final=true and eval.gate.parent=<the parent's eval json>"
        )
    return w


def rope_apply_warnings(cfg: Config) -> list[str]:
    y = cfg.rope.yarn
    if y is not None and y.apply == "beyond_original" and cfg.data.mode == "pack" and not cfg.data.doc_mask:
        return [
            f"rope.yarn.apply=beyond_original with data.mode=pack and data.doc_mask=false: every training row "
            f"is a full window of {cfg.data.window} > original_max_position {y.original_max_position} tokens, "
            f"so training always uses YaRN (only evaluation of short prompts uses the original RoPE); set "
            f"data.doc_mask=true to train short documents with the original RoPE"
        ]
    return []


def mix_warnings(cfg: Config) -> list[str]:
    w = []
    for i, src in enumerate(cfg.data.mix or []):
        if src.weight == 0:
            w.append(f"data.mix[{i}] ({src.name}) has weight 0: it is checked but never read")
        elif cfg.data.doc_mask and src.mode != "pack":
            w.append(
                f"data.doc_mask=true: source data.mix[{i}] ({src.name}) is mode {src.mode}, one document per "
                f"sequence, so its rows have nothing to mask (doc_ids 0); only the packed sources are masked"
            )
    return w


def head_padding_warnings(cfg: Config) -> list[str]:
    m, sp = cfg.model, cfg.parallel.sp
    if sp <= m.n_heads:
        return []
    # parallel/ulysses.py pads the query heads with zero heads up to a multiple of sp
    padded = math.ceil(m.n_heads / sp) * sp
    return [
        f"parallel.sp={sp} > model.n_heads={m.n_heads}: Ulysses pads the heads with {padded - m.n_heads} "
        f"zero heads, so {padded - m.n_heads} of the {sp} ranks of each sp group attend over zero heads "
        f"only: attention does {padded / m.n_heads:g}x the work of the real heads, the attention time is "
        f"that of sp={m.n_heads}, and every layer's all-to-all spans {sp} ranks; parallel.sp<={m.n_heads} "
        f"is as fast in attention and only the rest of the model's activations shard less"
    ]


def liger_chunk_warnings(cfg: Config) -> list[str]:
    if not (cfg.memory.loss == "liger" and cfg.memory.loss_chunk > 0):
        return []
    m, tokens = cfg.model, cfg.train.micro_batch * math.ceil(cfg.data.window / cfg.parallel.sp)
    own = liger_chunk_tokens(tokens, m.d_model, m.vocab_size)
    if cfg.memory.loss_chunk < own:
        return [
            f"memory.loss_chunk={cfg.memory.loss_chunk} with memory.loss=liger has no effect here: Liger's "
            f"own chunk at {tokens} tokens per rank is {own} tokens, and loss_chunk only widens it; set "
            f"memory.loss_chunk=0 or a value >= {own}"
        ]
    return []


def mlp_tiles_warnings(cfg: Config) -> list[str]:
    if cfg.memory.mlp_tiles > 1 and cfg.memory.recompute == "none":
        return [
            "memory.mlp_tiles>1 with memory.recompute=none: the tiles recompute the MLP anyway; "
            "recompute=selective with the same tiles saves h instead of the norm state and its output, "
            "for one more (cheap) norm"
        ]
    return []


# In the order of the checks above them, so a config's warnings read as its sections do.
WARNINGS = (
    checkpoint_warnings,
    offload_tuning_warnings,
    reduce_scatter_warnings,
    eval_warnings,
    rope_apply_warnings,
    mix_warnings,
    head_padding_warnings,
    liger_chunk_warnings,
    mlp_tiles_warnings,
)


def config_warnings(cfg: Config) -> list[str]:
    """Options that have no effect in this setup: legal, but worth a line on stderr (every named warning of
    WARNINGS, in that order)."""
    return [w for warn in WARNINGS for w in warn(cfg)]
