"""Every check that can be made before training, in one place: `megablu config check` and the
training entry (launch/ext32k.py) both call `check()`, so a config that passes one passes
the other (the issue found configs that `config check` accepted and the ranks then refused
with a traceback each, leaving a run dir behind).

check(path, sets, world_size, device, resume) = load_config (schema + cross-field
invariants, pure) + topology + `preflight(cfg)`: the checks in `CHECKS`, each a function
(ctx) -> list of 'field: problem; fix'. Every problem is listed at once; the caller exits 2
before any rank initialises and before any run dir is allocated. `config check --no-files`
runs the pure part only (a config written for another machine).

Hashing (data.verify, init_from and resume checkpoints) is done where `ctx.hash` is true:
rank 0 of the entry and `config check`; the other ranks check presence, sizes and shapes,
then wait in init_distributed while rank 0 hashes (DeepSpeed's launcher ends them when
rank 0 exits 2).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..config import Config, ConfigError, config_warnings, load_config
from .tracker import tracker_problem

if TYPE_CHECKING:
    from ..data.tokenizer import Tokenizer
    from ..parallel.topology import Topology

log = logging.getLogger(__name__)


@dataclass
class Context:
    cfg: Config
    resume: Optional[str] = None
    world_size: Optional[int] = None
    device: Optional[str] = None  # "cuda" | "cpu" the run will use; None: not known (no device checks)
    hash: bool = True  # this process hashes data and checkpoints
    tokenizer: Optional[Tokenizer] = None  # set by the tokenizer check (None when it failed)
    run_dir: Optional[Path] = None  # resume: the run found
    resume_step: Optional[Path] = None  # resume: the checkpoint it continues from
    complete: bool = False  # resume: the run has nothing left to do


# --------------------------------------------------------------------------- checks
def runs_dir_problems(ctx: Context) -> list[str]:
    d = Path(ctx.cfg.runs_dir)
    probe = d
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        what = "is" if probe == d else f"is under {probe}, which is"
        return [f"runs_dir: {d} {what} a file, not a directory; set runs_dir to a directory (created if absent)"]
    if not os.access(probe, os.W_OK | os.X_OK):
        return [f"runs_dir: {d} is not writable ({probe} denies this user); set runs_dir to a writable directory"]
    return []


def tokenizer_problems(ctx: Context) -> list[str]:
    from ..data.tokenizer import TokenizerError, load_tokenizer

    cfg = ctx.cfg
    try:  # every rank needs it, and the eval would build zero prompts without it
        ctx.tokenizer = tok = load_tokenizer(cfg.tokenizer)
    except (TokenizerError, OSError) as e:
        return [f"tokenizer: {e}"]
    if tok.vocab_size > cfg.model.vocab_size:
        return [
            f"model.vocab_size={cfg.model.vocab_size} < the tokenizer's vocabulary {tok.vocab_size} "
            f"({tok.identity}): ids >= {cfg.model.vocab_size} have no embedding; set model.vocab_size >= "
            f"{tok.vocab_size}"
        ]
    return []


def data_problems(ctx: Context) -> list[str]:
    """The data's own checks (megablu.data.mix.mix_problems: datasets, buckets, tokenizer identity,
    shard structure, epochs, for data.path or every data.mix source), then, where this process
    hashes, the sha256 of every selected shard by data.verify (cache | full)."""
    from ..data.mix import mix_problems
    from ..data.shards import DataError
    from ..data.source import verify_selection

    cfg = ctx.cfg
    problems = mix_problems(cfg, ctx.tokenizer.identity if ctx.tokenizer is not None else None)
    if problems or not ctx.hash or ctx.tokenizer is None:
        return problems
    d = cfg.data
    selections = (
        [("data", d.path, d.bucket, d.split)]
        if d.mix is None
        else [(f"data.mix[{i}] ({s.name})", s.path, s.bucket, s.split) for i, s in enumerate(d.mix) if s.weight > 0]
    )
    for where, path, bucket, split in selections:
        assert path is not None, where  # the schema requires data.path without data.mix
        try:
            verify_selection(path, bucket, split, d.verify)
        except (DataError, OSError) as e:
            problems.append(f"{where}: {e}")
    return problems


def init_from_problems(ctx: Context) -> list[str]:
    """The parent exists, is a checkpoint (not a dataset), records the rope the child may assume,
    and its weights fit the model: names, shapes, vocabulary, tokenizer. Without init_from, a
    YaRN rope needs rope.allow_yarn_from_scratch (config/lineage.py). On --resume the run's
    weights come from its own checkpoint, but a run whose rope contradicts the parent it
    started from (started before this check, or through the Python API) is refused: every
    step of it inherits the mismatch."""
    cfg = ctx.cfg
    if ctx.resume:
        if not cfg.init_from or not Path(cfg.init_from).exists():
            return []  # from scratch (checked when it started), or a parent since moved: nothing to compare
        problems = init_from_rope_problems(cfg, deep=False)  # its record only: nothing is loaded from it
        return [
            f"--resume {ctx.resume}: the run started from init_from {cfg.init_from}, and its rope contradicts "
            f"that parent's record: {p}; every step of the run inherits this, so resuming it trains on a wrong "
            f"rope: start a new run from the parent with the rope fixed (nothing was written)"
            for p in problems
        ]
    if not cfg.init_from:
        return init_from_rope_problems(cfg)
    if not Path(cfg.init_from).exists():
        return [
            f"init_from: parent checkpoint {cfg.init_from} does not exist; give a run dir, a checkpoint step "
            f"dir or an exported model dir"
        ]
    from ..checkpoint import CheckpointError, parent_record, resolve_parent

    try:  # a run dir: its newest verified step, as the trainer will load it (hashed where ctx.hash)
        src = resolve_parent(cfg.init_from, deep=ctx.hash)
        rec = parent_record(src)
    except CheckpointError as e:  # not a checkpoint (a dataset, a damaged manifest): nothing else to check
        return [f"init_from: {e}"]
    if rec.rope is None and cfg.rope.yarn is None:
        log.warning(
            "init_from %s records no rope or window: rope.theta=%g cannot be checked against the parent's",
            cfg.init_from,
            cfg.rope.theta,
        )
    # a step found by the scan above was hashed by it: the weights check then needs sizes only
    deep = ctx.hash and src == Path(cfg.init_from)
    return init_from_rope_problems(cfg, src) + init_from_weight_problems(ctx, src, deep)


def init_from_rope_problems(cfg: Config, source=None, deep: bool = True) -> list[str]:
    """The child's rope against the record of the parent it starts from (config/lineage.py).

    source: the path whose weights will be loaded (the trainer passes the step it resolved);
    default cfg.init_from, read as the load reads it (`checkpoint.resolve_parent`). No
    init_from: the no-parent rule. The one place the rule is applied: the preflight, the
    Trainer and a resume all call this."""
    from ..checkpoint import CheckpointError, parent_record
    from ..config.lineage import rope_lineage_problems

    if not cfg.init_from:
        return rope_lineage_problems(cfg.rope, cfg.data.window, None)
    try:
        rec = parent_record(source or cfg.init_from, deep=deep)
    except CheckpointError as e:
        return [f"init_from: {e}"]
    return rope_lineage_problems(cfg.rope, cfg.data.window, rec)


def init_from_weight_problems(ctx: Context, src=None, deep: Optional[bool] = None) -> list[str]:
    """The weights at src (default init_from) against the model's names and shapes and the tokenizer."""
    import torch

    from ..checkpoint import CheckpointError, architecture_check, read_weight_shapes, tied_keys, weights_mismatch
    from ..model.decoder import BluModel

    cfg = ctx.cfg
    src = src or cfg.init_from
    assert src, "init_from_weight_problems needs init_from or src"
    try:
        shapes, prov = read_weight_shapes(src, deep=ctx.hash if deep is None else deep)
    except CheckpointError as e:
        return [f"init_from: {e}"]
    except Exception as e:  # noqa: BLE001 - a weights file that is not safetensors (SafetensorError et al.)
        return [f"init_from: {cfg.init_from}: cannot read the weights: {type(e).__name__}: {e}"]
    with torch.device("meta"):  # shapes only: no memory, no init
        own = BluModel(cfg.model, cfg.rope).state_dict(keep_vars=True)
    problems = [
        f"init_from: {cfg.init_from}: {p}"
        for p in weights_mismatch({k: tuple(t.shape) for k, t in own.items()}, shapes, tied_keys(own))
    ]
    try:  # the files were verified by the shapes read above: sizes suffice here
        problems += [f"init_from: {p}" for p in architecture_check(cfg.model, src, deep=False)]
    except CheckpointError as e:
        problems.append(f"init_from: {e}")
    tok = ctx.tokenizer
    if tok is not None and prov.get("tokenizer") not in (None, tok.identity):
        problems.append(
            f"init_from: {cfg.init_from} was trained with tokenizer {prov['tokenizer']!r}, this config's "
            f"is {tok.identity!r}: embeddings of another tokenizer have the right shape and mean nothing; "
            f"configure the parent's tokenizer"
        )
    return problems


