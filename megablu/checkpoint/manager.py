"""CheckpointManager: the DeepSpeed-coupled save / load / keep-N protocol of one run.

A save is collective: every rank writes its files through a recording proxy of DeepSpeed's
checkpoint engine (fsync, read back, size + sha256), the ranks exchange their status, and
rank 0 writes the manifest and publishes the step with one rename -- or every rank raises
CheckpointError and nothing is published. A load verifies every file on all ranks (the
hashing split over them) before any rank calls DeepSpeed. See the package docstring for the
layout and the traps each step answers.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..utils.dist import all_gather_object, broadcast_object, get_rank, get_world_size
from ..utils.files import PathLike, atomic_write_text, fsync_dir, fsync_file, sha256_file
from .layout import (
    CKPT_DIR,
    CLIENT_DIR,
    DS_TAG,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    PIN,
    PRUNED_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    WEIGHTS,
    CheckpointError,
    _check_files,
    _listed_problems,
    _manifest_digest,
    is_run_dir,
    newest_verified,
    read_manifest,
    resolve_step,
    step_name,
    step_number,
    step_of,
    verify_checkpoint,
)
from .weights import save_weights

log = logging.getLogger(__name__)

# config-derived meta fields worth naming when a resume's config hash differs (dp and world
# size are left out: they follow the launch, and a world-size change is resharded)
_CONFIG_META = ("sp", "zero_stage", "model", "rope", "window")


def _jsonable(x: Any) -> Any:
    """client_state summary for the manifest: plain values kept, tensors/arrays described."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x] if len(x) <= 64 else f"<{type(x).__name__} len={len(x)}>"
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else f"<tensor {tuple(x.shape)} {x.dtype}>"
    if isinstance(x, np.ndarray):
        return f"<ndarray {x.shape} {x.dtype}>"
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return f"<{type(x).__name__}>"


def _verify_collective(root: Path) -> list[str]:
    """verify_checkpoint with the hashing split over ranks; identical result on every rank."""
    try:
        m = read_manifest(root)
        names = sorted(m["files"])
        r, w = get_rank(), get_world_size()
        mine = _listed_problems(root, m) if r == 0 else []
        # presence/size for all files on every rank (cheap, and catches per-node views);
        # sha256 only for this rank's share of the files
        mine += _check_files(root, m["files"], names, deep=False)
        sizes_bad = {p.split(" ", 2)[1] for p in mine if p.startswith(("missing ", "size "))}
        share = [n for i, n in enumerate(names) if i % w == r and n not in sizes_bad]
        mine += _check_files(root, m["files"], share, deep=True)
    except CheckpointError as e:
        mine = [str(e)]
    except Exception as e:  # never leave the other ranks waiting in the gather
        mine = [f"rank {get_rank()}: verification failed: {type(e).__name__}: {e}"]
    out: list[str] = []
    for ps in all_gather_object(mine):
        for p in ps:
            if p not in out:
                out.append(p)
    return out


def resolve_step_collective(path: PathLike, deep: bool = True, resolve: Callable = resolve_step) -> Path:
    """`resolve(path, deep)` (default layout.resolve_step; init_from: weights.resolve_parent)
    decided once, on rank 0, and broadcast: a save landing meanwhile cannot give two ranks two
    different steps. Every rank raises rank 0's CheckpointError."""
    found, err = None, None
    if get_rank() == 0:
        try:
            found = str(resolve(path, deep=deep))
        except CheckpointError as e:
            err = str(e)
    found, err = broadcast_object((found, err))
    if err:  # every rank raises, none waits on a collective rank 0 left
        raise CheckpointError(err)
    return Path(found)


