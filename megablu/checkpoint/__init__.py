"""Checkpoints that cannot be lost or loaded half-right.

Layout of one run (the run id is the directory name, see runs.py):

  runs/<run_id>/checkpoints/
    step_0000100/                      published only by an atomic rename, complete
      manifest.json                    every file + size + sha256, topology, step, meta
      model.safetensors                consolidated weights (BluModel names): init_from / export
      client_state/rank_00000.pt       per-rank trainer state (step, tokens, loader, schedule, RNG)
      ds/mp_rank_00_model_states.pt    DeepSpeed's own files (engine.save_checkpoint, tag "ds")
      ds/zero_pp_rank_*_optim_states.pt
      pinned                           optional marker: keep-N never deletes this step
    latest                             "step_0000100": written last, atomically, a hint only
    .tmp-step_0000200/                 a save in progress (or killed): never read, cleaned
    .trash-step_0000200-<pid>/         an older step_0000200 moved aside by its re-save: put
                                       back if the new one was never published, else cleaned
    .pruned-step_0000050-<pid>/        a pruned step being deleted: never read, cleaned

Checkpoint traps and what makes each impossible here:
- a 3-of-4 shard set loaded silently: the manifest names every file (and rank 0 checks
  that every rank's DeepSpeed files exist with the size its writer recorded before the
  manifest is written); `load` checks every file's size and sha256 on all ranks before
  any rank calls DeepSpeed, and refuses naming the files.
- a failed save only warned: every write goes through a recording proxy of DeepSpeed's
  checkpoint engine that catches the error instead of leaving the other ranks in a
  collective; the ranks then exchange their status and every rank raises CheckpointError.
- keep-N pruned another run's shard: pruning looks only inside this run's directory and
  only at complete steps whose manifest names this run; never the newest, never pinned,
  never a step that checkpoint.keep_every keeps.
- kill -9 at any point: a step is visible only after `rename(.tmp-step, step)`, and
  `latest()` trusts nothing it has not verified, so the newest complete step wins.

Files (torchtitan `components/checkpointer/` is the model):
  layout.py   names, the manifest, verification, `resolve_step` (what a step or run dir means)
  manager.py  CheckpointManager: the DeepSpeed-coupled save / load / keep-N protocol
  weights.py  safetensors weights: init_from, what a parent records, export to a transformers dir
  rng.py      generator states for an exact resume
  cli.py      `megablu ckpt verify | list | export`
"""

from typing import TYPE_CHECKING

# layout (manifests, verification, what a step or run dir means) needs no torch: `megablu ckpt`,
# `megablu runs` and every other command's registration import this package, and torch's import
# is ~1 s of each such command's start. The torch-coupled names load on first use (PEP 562).
from .layout import (
    CKPT_DIR,
    LATEST,
    MANIFEST,
    PIN,
    WEIGHTS,
    CheckpointError,
    newest_verified,
    read_manifest,
    resolve_step,
    scan_steps,
    step_dirs,
    step_name,
    step_of,
    step_problems,
    verify_checkpoint,
)

if TYPE_CHECKING:  # the same names, imported for real by __getattr__ below
    from .manager import CheckpointManager, resolve_step_collective
    from .rng import get_rng_state, set_rng_state
    from .weights import (
        architecture_check,
        export_checkpoint,
        load_weights,
        parent_record,
        read_weight_shapes,
        read_weights,
        resolve_parent,
        resolve_weights,
        save_weights,
        tied_keys,
        weights_mismatch,
    )

_LAZY = {
    **dict.fromkeys(["CheckpointManager", "resolve_step_collective"], "manager"),
    **dict.fromkeys(["get_rng_state", "set_rng_state"], "rng"),
    **dict.fromkeys(
        [
            "architecture_check",
            "export_checkpoint",
            "load_weights",
            "parent_record",
            "read_weight_shapes",
            "read_weights",
            "resolve_parent",
            "resolve_weights",
            "save_weights",
            "tied_keys",
            "weights_mismatch",
        ],
        "weights",
    ),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


__all__ = [
    "CKPT_DIR",
    "LATEST",
    "MANIFEST",
    "PIN",
    "WEIGHTS",
    "CheckpointError",
    "CheckpointManager",
    "architecture_check",
    "export_checkpoint",
    "get_rng_state",
    "load_weights",
    "newest_verified",
    "parent_record",
    "read_manifest",
    "read_weight_shapes",
    "read_weights",
    "resolve_parent",
    "resolve_step",
    "resolve_step_collective",
    "resolve_weights",
    "save_weights",
    "scan_steps",
    "set_rng_state",
    "step_dirs",
    "step_name",
    "step_of",
    "step_problems",
    "tied_keys",
    "verify_checkpoint",
    "weights_mismatch",
]