def eval_problems(ctx: Context) -> list[str]:
    cfg, problems = ctx.cfg, []
    if cfg.eval.gate.parent:
        from ..eval.gate import parent_problems
        from ..eval.prompts import EvalError
        from ..eval.report import load_result

        try:  # a gate that cannot be checked is found after hours of training otherwise
            parent = load_result(cfg.eval.gate.parent)
            problems += [
                f"eval.gate.parent: {p}"
                for p in parent_problems(
                    parent,
                    cfg.eval.gate,
                    cfg.eval.tasks,
                    loss=bool(cfg.eval.loss.data),
                    lengths=cfg.eval.lengths,
                    loss_sets=list(cfg.eval.loss.sets),
                )
            ]
        except EvalError as e:
            problems.append(f"eval.gate.parent: {e}")
    if cfg.eval.haystack:
        from ..data.haystack import split_spec

        hay = split_spec(cfg.eval.haystack)[0]
        if not Path(hay, "manifest.json").is_file():
            problems.append(
                f"eval.haystack: {hay} has no manifest.json; give a dataset dir built with "
                f"`megablu data build` (optionally DIR@bucket)"
            )
    tok = ctx.tokenizer
    if tok is not None and (cfg.eval.at_steps or cfg.eval.final) and not any("eval.haystack" in p for p in problems):
        from ..eval.harness import preflight_problems

        # every task's prompts at every length, in this tokenizer (a length shorter than a task's
        # prompt without filler, a haystack too small): not after hours of training
        problems += [f"eval: {p}" for p in preflight_problems(cfg.eval, tok, cfg.data.window)]
    return problems


