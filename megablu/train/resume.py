"""What a resume may change, and the command that resumes a run.

A checkpoint continues exactly the run that saved it (same config hash), with these
exceptions, checked here once for the preflight and the trainer:
- session fields (train.stop_after, stop_after_s, probe_steps, log_every, profile_step, runs_dir): free;
- parallel.sp: Ulysses shards activations, not weights (see Trainer);
- memory.loss: which implementation computes the same summed loss (chunked, liger, or auto's pick);
  weights, optimizer state and data position do not depend on it (a run started with chunked, the
  default before auto, resumes under the auto default);
- memory.offload_keep, offload_fraction: where saved activations wait (GPU or pinned host), not what they are;
- memory.attention: the same causal attention by another kernel (sdpa, fa4, or auto's pick); nothing
  saved depends on it (a run started with sdpa, the default before auto, resumes under auto);
- memory.fuse_qkv, fuse_gate_up, fuse_block_add: the same block computed with fewer kernels, over the same
  parameters; nothing saved depends on them;
- checkpoint.every_steps, keep, keep_every: when to save and what to keep from now on (e.g. keep_every
  turned on for a run under way, to evaluate its later checkpoints); nothing saved depends on them, and
  the steps already on disk are kept or pruned by the new rule at the next save;
- train.max_steps (and schedule.decay_start): the LR is a pure function of the step and the
  schedule (schedule.py), so a new max_steps is accepted when it leaves the LR of every step
  already trained unchanged and refused otherwise, naming the first step whose LR would move.
  WSD before its decay tail: accepted (move schedule.decay_start with it, or keep it).
  WSD inside its tail, and cosine after warmup (its decay spans all of max_steps): refused,
  since the already trained part of the curve would be re-drawn; start a new run from this
  one with init_from instead.
Anything else differing is refused with every field named, saved vs now, and the command
that resumes the run with its own config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import Config, ConfigError, build_config, config_hash
from ..config.load import _SESSION_FIELDS
from ..utils.files import PathLike
from .schedule import lr_at

RESOLVED = "config.resolved.yaml"
# fields a resume may change (besides the session fields), each with its own rule below
RESUMABLE = {
    "parallel.sp",
    "memory.loss",
    "memory.attention",
    "memory.offload_keep",
    "memory.offload_fraction",
    "memory.fuse_qkv",
    "memory.fuse_gate_up",
    "memory.fuse_block_add",
    "train.max_steps",
    "schedule.decay_start",
    "checkpoint.every_steps",
    "checkpoint.keep",
    "checkpoint.keep_every",
}
_SESSION = {".".join(p) for p in _SESSION_FIELDS}


_ABSENT = "(absent)"


def _diff(a: Any, b: Any, path: str):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            yield from _diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))
    elif a != b:
        yield path, a, b


def config_changes(saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """[(field, saved value, new value)] where two config dicts differ, session fields left out."""
    return [(k, a, b) for k, a, b in _diff(saved, now, "") if k not in _SESSION]


def saved_config(step_dir: PathLike, manifest: dict) -> Optional[dict]:
    """The config a checkpoint was saved with: the manifest's record, else the run's config file
    whose hash is the manifest's (checkpoints older than that record)."""
    meta = manifest.get("meta") or {}
    if isinstance(meta.get("config"), dict):
        return meta["config"]
    run = Path(step_dir).parent.parent
    for f in sorted(run.glob("config*.yaml")):
        try:
            cfg = build_config(yaml.safe_load(f.read_text()) or {}, str(f))
        except (ConfigError, yaml.YAMLError, OSError):
            continue
        if config_hash(cfg) == manifest.get("config_hash"):
            return cfg.model_dump(mode="json")
    return None


def schedule_problem(saved: Config, now: Config, step: int) -> Optional[str]:
    """Why the new schedule (max_steps, decay_start) cannot continue a run at `step`, or None."""
    s0, m0, s1, m1 = saved.schedule, saved.train.max_steps, now.schedule, now.train.max_steps
    if m1 < step:
        return (
            f"train.max_steps={m1} < the checkpoint's step {step}: a resume continues forward; keep "
            f"train.max_steps >= {step}"
        )
    for s in range(step):  # 0-based optimizer steps already trained
        a, b = lr_at(s, s0, m0), lr_at(s, s1, m1)
        if a != b:
            if s1.kind == "cosine":
                why = (
                    f"schedule.kind=cosine decays over all of train.max_steps, so max_steps {m0} -> {m1} re-draws "
                    f"the LR of steps already trained"
                )
            elif s0.decay_start is not None and step > s0.decay_start:
                why = (
                    f"the run is in its decay tail (step {step} > schedule.decay_start={s0.decay_start}): "
                    f"max_steps {m0} -> {m1} / decay_start {s0.decay_start} -> {s1.decay_start} re-draws the LR "
                    f"of steps already trained"
                )
            else:
                why = (
                    f"schedule.decay_start {s0.decay_start} -> {s1.decay_start} with max_steps {m0} -> {m1} "
                    f"re-draws the LR of steps already trained"
                )
            fix = (
                "a cosine run cannot be extended: start a new run from this checkpoint with init_from (its own "
                "warmup and decay); schedule.kind=wsd runs can be lengthened in their stable phase"
                if s1.kind == "cosine"
                else f"extend a WSD run before its decay tail (keep schedule.decay_start >= {step}), or "
                f"start a new run from this checkpoint with init_from (its own warmup and decay)"
            )
            return f"train.max_steps: {why} (step {s + 1} trained at lr {a:.6g}, the new schedule gives {b:.6g}); {fix}"
    return None


