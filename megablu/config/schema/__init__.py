"""Typed configuration: one pydantic model per section, YAML is data only.

Every section forbids unknown keys, and fields whose silent default would cost a run (YaRN's
original length: a wrong one costs the extension tens of points) have no default at all.
Cross-field invariants live in `check_invariants` (checks.py), a loop over small named checks that
returns *every* violation with the field, the values and the fix, so `megablu config check` can list
them all at once.

One module per section: base.py (what every section shares), model.py (model, rope, tokenizer),
data.py, train.py (parallel, train, schedule, checkpoint), memory.py, eval.py, root.py (Config,
hub, the run's name), checks.py (CHECKS, check_invariants, kernel_invariants, WARNINGS,
config_warnings). Every public name is importable from here: `from megablu.config.schema import X`.
"""

from __future__ import annotations

from .base import MAX_STEPS_MAX, SEED_MAX, Section
from .checks import CHECKS, WARNINGS, check_invariants, config_warnings, kernel_invariants
from .data import DataConfig, MixSource, Mode, mix_invariants
from .eval import (
    STRING_AUTHORS_FACTOR,
    STRING_AUTHORS_LOCAL,
    STRING_AUTHORS_RATIO,
    EvalConfig,
    GateConfig,
    LossEvalConfig,
    StringConfig,
    eval_padded_len,
    eval_problems,
    string_problems,
)
from .memory import FA4_HEAD_DIM, MemoryConfig
from .model import FAMILIES, ModelConfig, RopeConfig, RopeScalingConfig, TokenizerConfig, YarnConfig
from .root import RUN_NAME_MAX, Config, HubConfig, grad_accum_steps, run_name_problem
from .train import CheckpointConfig, ParallelConfig, ScheduleConfig, TrainConfig, checkpoint_problems

__all__ = [
    "CHECKS",
    "FAMILIES",
    "FA4_HEAD_DIM",
    "MAX_STEPS_MAX",
    "RUN_NAME_MAX",
    "SEED_MAX",
    "STRING_AUTHORS_FACTOR",
    "STRING_AUTHORS_LOCAL",
    "STRING_AUTHORS_RATIO",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "GateConfig",
    "HubConfig",
    "LossEvalConfig",
    "MemoryConfig",
    "MixSource",
    "Mode",
    "ModelConfig",
    "ParallelConfig",
    "RopeConfig",
    "RopeScalingConfig",
    "ScheduleConfig",
    "Section",
    "StringConfig",
    "TokenizerConfig",
    "TrainConfig",
    "WARNINGS",
    "YarnConfig",
    "check_invariants",
    "checkpoint_problems",
    "config_warnings",
    "eval_padded_len",
    "eval_problems",
    "grad_accum_steps",
    "kernel_invariants",
    "mix_invariants",
    "run_name_problem",
    "string_problems",
]