def kernel_problems(ctx: Context) -> list[str]:
    """memory.loss=liger / memory.attention=fa4 import where the run will start (CUDA). The config
    part (CPU, head_dim, doc_mask, dtype) is config/schema/checks.py kernel_invariants; the GPU's
    architecture is checked at the first call (ops/attention.py): this process may see no GPU.
    memory.loss=auto and memory.attention=auto need nothing: without liger_kernel / flash_attn.cute they
    run chunked / sdpa (ops/cross_entropy.py auto_loss, ops/attention.py auto_kernel)."""
    mem = ctx.cfg.memory
    if ctx.device != "cuda" or (mem.loss != "liger" and mem.attention != "fa4"):
        return []
    problems = []
    if mem.loss == "liger":
        from ..ops.cross_entropy import liger_import_problem

        why = liger_import_problem()
        if why:
            problems.append(
                f"memory.loss=liger: {why}; install liger-kernel (pip install "
                f"liger-kernel==0.8.5, the version tested) or set memory.loss=chunked"
            )
    if mem.attention == "fa4":
        from ..ops.attention import import_problem

        why = import_problem()
        if why:
            problems.append(
                f"memory.attention=fa4: {why}; install flash-attn-4 (pip install "
                f"flash-attn-4==4.0.0b40, the version tested) or set memory.attention=sdpa"
            )
    return problems


def resume_problems(ctx: Context) -> list[str]:
    """--resume: the run exists, no live job holds it, it has a checkpoint to continue from, and
    this config may continue it (resume.py); a finished run is marked complete."""
    from ..checkpoint import read_manifest, scan_steps, step_of, step_problems
    from .resume import resume_problems as change_problems, run_command, saved_config
    from .runs import RunError, find_run, in_use_message, live_holder

    cfg, resume = ctx.cfg, ctx.resume
    if not resume:
        return []
    try:
        run = find_run(cfg.runs_dir, resume)
    except RunError as e:
        return [f"--resume {resume}: {e}"]
    ctx.run_dir = run
    holder = live_holder(run)
    if holder:
        return [f"--resume {resume}: {in_use_message(run, holder)}"]
    # "already complete" ends every rank with exit 0, so all ranks must agree on it: decided on
    # the size check (every rank sees the same files); the sha256 scan below is rank 0's
    newest, _ = scan_steps(run, deep=False)
    if newest is not None and step_of(newest) == cfg.train.max_steps:
        s = step_of(newest)
        own = (saved_config(newest, read_manifest(newest)) or {}).get("train", {}).get("max_steps", s)
        due = s in cfg.eval.at_steps or cfg.eval.final
        if own == s and (not due or (run / "eval" / f"step_{s}.json").exists()):
            ctx.complete, ctx.resume_step = True, newest  # it reached its own max_steps: nothing to do
            bad = step_problems(newest, deep=True) if ctx.hash else []
            if bad:  # nothing to train either way; the damage is worth a line
                log.warning(
                    "run %s is complete, but its final checkpoint %s does not verify: %s (megablu ckpt verify %s)",
                    run.name,
                    newest.name,
                    "; ".join(bad),
                    run,
                )
            return []
    step_dir, skipped = scan_steps(run, deep=ctx.hash)
    if step_dir is None:
        why = (
            "no checkpoint was saved yet (stopped before its first save)"
            if not skipped
            else "every checkpoint is damaged: " + "; ".join(f"{p.name}: {'; '.join(ps)}" for p, ps in skipped)
        )
        return [
            f"--resume {resume}: nothing to resume in {run}/checkpoints: {why}; start without --resume: "
            + run_command(run, resume=False, world=ctx.world_size)
        ]
    for p, ps in skipped:
        log.warning("resume: %s is not usable, an older step is used: %s", p, "; ".join(ps))
    ctx.resume_step = step_dir
    step = step_of(step_dir)
    assert step is not None, step_dir  # scan_steps returns step dirs only
    m = read_manifest(step_dir)
    saved = saved_config(step_dir, m)
    how = "resume with: " + run_command(run, resume=True, world=ctx.world_size)
    if saved is None:
        from ..config import config_hash

        if m.get("config_hash") not in (None, config_hash(cfg)):
            return [
                f"--resume {resume}: the config differs from the one {step_dir.name} was saved with (config hash "
                f"{m.get('config_hash')} vs {config_hash(cfg)}) and the run records no config to name the fields; "
                f"{how}"
            ]
        problems = []
    else:
        problems = change_problems(saved, cfg, step)
    if problems:
        return (
            [
                f"--resume {resume}: the config differs from the one {step_dir.name} was saved with (nothing was "
                f"written); every difference:"
            ]
            + problems
            + [how]
        )
    if cfg.train.stop_after is not None and cfg.train.stop_after <= step:
        problems.append(
            f"train.stop_after={cfg.train.stop_after} <= step {step} of the checkpoint: this session "
            f"would train nothing; raise train.stop_after or drop it"
        )
    return problems