def resume_problems(saved: dict, now: Config, step: int) -> list[str]:
    """Every reason the config `now` cannot continue a checkpoint saved with `saved` at `step`."""
    try:  # the saved dict with the defaults of fields added since it was written
        saved = build_config(saved).model_dump(mode="json")
    except ConfigError:
        pass
    changes = config_changes(saved, now.model_dump(mode="json"))
    other = [c for c in changes if c[0] not in RESUMABLE]
    problems = [f"{k}: saved {a!r}, now {b!r}" for k, a, b in other]
    if any(k in ("train.max_steps", "schedule.decay_start") for k, _, _ in changes):
        try:
            old = build_config(saved)
        except ConfigError as e:
            return problems + [f"the checkpoint's own config no longer validates: {'; '.join(e.errors)}"]
        # judged on max_steps / decay_start alone (another schedule field is named above)
        probe = now.model_copy(
            update={"schedule": old.schedule.model_copy(update={"decay_start": now.schedule.decay_start})}
        )
        why = schedule_problem(old, probe, step)
        if why:
            problems.append(why)
    return problems


def loss_change(run_dir: PathLike, step: int, loss_now: str) -> Optional[str]:
    """A line for the log when the loss implementation that runs now (the head's, memory.loss=auto
    resolved) differs from the one the run's last session up to `step` ran (its probe file's setup:
    probe.json at step 0, probe.step<N>.json for a session resumed at N); None when the same or not
    recorded. memory.loss=auto picks by what imports here, so the same config can run another kernel
    on another machine: the same summed loss, rounded otherwise, so said once and not refused."""
    import json

    before = []
    for f in Path(run_dir).glob("probe*.json"):
        at = "0" if f.name == "probe.json" else f.name[len("probe.step") : -len(".json")]
        if not at.isdigit() or int(at) > step:  # probe.rank<N>.json, or a later session
            continue
        try:
            ran = json.loads(f.read_text()).get("setup", {}).get("loss")
        except (OSError, ValueError, AttributeError):
            continue
        if ran:
            before.append((int(at), ran))
    if not before:
        return None
    at_step, ran = max(before)
    if ran == loss_now:
        return None
    return (
        f"resume: the vocab loss runs {loss_now} now; the session from step {at_step} ran {ran} (memory.loss=auto "
        f"picks by what imports on this machine): the same summed loss by another kernel, its rounding differs"
    )


def entry_path() -> str:
    """launch/ext32k.py as the user would type it from here."""
    return _shown(Path(__file__).resolve().parents[2] / "launch" / "ext32k.py")


def _shown(p: Path) -> str:
    """A path as typed from the current directory: relative below it, else absolute."""
    try:
        rel = os.path.relpath(p)
    except ValueError:
        return str(p)
    return rel if not rel.startswith("..") else str(Path(p).resolve())


def run_command(run_dir: PathLike, *, resume: bool, world: Optional[int] = None, nodes: int = 1) -> str:
    """The command that resumes (or, without a checkpoint, restarts) a run with its own config.

    `--resume <id>` is looked up in the runs_dir of that config (the run's own), so the id is
    enough when the run lives there; otherwise the run's path is given."""
    run_dir = Path(run_dir)
    try:
        runs_dir = (yaml.safe_load((run_dir / RESOLVED).read_text()) or {}).get("runs_dir", "runs")
        here = (Path(runs_dir) / run_dir.name).resolve() == run_dir.resolve()
    except (OSError, yaml.YAMLError, AttributeError, TypeError):
        here = False
    which = run_dir.name if here else _shown(run_dir)
    if nodes > 1:
        launcher = "deepspeed --hostfile <your hostfile>"
    else:
        launcher = f"deepspeed --num_gpus {world or '<N>'}"
    cmd = f"{launcher} {entry_path()} --config {_shown(run_dir / RESOLVED)}"
    return cmd + (f" --resume {which}" if resume else "")


def how_to_continue(run_dir: PathLike, world: Optional[int] = None, nodes: int = 1) -> str:
    """'resume with: ...' when the run has a checkpoint to resume from, else 'start again with: ...'."""
    from ..checkpoint import CKPT_DIR, step_of

    ck = Path(run_dir) / CKPT_DIR
    has = ck.is_dir() and any(step_of(p) is not None for p in ck.iterdir())
    if has:
        return "resume with: " + run_command(run_dir, resume=True, world=world, nodes=nodes)
    return "no checkpoint was saved; start again with: " + run_command(run_dir, resume=False, world=world, nodes=nodes)
