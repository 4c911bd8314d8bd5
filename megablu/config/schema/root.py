"""The whole config: one section per component (model, rope, tokenizer, parallel, data, train, schedule,
checkpoint, memory, eval, hub), the run's name and its parent."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from .base import Section
from .data import DataConfig
from .eval import EvalConfig
from .memory import MemoryConfig
from .model import ModelConfig, RopeConfig, TokenizerConfig
from .train import CheckpointConfig, ParallelConfig, ScheduleConfig, TrainConfig


class HubConfig(Section):
    repo: Optional[str] = None
    private: bool = True


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
            raise ValueError(
                f"init_from={v!r} is empty (an unset shell variable?); give the parent (a run dir, a "
                f"step dir or an exported model dir), or null to train from scratch"
            )
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
        return (
            f"name={name!r} must be non-empty, without slashes, spaces or NUL, and not start with '.' "
            f"(it names run dirs, and a dot-dir is hidden from `megablu ckpt list` and the run tools)"
        )
    n = len(name.encode("utf-8", "surrogateescape"))
    if n > RUN_NAME_MAX:
        return (
            f"name={name[:40]}... is {n} bytes long; it names run dirs (<name>-NNNN, at most 255 bytes a name "
            f"on the usual filesystems, with room for the run number and `megablu probe`'s '_probe'), so it "
            f"may be at most {RUN_NAME_MAX} bytes: shorten it"
        )
    return None


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    dp = world_size // cfg.parallel.sp
    per = cfg.train.micro_batch * cfg.data.window * dp
    return cfg.train.tokens_per_step // per