def _check_readable(path: PathLike) -> None:
    """Read a just-written torch file back: catches short writes the filesystem did not report.

    torch's zip format carries a CRC32 per member (testzip reads and checks them all); a
    legacy-format file is loaded.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        if not zipfile.is_zipfile(path):
            raise OSError("read-back: not a complete zip archive (short write?)")
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        if bad is not None:
            raise OSError(f"read-back: CRC error in zip member {bad}")
    else:
        torch.load(path, map_location="cpu", weights_only=False)


class _RecordingEngine:
    """Wraps DeepSpeed's checkpoint engine for one save.

    Every `save(state, path)` is fsynced, read back (zip CRC check of torch's format, size,
    sha256) and recorded; an exception is recorded instead of raised so that this rank
    still takes part in DeepSpeed's remaining collectives and no rank hangs. The error is
    raised on every rank after the status exchange.
    """

    def __init__(self, inner, root: Path, phase: Callable[[str], None]):
        self._inner, self._root, self._phase = inner, root, phase
        self.written: dict[str, dict] = {}
        self.errors: list[str] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, state_dict, path):
        rel = Path(path).resolve().relative_to(self._root.resolve()).as_posix()
        if self.errors:  # after a failure write nothing more; the save is void anyway
            return
        try:
            self._phase("ds_write")
            self._inner.save(state_dict, path)
            fsync_file(path)
            _check_readable(path)
            self.written[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        except Exception as e:
            self.errors.append(f"write {rel}: {type(e).__name__}: {e}")


def _consolidated_state(engine) -> Optional[dict]:
    """Full weights on rank 0 (None elsewhere). Collective under ZeRO-3."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    if get_rank() != 0:
        return None
    return engine.module.state_dict()


def _zero_partitions(engine) -> int:
    """How many optimizer shard files DeepSpeed writes: ZeRO 1-3 and the bf16 optimizer
    partition over the (sequence-)data-parallel group; 0 = one full copy in the model file."""
    if not engine.save_zero_checkpoint:
        return 0
    import torch.distributed as dist

    group = getattr(engine.optimizer, "dp_process_group", None)
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _expected_ds_files(engine, root: Path) -> list[str]:
    """DeepSpeed files this rank must have written (checked by rank 0 before the manifest)."""
    out = []
    if engine.save_non_zero_checkpoint:
        out.append(Path(engine._get_ckpt_name(str(root), DS_TAG)).resolve().relative_to(root.resolve()).as_posix())
    if engine.save_zero_checkpoint:
        out.append(Path(engine._get_zero_ckpt_name(str(root), DS_TAG)).resolve().relative_to(root.resolve()).as_posix())
    return out


