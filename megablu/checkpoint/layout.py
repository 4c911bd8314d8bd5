"""Checkpoint layout: names, the manifest, verification, and which step a path means.

Read-only: nothing here writes (manager.py saves and prunes). The one rule every reader
shares -- `ckpt verify`, `ckpt list`, resume, keep-N, init_from, export -- is `step_problems`
(intact, and inside a run saved by that run); and "a run dir means its newest verified step"
is `resolve_step`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Optional

from ..utils.files import PathLike, sha256_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
LATEST = "latest"
PIN = "pinned"
DS_TAG = "ds"
CLIENT_DIR = "client_state"
CKPT_DIR = "checkpoints"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"  # replaced by a re-save: restored by cleanup() if nothing took its place
PRUNED_PREFIX = ".pruned-"  # deleted by keep-N: never restored
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{7,})$")

# files that may sit in a step dir without being in its manifest
_UNLISTED_OK = {MANIFEST, PIN}


class CheckpointError(Exception):
    """A checkpoint could not be saved, verified or loaded. Never just a warning."""


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: PathLike) -> Optional[int]:
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def step_number(path: PathLike) -> int:
    """step_of for a path already known to be a step dir (a sort key)."""
    s = step_of(path)
    assert s is not None, path
    return s


def _manifest_digest(m: dict) -> str:
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: PathLike) -> dict:
    """The manifest of a step dir; CheckpointError if absent, unreadable or altered."""
    p = Path(path) / MANIFEST
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete or not a megablu checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: unreadable manifest: {e}") from None
    if isinstance(m, dict) and m.get("format") == "megablu-shards":
        raise CheckpointError(
            f"{path} is a megablu dataset (its {MANIFEST} is a data manifest), not a checkpoint; "
            f"a dataset goes in data.path, a parent in init_from (a run dir, a step dir or an "
            f"exported model dir)"
        )
    if not isinstance(m, dict) or m.get("manifest_sha256") != _manifest_digest(m):
        raise CheckpointError(f"{p}: manifest checksum mismatch (edited or corrupted)")
    return m


def _check_files(root: Path, files: dict, names: list[str], deep: bool) -> list[str]:
    problems = []
    for rel in names:
        ent = files[rel]
        f = root / rel
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            problems.append(f"missing {rel}")
            continue
        if size != ent["size"]:
            problems.append(f"size {rel}: {size} bytes, manifest says {ent['size']}")
        elif deep and sha256_file(f) != ent["sha256"]:
            problems.append(f"checksum {rel}: sha256 differs from manifest (corrupted)")
    return problems


def _listed_problems(root: Path, m: dict) -> list[str]:
    """Structure checks: unlisted files, DeepSpeed shard count vs recorded partitions."""
    problems = []
    files = m["files"]
    for f in sorted(root.rglob("*")):
        if f.is_file():
            rel = f.relative_to(root).as_posix()
            if rel not in files and rel not in _UNLISTED_OK:
                problems.append(f"unlisted file {rel} (not written by this save)")
    parts = m.get("zero_partitions", 0)
    if parts:
        optim = [r for r in files if r.startswith(f"{DS_TAG}/") and r.endswith("optim_states.pt")]
        if len(optim) != parts:
            problems.append(f"manifest lists {len(optim)} optimizer shards, expected {parts} ZeRO partitions")
    return problems


def verify_checkpoint(path: PathLike, deep: bool = True) -> list[str]:
    """Problems with a step dir (empty list = complete and intact).

    deep=False checks presence and sizes only (fast); deep=True also every sha256.
    """
    root = Path(path)
    try:
        m = read_manifest(root)
    except CheckpointError as e:
        return [str(e)]
    problems = _listed_problems(root, m)
    problems += _check_files(root, m["files"], sorted(m["files"]), deep)
    return problems


def run_of_step(step_dir: PathLike) -> Optional[Path]:
    """The run dir of `<run>/checkpoints/step_N`, else None (a step dir outside a run's layout)."""
    p = Path(step_dir)
    return p.parent.parent if p.parent.name == CKPT_DIR else None


def step_problems(path: PathLike, deep: bool = True) -> list[str]:
    """What makes a step dir unusable for its run: `verify_checkpoint`, and, for a step inside
    `<run>/checkpoints/`, a manifest that names another run (a step copied in from elsewhere).
    The one rule `ckpt verify`, `ckpt list`, resume and keep-N agree on."""
    problems = verify_checkpoint(path, deep=deep)
    run = run_of_step(path)
    if not problems and run is not None:
        owner, run_id = read_manifest(path).get("run_id"), run.resolve().name
        if owner != run_id:
            problems.append(
                f"manifest names run {owner!r}, not {run_id!r} (copied from another run): resume and keep-N ignore it"
            )
    return problems


def scan_steps(run_dir: PathLike, deep: bool = True) -> tuple[Optional[Path], list[tuple[Path, list[str]]]]:
    """(newest usable step of a run or None, [(newer step, its problems)] skipped on the way). Read-only."""
    ck = Path(run_dir) / CKPT_DIR
    if not ck.is_dir():
        return None, []
    cands = sorted((p for p in ck.iterdir() if p.is_dir() and step_of(p) is not None), key=step_number, reverse=True)
    skipped: list[tuple[Path, list[str]]] = []
    for p in cands:
        problems = step_problems(p, deep=deep)
        if not problems:
            return p, skipped
        skipped.append((p, problems))
    return None, skipped


def newest_verified(run_dir: PathLike, deep: bool = True) -> Optional[Path]:
    """Newest step of a run that verifies and names this run. Read-only; not collective.

    The `latest` pointer is not trusted: a save killed between publishing the step and
    updating the pointer leaves it one behind, and a damaged newest step must be skipped.
    Steps are tried newest first; every unusable one is logged with its problems.
    """
    found, skipped = scan_steps(run_dir, deep=deep)
    for p, problems in skipped:
        log.error("checkpoint %s is not usable: %s", p, "; ".join(problems))
    return found


def is_run_dir(path: PathLike) -> bool:
    """A run dir (has checkpoints/), not a step dir (has a manifest)."""
    p = Path(path)
    return (p / CKPT_DIR).is_dir() and not (p / MANIFEST).exists()


def resolve_step(path: PathLike, deep: bool = True) -> Path:
    """The step a path means: a run dir means its newest verified step; anything else is
    returned as given (a step dir, an export dir, a weights file: the caller verifies it).

    Read-only; not collective (a collective caller decides on rank 0 and broadcasts). Every
    newer step skipped on the way is logged with its problems; a run with none raises
    CheckpointError naming each. deep=False checks sizes only (the load hashes every file).
    """
    p = Path(path)
    if not is_run_dir(p):
        return p
    found, skipped = scan_steps(p, deep=deep)
    for s, problems in skipped:
        log.error("checkpoint %s is not usable: %s", s, "; ".join(problems))
    if found is None:
        why = "; ".join(f"{s.name}: {'; '.join(ps)}" for s, ps in skipped) or "no step saved"
        raise CheckpointError(f"{p}: run has no verified checkpoint ({why})")
    return found


def step_dirs(path: PathLike) -> list[Path]:
    """A step dir -> [it]; a run dir -> its published steps (oldest first, not verified)."""
    p = Path(path)
    if (p / MANIFEST).exists() or step_of(p) is not None:
        return [p]
    ck = p / CKPT_DIR
    if ck.is_dir():
        return sorted((s for s in ck.iterdir() if s.is_dir() and step_of(s) is not None), key=step_number)
    raise FileNotFoundError(f"{p}: neither a checkpoint step dir nor a run dir with {CKPT_DIR}/")