# The checks, in order; each takes the Context and returns its problems ('field: problem; fix').
# A new check is one line here, nothing else to wire, e.g. for data mixtures:
#     ("mix", lambda ctx: mix_problems(ctx.cfg)),
CHECKS: list[tuple[str, Callable[[Context], list[str]]]] = [
    ("runs_dir", runs_dir_problems),
    ("tokenizer", tokenizer_problems),  # before data/init_from/eval: they use ctx.tokenizer
    ("data", data_problems),
    ("init_from", init_from_problems),
    ("eval", eval_problems),
    ("kernels", kernel_problems),
    ("tracker", lambda ctx: [p for p in [tracker_problem(ctx.cfg.train.tracker)] if p]),
    ("resume", resume_problems),
]


def run_checks(ctx: Context) -> list[str]:
    problems: list[str] = []
    for name, fn in CHECKS:
        try:
            problems += fn(ctx)
        except Exception as e:  # noqa: BLE001 - a check that crashes is reported, never a traceback
            log.debug("preflight check %s crashed", name, exc_info=True)
            problems.append(f"{name}: check failed: {type(e).__name__}: {e}")
    return problems


def preflight(
    cfg: Config, resume: Optional[str] = None, *, world_size: Optional[int] = None, hash: bool = True
) -> list[str]:
    """Every problem the filesystem can show before training (empty list = ready)."""
    return run_checks(Context(cfg, resume=resume, world_size=world_size, hash=hash))


# --------------------------------------------------------------------------- the one entry point
@dataclass
class Checked:
    cfg: Config
    ctx: Optional[Context]
    device: Optional[str] = None
    warnings: list[str] = field(default_factory=list)
    topology: Optional[Topology] = None


def check(
    path,
    sets: Iterable[str] = (),
    *,
    world_size: Optional[int] = None,
    device: Optional[str] = None,
    resume: Optional[str] = None,
    files: bool = True,
    hash: bool = True,
    ranks_per_node=None,
) -> Checked:
    """Load + validate + topology + preflight; raises ConfigError listing every problem.

    device="auto" resolves the config's train.device here (cuda when available); files=False
    skips the filesystem checks and the optional kernels' imports (`config check --no-files`: a
    config written for another machine)."""
    from ..config import apply_overrides, build_config, load_raw

    if device == "auto":
        from ..utils.device import resolve_device

        device = resolve_device(build_config(apply_overrides(load_raw(path), sets), str(path)).train.device)
    cfg = load_config(path, sets, world_size=world_size, device=device)
    problems, topo = [], None
    if world_size is not None:
        from ..parallel.topology import resolve

        topo = resolve(world_size, ranks_per_node, cfg.parallel.sp)
        problems += [f"parallel.sp: {e}" for e in topo.errors]
    ctx = None
    if files:
        ctx = Context(cfg, resume=resume, world_size=world_size, hash=hash, device=device)
        problems += run_checks(ctx)
    if problems:
        raise ConfigError(problems, str(path))
    return Checked(cfg, ctx, device, config_warnings(cfg), topo)