def _write_client_state(tmp: Path, rank: int, client_state: dict) -> tuple[str, dict]:
    """This rank's trainer state (RNG differs per rank), fsync'd and its size checked: (path relative to
    the step dir, its size and sha256)."""
    rel = f"{CLIENT_DIR}/rank_{rank:05d}.pt"
    buf = io.BytesIO()
    torch.save(client_state, buf)
    data = buf.getvalue()
    with open(tmp / rel, "wb") as f:
        n = f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if n != len(data) or os.path.getsize(tmp / rel) != len(data):
        raise OSError(f"short write: {os.path.getsize(tmp / rel)} of {len(data)} bytes")
    return rel, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class CheckpointManager:
    """Saves, finds, verifies, loads and prunes the checkpoints of one run.

    run_dir: the allocated run directory (its name is the run id).
    keep: how many newest complete unpinned checkpoints keep-N leaves (pinned ones extra).
    keep_every: steps that are positive multiples of it are kept like pinned ones and are not
      counted in `keep` (config checkpoint.keep_every); 0 = off.
    meta: recorded in every manifest and checked on load: config_hash, tokenizer
      (identity), dp, sp, world_size, zero_stage; model/rope (config dicts, for export)
      when given.
    on_phase: optional callback(phase_name) called on every rank at each save phase
      (fault-injection tests kill the process there).
    """

    def __init__(
        self,
        run_dir: PathLike,
        keep: int,
        meta: dict,
        on_phase: Optional[Callable[[str], None]] = None,
        keep_every: int = 0,
    ):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept")
        if keep_every < 0:
            raise ValueError(f"keep_every={keep_every}: must be >= 0 (0 = off)")
        self.run_dir = Path(run_dir)
        self.run_id = self.run_dir.resolve().name
        self.ckpt_dir = self.run_dir / CKPT_DIR
        self.keep = keep
        self.keep_every = keep_every
        self.meta = dict(meta)
        self.on_phase = on_phase
        self.loaded_manifest: Optional[dict] = None
        self._cleaned = False  # leftovers are removed by this run's first save, never by a reader

    # ------------------------------------------------------------------ listing
    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def steps(self) -> list[Path]:
        """Published step dirs, oldest first (not verified)."""
        if not self.ckpt_dir.is_dir():
            return []
        return sorted((p for p in self.ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None), key=step_number)

    def cleanup(self) -> None:
        """Remove leftovers of killed saves/prunes (.tmp-*, .trash-*, .pruned-*). Rank 0, not during a save.

        A complete `.trash-step_N-*` whose step_N is absent is put back first: a re-save of
        an existing step moves the old one aside before publishing the new one, and a kill
        between the two renames must not lose it.
        """
        if not self.ckpt_dir.is_dir():
            return
        for p in sorted(self.ckpt_dir.iterdir()):
            if p.name.startswith(TRASH_PREFIX):
                step = self.ckpt_dir / p.name[len(TRASH_PREFIX) :].rsplit("-", 1)[0]
                if step_of(step) is not None and not step.exists() and not verify_checkpoint(p):
                    log.warning("restoring %s from %s (a save was killed while replacing it)", step, p)
                    os.replace(p, step)
                    continue
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX, PRUNED_PREFIX)):
                log.info("removing leftover %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def latest(self, deep: bool = True) -> Optional[Path]:
        """Newest verified checkpoint of this run. Read-only; not collective."""
        return newest_verified(self.run_dir, deep=deep)

    def resume_point(self) -> Optional[Path]:
        """The step a resuming run loads: first, as the run's owner, clear what a killed save
        or prune left (and put back a step that a killed re-save had moved aside), then the
        newest verified one. Rank 0 only. The first save would clear them too, but a run
        killed in its last save never saves again."""
        self.cleanup()
        self._cleaned = True
        return self.latest()

    # ------------------------------------------------------------------ save
    def save(self, engine, step: int, client_state: dict, pin: bool = False) -> Path:
        """Collective. Publish step_<step> or raise CheckpointError on every rank."""
        rank, world = get_rank(), get_world_size()
        name = step_name(step)
        final = self.ckpt_dir / name
        tmp = self.ckpt_dir / f"{TMP_PREFIX}{name}"
        t0 = time.time()

        # -- prepare: rank 0 makes a fresh temp dir; the gather doubles as a barrier
        self._phase("prepare")
        err = None
        if rank == 0:
            try:
                self._fresh_tmp(tmp)
            except Exception as e:
                err = f"rank 0: cannot create {tmp}: {type(e).__name__}: {e}"
        self._raise_if_any(all_gather_object(err), name, tmp)

        # -- consolidated weights (collective under ZeRO-3, so outside any try on one rank)
        self._phase("gather_weights")
        errors: list[str] = []
        try:
            full_sd = _consolidated_state(engine)
        except Exception as e:
            full_sd, errors = None, [f"gather weights: {type(e).__name__}: {e}"]

        # -- DeepSpeed's own files, every write recorded
        self._phase("ds_save")
        rec = _RecordingEngine(engine.checkpoint_engine, tmp, self._phase)
        engine.checkpoint_engine = rec
        try:
            engine.save_checkpoint(str(tmp), tag=DS_TAG, client_state={"megablu_step": step}, save_latest=False)
        except Exception as e:
            errors.append(f"engine.save_checkpoint: {type(e).__name__}: {e}")
        finally:
            engine.checkpoint_engine = rec._inner
        errors += rec.errors
        expected = _expected_ds_files(engine, tmp)

        # -- this rank's trainer state (RNG differs per rank)
        self._phase("client_state")
        written = dict(rec.written)
        if not errors:
            try:
                rel, record = _write_client_state(tmp, rank, client_state)
                written[rel] = record
            except Exception as e:
                errors.append(f"write client_state: {type(e).__name__}: {e}")

        # -- consolidated safetensors (rank 0)
        self._phase("weights")
        if rank == 0 and not errors:
            try:
                assert full_sd is not None  # rank 0 gathered it above
                save_weights(full_sd, tmp / WEIGHTS, {"step": step, "run_id": self.run_id})
                written[WEIGHTS] = {"size": os.path.getsize(tmp / WEIGHTS), "sha256": sha256_file(tmp / WEIGHTS)}
            except Exception as e:
                errors.append(f"write {WEIGHTS}: {type(e).__name__}: {e}")
        del full_sd

        # -- every rank's status; any failure -> all raise
        self._phase("status")
        status = all_gather_object({"rank": rank, "errors": errors, "written": written, "expected": expected})
        self._raise_if_any(
            [("; ".join(s["errors"]) and f"rank {s['rank']}: " + "; ".join(s["errors"])) or None for s in status],
            name,
            tmp,
        )

        # -- rank 0: cross-check, manifest, publish, pointer, prune
        err, published = None, False
        if rank == 0:
            try:
                self._phase("manifest")
                self._write_manifest(engine, tmp, step, client_state, pin, status, world)
                self._phase("publish")
                self._publish(tmp, final)
                published = True
                self._phase("latest")
                atomic_write_text(self.ckpt_dir / LATEST, name + "\n")
                self._phase("prune")
                self.prune(newest=final)
            except Exception as e:
                err = f"rank 0: {type(e).__name__}: {e}"
        err, published = broadcast_object((err, published))
        if err and published:  # the step is complete and verified; what followed failed
            raise CheckpointError(f"save {self.run_id}/{name}: step published, then failed: {err}")
        self._raise_if_any([err], name, tmp)
        self._phase("done")
        if rank == 0:
            log.info("saved %s (%.1fs)", final, time.time() - t0)
        return final

    def _fresh_tmp(self, tmp: Path) -> None:
        """Rank 0: an empty temp step dir, with its client-state folder."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if not self._cleaned:  # leftovers of a killed save/prune of this run
            self.cleanup()
            self._cleaned = True
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / CLIENT_DIR).mkdir(parents=True)

    def _raise_if_any(self, errs: list, name: str, tmp: Optional[Path]) -> None:
        errs = [e for e in errs if e]
        if not errs:
            return
        if get_rank() == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"save {self.run_id}/{name} failed; nothing published: " + " | ".join(errs))

    def _write_manifest(
        self, engine, tmp: Path, step: int, client_state: dict, pin: bool, status: list, world: int
    ) -> None:
        files: dict[str, dict] = {}
        for s in status:
            for rel in s["expected"]:
                if rel not in s["written"]:
                    raise CheckpointError(f"rank {s['rank']} did not record writing {rel}")
            files.update(s["written"])
        # every recorded file must be visible here with the writer's size (a shared filesystem)
        for rel, ent in files.items():
            p = tmp / rel
            if not p.is_file() or p.stat().st_size != ent["size"]:
                raise CheckpointError(
                    f"{rel}: written by a rank but missing or of another size on rank 0 "
                    f"(checkpoint dirs must be on a filesystem shared by all ranks)"
                )
        # files written outside the checkpoint engine (DeepSpeed's recovery scripts)
        for p in sorted(tmp.rglob("*")):
            rel = p.relative_to(tmp).as_posix()
            if p.is_file() and rel not in files:
                files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        parts = _zero_partitions(engine)
        n_optim = sum(1 for r in files if r.startswith(f"{DS_TAG}/") and r.endswith("optim_states.pt"))
        if n_optim != parts:
            raise CheckpointError(f"{n_optim} optimizer shards written, expected {parts} ZeRO partitions")
        m = {
            "format": FORMAT_VERSION,
            "run_id": self.run_id,
            "step": step,
            "created_unix": time.time(),
            "world_size": world,
            "dp": self.meta.get("dp"),
            "sp": self.meta.get("sp"),
            "zero_stage": int(engine.zero_optimization_stage()),
            "zero_partitions": parts,
            "config_hash": self.meta.get("config_hash"),
            "tokenizer": self.meta.get("tokenizer"),
            "meta": _jsonable(self.meta),
            "pinned": bool(pin),
            "client_state": _jsonable({k: v for k, v in client_state.items() if k != "rng"}),
            "files": dict(sorted(files.items())),
        }
        m["manifest_sha256"] = _manifest_digest(m)
        atomic_write_text(tmp / MANIFEST, json.dumps(m, indent=1) + "\n")
        if pin:
            (tmp / PIN).write_text("pinned at save\n")
        fsync_dir(tmp)

    def _publish(self, tmp: Path, final: Path) -> None:
        """rename(tmp, final); an existing final (same step saved again) is moved aside first."""
        trash = None
        if final.exists():
            trash = self.ckpt_dir / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
            os.replace(final, trash)
            self._phase("replace")  # a kill here leaves both aside; cleanup() restores the old one
        os.replace(tmp, final)
        fsync_dir(self.ckpt_dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ keep-N
    def _kept_by_every(self, p: Path) -> bool:
        """A step keep_every keeps: a positive multiple of it."""
        s = step_number(p)
        return self.keep_every > 0 and s > 0 and s % self.keep_every == 0

    def prune(self, newest: Optional[Path] = None) -> list[Path]:
        """Delete this run's complete checkpoints beyond the newest `keep`. Pinned steps and
        keep_every's steps stay and are not counted; the newest is always kept and counted,
        unless keep_every keeps it.

        Only dirs named step_N inside this run's checkpoints dir, whose manifest is intact,
        names this run and lists files that are all present with their sizes, and that are
        older than `newest` (the step just published, or the newest verified one).
        Returns what was deleted.
        """
        newest = newest or self.latest(deep=True)
        if newest is None:
            return []
        complete = []
        for p in self.steps():
            if step_number(p) >= step_number(newest) and p != newest:
                continue
            problems = verify_checkpoint(p, deep=False)
            if problems:
                log.warning("keep-N: %s is incomplete, left alone: %s", p, "; ".join(problems))
                continue
            if read_manifest(p).get("run_id") != self.run_id:
                log.warning("keep-N: %s names another run, left alone", p)
                continue
            complete.append(p)
        rotating = [p for p in complete if not (p / PIN).exists() and not self._kept_by_every(p) and p != newest]
        # newest is always kept; it counts toward keep unless keep_every keeps it anyway
        n_keep_more = self.keep - (0 if self._kept_by_every(newest) else 1)
        victims = rotating[: max(0, len(rotating) - n_keep_more)]
        for p in victims:
            trash = self.ckpt_dir / f"{PRUNED_PREFIX}{p.name}-{os.getpid()}"
            os.replace(p, trash)  # atomic: a kill leaves a dot-dir, never a half step
            self._phase("trashed")  # a kill here leaves the dot-dir: the next save or resume removes it
            shutil.rmtree(trash)
            log.info("keep-N(%d): deleted %s", self.keep, p)
        return victims

    # ------------------------------------------------------------------ load
    def check_compatible(self, m: dict, allow_config_change: bool = False) -> None:
        """Same tokenizer (always) and config hash (unless allowed) as this run."""
        keys = ("tokenizer",) if allow_config_change else ("tokenizer", "config_hash")
        for key in keys:
            mine, theirs = self.meta.get(key), m.get(key)
            if mine is not None and theirs is not None and mine != theirs:
                hint = (
                    "a checkpoint is only valid with the tokenizer it was trained with"
                    if key == "tokenizer"
                    else "resume with the run's config.resolved.yaml, pass allow_config_change=True "
                    "for a deliberate change, or use init_from (weights only)"
                )
                if key == "config_hash":
                    # name what differs among the fields the manifest records (a changed sp or
                    # ZeRO stage is the usual reason; the hash alone says nothing)
                    saved, now = m.get("meta") or {}, _jsonable(self.meta)
                    diff = []
                    for k in _CONFIG_META:
                        a, b = saved.get(k), now.get(k)
                        if k not in saved or k not in now or a == b:
                            continue
                        if isinstance(a, dict) and isinstance(b, dict):  # model/rope: the fields that differ
                            diff += [
                                f"{k}.{j} saved {a.get(j)!r}, now {b.get(j)!r}"
                                for j in sorted(set(a) | set(b))
                                if a.get(j) != b.get(j)
                            ]
                        else:
                            diff.append(f"{k} saved {a!r}, now {b!r}")
                    if diff:
                        hint = "differs: " + "; ".join(diff) + "; " + hint
                raise CheckpointError(f"checkpoint {key}={theirs!r} but this run has {key}={mine!r}; {hint}")

    def load(self, engine, path: PathLike, load_optimizer: bool = True, allow_config_change: bool = False) -> dict:
        """Collective. Verify everything on all ranks, then DeepSpeed load; returns client_state.

        A run dir may be given (its newest verified step is used). A different ZeRO
        partition count (world size) is resharded; a different ZeRO stage is refused.
        """
        root = Path(path)
        if is_run_dir(root):
            root = resolve_step_collective(root)
        problems = _verify_collective(root)
        if problems:
            raise CheckpointError(f"{root}: refusing to load, checkpoint is not intact: " + "; ".join(problems))
        m = read_manifest(root)
        self.check_compatible(m, allow_config_change)
        stage = int(engine.zero_optimization_stage())
        if m["zero_stage"] != stage:
            raise CheckpointError(
                f"{root}: saved with ZeRO stage {m['zero_stage']}, this run uses {stage}; "
                f"resume needs the same stage (init_from loads weights for any stage)"
            )
        parts = _zero_partitions(engine)
        if m["zero_partitions"] == parts:
            load_path, _ = engine.load_checkpoint(
                str(root),
                tag=DS_TAG,
                load_module_strict=True,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=load_optimizer,
            )
        else:
            # another data-parallel world: DeepSpeed's universal checkpoint reshards the
            # optimizer (per-parameter fp32 master, exp_avg, exp_avg_sq, step)
            log.warning(
                "%s: %d ZeRO partitions saved (world %s, dp %s, sp %s), %d now (world %d): "
                "resharding through a universal checkpoint",
                root,
                m["zero_partitions"],
                m["world_size"],
                m["dp"],
                m["sp"],
                parts,
                get_world_size(),
            )
            load_path = self._load_resharded(engine, root, m, load_optimizer)
        if load_path is None:
            raise CheckpointError(f"{root}: DeepSpeed could not load the checkpoint")
        # per-rank trainer state: this rank's file when the world size matches, else rank 0's
        r = get_rank() if m["world_size"] == get_world_size() else 0
        if m["world_size"] != get_world_size():
            log.warning(
                "world size %d -> %d: per-rank RNG states are taken from rank 0", m["world_size"], get_world_size()
            )
        client = torch.load(root / CLIENT_DIR / f"rank_{r:05d}.pt", map_location="cpu", weights_only=False)
        self.loaded_manifest = m
        return client

    def _load_resharded(self, engine, root: Path, m: dict, load_optimizer: bool):
        """Convert root/ds to a universal checkpoint (rank 0), then every rank loads its share."""
        import argparse
        import contextlib
        import sys

        udir = self.ckpt_dir / f"{TMP_PREFIX}universal-{root.name}-{m['manifest_sha256'][:12]}"
        err = None
        if get_rank() == 0:
            try:
                from deepspeed.checkpoint import ds_to_universal

                shutil.rmtree(udir, ignore_errors=True)
                args = argparse.Namespace(
                    input_folder=str(root / DS_TAG),
                    output_folder=str(udir / DS_TAG),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    no_strict=False,
                    inject_missing_state=True,
                )
                with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout is for results
                    ds_to_universal.main(args)
            except BaseException as e:  # SystemExit included: the converter exits on bad input
                err = f"rank 0: universal conversion of {root / DS_TAG} failed: {type(e).__name__}: {e}"
        errs = [e for e in all_gather_object(err) if e]
        if errs:
            raise CheckpointError(
                f"{root}: cannot reshard {m['zero_partitions']} -> {_zero_partitions(engine)} "
                f"ZeRO partitions: {' | '.join(errs)}; resume with the saved world size "
                f"(world {m['world_size']}, dp {m['dp']}, sp {m['sp']}) or use init_from"
            )
        cfg = engine._config
        cfg.load_universal_checkpoint = True
        try:
            load_path, _ = engine.load_checkpoint(
                str(udir),
                tag=DS_TAG,
                load_module_strict=True,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=load_optimizer,
            )
        finally:
            cfg.load_universal_checkpoint = False
        all_gather_object(None)  # every rank has read the universal files
        if get_rank() == 0:
            shutil.rmtree(udir, ignore_errors=True)
        return load_path
