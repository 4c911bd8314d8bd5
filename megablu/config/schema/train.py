"""The training run's sections: parallelism, the optimizer loop, the LR schedule, checkpoints."""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from .base import MAX_STEPS_MAX, SEED_MAX, Section


class ParallelConfig(Section):
    sp: int = Field(default=1, ge=1, description="Ulysses sequence-parallel degree")
    zero_stage: Literal[0, 1, 2, 3] = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_scatter: bool = Field(
        default=True,
        description="ZeRO-3 reduce-scatter; it changes how gradients "
        "are averaged, and megablu corrects the loss scale for either choice "
        "(parallel/sequence.py), so this is free to set",
    )

    @model_validator(mode="after")
    def _offload(self):
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"parallel.offload_params needs parallel.zero_stage=3 (got {self.zero_stage})")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("parallel.offload_optimizer needs parallel.zero_stage >= 1 (got 0)")
        return self


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
    probe_steps: int = Field(
        default=3,
        ge=0,
        description="first steps of the run measured as the memory/speed probe (probe.json in the run dir; 0 = off)",
    )
    stop_after: Optional[int] = Field(
        default=None,
        gt=0,
        description="time-sliced jobs (e.g. a SLURM limit): "
        "stop after this step, checkpoint, exit 0; the schedule is still the full "
        "max_steps one, and `--resume RUN` continues it exactly",
    )
    stop_after_s: Optional[float] = Field(
        default=None,
        gt=0,
        description="wall-clock budget of this session in seconds: the run stops (checkpoint, "
        "exit 0) after the last step that, with a checkpoint, still ends within it; `--resume RUN` continues "
        "exactly. For time-sliced jobs (a SLURM limit, a device call)",
    )
    profile_step: Optional[int] = Field(
        default=None,
        gt=0,
        description="run this step under torch.profiler: its wall time split by phase (data, "
        "forward, backward, optimizer step, ...) and the top kernels in profile/step_<N>.md of the run dir, a chrome "
        "trace beside it; every other step runs unprofiled",
    )
    profile_trace_mib: float = Field(
        default=64.0,
        gt=0,
        description="with profile_step: the largest gzip'd trace kept (a 32k step of a 0.5B model is tens of MiB)",
    )
    fused_grad_check: bool = Field(
        default=True,
        description="ZeRO-1/2 without optimizer offload: DeepSpeed's per-tensor gradient checks before "
        "each step (NaN/inf, L2 norm for the clip) as multi-tensor passes, not ~14 kernels per tensor "
        "(megablu/train/grad_check.py); the same answers, the norm in float32 instead of float64 per tensor. "
        "false: DeepSpeed's own",
    )
    tracker: Literal["none", "wandb", "trackio"] = Field(
        default="none",
        description="an experiment tracker beside metrics.csv and TensorBoard, "
        "local-first: wandb in offline mode (files under the run dir; `wandb sync` uploads them later) or trackio "
        "(its local store). Optional packages: pip install 'megablu[wandb]' or 'megablu[trackio]'",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v):
        bad = [f"beta{i + 1}={b}" for i, b in enumerate(v) if not 0 <= b < 1]
        if bad:
            raise ValueError(
                f"train.betas: {', '.join(bad)} outside [0, 1) (Adam divides by 1 - beta**t); "
                f"the usual values are (0.9, 0.95)"
            )
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
        default=0,
        ge=0,
        description="keep-N never deletes a checkpoint whose step is a positive multiple of "
        "keep_every; `keep` counts only the other checkpoints and keeps the newest `keep` of them (the run's "
        "newest checkpoint is always kept, counted in `keep` unless its step is such a multiple). keep=1, "
        "keep_every=3, every_steps=1, 10 steps: 3, 6, 9, 10 remain. A multiple of every_steps, which must be > 0. "
        "0 = off",
    )
    save_final: bool = True


def checkpoint_problems(c: CheckpointConfig) -> list[str]:
    """keep_every against every_steps: a step it keeps must be a step that is saved (check_invariants calls it)."""
    k, e = c.keep_every, c.every_steps
    if not k:
        return []
    if not e:
        return [
            f"checkpoint.keep_every={k} with checkpoint.every_steps=0: only the final checkpoint is saved, so "
            f"there is no step {k}, {2 * k}, ... to keep; set checkpoint.every_steps={k} (or a divisor of "
            f"it), or checkpoint.keep_every=0"
        ]
    if k % e:
        lo = k // e * e
        near = lo if lo and k - lo <= lo + e - k else lo + e  # a tie goes down: fewer checkpoints kept
        return [
            f"checkpoint.keep_every={k} is not a multiple of checkpoint.every_steps={e}: checkpoints are "
            f"saved at multiples of {e}, so step {k} is never saved (only multiples of {math.lcm(k, e)} would "
            f"be kept); set checkpoint.keep_every={near} (the nearest multiple of {e})"
        ]
    return []
