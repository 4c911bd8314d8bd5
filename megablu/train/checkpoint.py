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

The seed's traps and what makes each impossible here:
- a 3-of-4 shard set loaded silently: the manifest names every file (and rank 0 checks
  that every rank's DeepSpeed files exist with the size its writer recorded before the
  manifest is written); `load` checks every file's size and sha256 on all ranks before
  any rank calls DeepSpeed, and refuses naming the files.
- a failed save only warned: every write goes through a recording proxy of DeepSpeed's
  checkpoint engine that catches the error instead of leaving the other ranks in a
  collective; the ranks then exchange their status and every rank raises CheckpointError.
- keep-N pruned another run's shard: pruning looks only inside this run's directory and
  only at complete steps whose manifest names this run; never the newest, never pinned.
- kill -9 at any point: a step is visible only after `rename(.tmp-step, step)`, and
  `latest()` trusts nothing it has not verified, so the newest complete step wins.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
LATEST = "latest"
PIN = "pinned"
DS_TAG = "ds"
CLIENT_DIR = "client_state"
CKPT_DIR = "checkpoints"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"     # replaced by a re-save: restored by cleanup() if nothing took its place
PRUNED_PREFIX = ".pruned-"   # deleted by keep-N: never restored
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{7,})$")
# config-derived meta fields worth naming when a resume's config hash differs (dp and world
# size are left out: they follow the launch, and a world-size change is resharded)
_CONFIG_META = ("sp", "zero_stage", "model", "rope", "window")
# files that may sit in a step dir without being in its manifest
_UNLISTED_OK = {MANIFEST, PIN}

PathLike = Union[str, Path]


class CheckpointError(Exception):
    """A checkpoint could not be saved, verified or loaded. Never just a warning."""


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: PathLike) -> Optional[int]:
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- RNG
def get_rng_state() -> dict:
    """python / numpy / torch (+cuda) generator states, for exact resume."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# --------------------------------------------------------------------------- small helpers
def sha256_file(path: PathLike, bufsize: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _fsync_file(path: PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: PathLike) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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


def _manifest_digest(m: dict) -> str:
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- distributed
def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def _all_gather(obj: Any) -> list:
    d = _dist()
    if d is None:
        return [obj]
    out = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def _bcast(obj: Any) -> Any:
    d = _dist()
    if d is None:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------- verification
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
        raise CheckpointError(f"{path} is a megablu dataset (its {MANIFEST} is a data manifest), not a checkpoint; "
                              f"a dataset goes in data.path, a parent in init_from (a run dir, a step dir or an "
                              f"exported model dir)")
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


def _verify_collective(root: Path) -> list[str]:
    """verify_checkpoint with the hashing split over ranks; identical result on every rank."""
    try:
        m = read_manifest(root)
        names = sorted(m["files"])
        r, w = _rank(), _world()
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
        mine = [f"rank {_rank()}: verification failed: {type(e).__name__}: {e}"]
    out: list[str] = []
    for ps in _all_gather(mine):
        for p in ps:
            if p not in out:
                out.append(p)
    return out


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
            problems.append(f"manifest names run {owner!r}, not {run_id!r} (copied from another run): resume and "
                            f"keep-N ignore it")
    return problems


def scan_steps(run_dir: PathLike, deep: bool = True) -> tuple[Optional[Path], list[tuple[Path, list[str]]]]:
    """(newest usable step of a run or None, [(newer step, its problems)] skipped on the way). Read-only."""
    ck = Path(run_dir) / CKPT_DIR
    if not ck.is_dir():
        return None, []
    cands = sorted((p for p in ck.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of, reverse=True)
    skipped = []
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


# --------------------------------------------------------------------------- save internals
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
            _fsync_file(path)
            _check_readable(path)
            self.written[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        except Exception as e:
            self.errors.append(f"write {rel}: {type(e).__name__}: {e}")


def _consolidated_state(engine) -> Optional[dict]:
    """Full weights on rank 0 (None elsewhere). Collective under ZeRO-3."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    if _rank() != 0:
        return None
    return engine.module.state_dict()


def save_weights(sd: dict, path: PathLike, extra_meta: Optional[dict] = None) -> None:
    """safetensors file of a state dict; tensors sharing storage are stored once + alias."""
    from safetensors.torch import save_file

    tensors, aliases, seen = {}, {}, {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        tensors[k] = v.detach().to("cpu").contiguous()
    meta = {"format": "pt", "aliases": json.dumps(aliases)}
    meta.update({k: str(v) for k, v in (extra_meta or {}).items()})
    save_file(tensors, str(path), metadata=meta)
    _fsync_file(path)


def _zero_partitions(engine) -> int:
    """How many optimizer shard files DeepSpeed writes: ZeRO 1-3 and the bf16 optimizer
    partition over the (sequence-)data-parallel group; 0 = one full copy in the model file."""
    if not engine.save_zero_checkpoint:
        return 0
    d = _dist()
    group = getattr(engine.optimizer, "dp_process_group", None)
    return d.get_world_size(group) if d else 1


def _expected_ds_files(engine, root: Path) -> list[str]:
    """DeepSpeed files this rank must have written (checked by rank 0 before the manifest)."""
    out = []
    if engine.save_non_zero_checkpoint:
        out.append(Path(engine._get_ckpt_name(str(root), DS_TAG)).resolve().relative_to(root.resolve()).as_posix())
    if engine.save_zero_checkpoint:
        out.append(Path(engine._get_zero_ckpt_name(str(root), DS_TAG)).resolve().relative_to(root.resolve()).as_posix())
    return out


# --------------------------------------------------------------------------- manager
class CheckpointManager:
    """Saves, finds, verifies, loads and prunes the checkpoints of one run.

    run_dir: the allocated run directory (its name is the run id).
    keep: how many newest complete unpinned checkpoints keep-N leaves (pinned ones extra).
    meta: recorded in every manifest and checked on load: config_hash, tokenizer
      (identity), dp, sp, world_size, zero_stage; model/rope (config dicts, for export)
      when given.
    on_phase: optional callback(phase_name) called on every rank at each save phase
      (fault-injection tests kill the process there).
    """

    PHASES = ("prepare", "gather_weights", "ds_save", "ds_write", "client_state", "weights", "status", "manifest",
              "publish", "replace", "latest", "prune", "done")

    def __init__(self, run_dir: PathLike, keep: int, meta: dict,
                 on_phase: Optional[Callable[[str], None]] = None):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept")
        self.run_dir = Path(run_dir)
        self.run_id = self.run_dir.resolve().name
        self.ckpt_dir = self.run_dir / CKPT_DIR
        self.keep = keep
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
        return sorted((p for p in self.ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None),
                      key=lambda p: step_of(p))

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
                step = self.ckpt_dir / p.name[len(TRASH_PREFIX):].rsplit("-", 1)[0]
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
        rank, world = _rank(), _world()
        name = step_name(step)
        final = self.ckpt_dir / name
        tmp = self.ckpt_dir / f"{TMP_PREFIX}{name}"
        t0 = time.time()

        # -- prepare: rank 0 makes a fresh temp dir; the gather doubles as a barrier
        self._phase("prepare")
        err = None
        if rank == 0:
            try:
                self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                if not self._cleaned:  # leftovers of a killed save/prune of this run
                    self.cleanup()
                    self._cleaned = True
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / CLIENT_DIR).mkdir(parents=True)
            except Exception as e:
                err = f"rank 0: cannot create {tmp}: {type(e).__name__}: {e}"
        self._raise_if_any(_all_gather(err), name, tmp)

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
                written[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            except Exception as e:
                errors.append(f"write client_state: {type(e).__name__}: {e}")

        # -- consolidated safetensors (rank 0)
        self._phase("weights")
        if rank == 0 and not errors:
            try:
                save_weights(full_sd, tmp / WEIGHTS, {"step": step, "run_id": self.run_id})
                written[WEIGHTS] = {"size": os.path.getsize(tmp / WEIGHTS), "sha256": sha256_file(tmp / WEIGHTS)}
            except Exception as e:
                errors.append(f"write {WEIGHTS}: {type(e).__name__}: {e}")
        del full_sd

        # -- every rank's status; any failure -> all raise
        self._phase("status")
        status = _all_gather({"rank": rank, "errors": errors, "written": written, "expected": expected})
        self._raise_if_any([("; ".join(s["errors"]) and f"rank {s['rank']}: " + "; ".join(s["errors"]))
                            or None for s in status], name, tmp)

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
                _atomic_write_text(self.ckpt_dir / LATEST, name + "\n")
                self._phase("prune")
                self.prune(newest=final)
            except Exception as e:
                err = f"rank 0: {type(e).__name__}: {e}"
        err, published = _bcast((err, published))
        if err and published:  # the step is complete and verified; what followed failed
            raise CheckpointError(f"save {self.run_id}/{name}: step published, then failed: {err}")
        self._raise_if_any([err], name, tmp)
        self._phase("done")
        if rank == 0:
            log.info("saved %s (%.1fs)", final, time.time() - t0)
        return final

    def _raise_if_any(self, errs: list, name: str, tmp: Optional[Path]) -> None:
        errs = [e for e in errs if e]
        if not errs:
            return
        if _rank() == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"save {self.run_id}/{name} failed; nothing published: " + " | ".join(errs))

    def _write_manifest(self, engine, tmp: Path, step: int, client_state: dict, pin: bool,
                        status: list, world: int) -> None:
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
                raise CheckpointError(f"{rel}: written by a rank but missing or of another size on rank 0 "
                                      f"(checkpoint dirs must be on a filesystem shared by all ranks)")
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
            "format": FORMAT_VERSION, "run_id": self.run_id, "step": step, "created_unix": time.time(),
            "world_size": world, "dp": self.meta.get("dp"), "sp": self.meta.get("sp"),
            "zero_stage": int(engine.zero_optimization_stage()), "zero_partitions": parts,
            "config_hash": self.meta.get("config_hash"), "tokenizer": self.meta.get("tokenizer"),
            "meta": _jsonable(self.meta), "pinned": bool(pin),
            "client_state": _jsonable({k: v for k, v in client_state.items() if k != "rng"}),
            "files": dict(sorted(files.items())),
        }
        m["manifest_sha256"] = _manifest_digest(m)
        _atomic_write_text(tmp / MANIFEST, json.dumps(m, indent=1) + "\n")
        if pin:
            (tmp / PIN).write_text("pinned at save\n")
        _fsync_dir(tmp)

    def _publish(self, tmp: Path, final: Path) -> None:
        """rename(tmp, final); an existing final (same step saved again) is moved aside first."""
        trash = None
        if final.exists():
            trash = self.ckpt_dir / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
            os.replace(final, trash)
            self._phase("replace")  # a kill here leaves both aside; cleanup() restores the old one
        os.replace(tmp, final)
        _fsync_dir(self.ckpt_dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ keep-N
    def pin(self, step_dir: PathLike) -> None:
        (Path(step_dir) / PIN).write_text("pinned\n")

    def prune(self, newest: Optional[Path] = None) -> list[Path]:
        """Delete this run's complete checkpoints beyond the newest `keep` (pinned ones stay).

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
            if step_of(p) >= step_of(newest) and p != newest:
                continue
            problems = verify_checkpoint(p, deep=False)
            if problems:
                log.warning("keep-N: %s is incomplete, left alone: %s", p, "; ".join(problems))
                continue
            if read_manifest(p).get("run_id") != self.run_id:
                log.warning("keep-N: %s names another run, left alone", p)
                continue
            complete.append(p)
        unpinned = [p for p in complete if not (p / PIN).exists() and p != newest]
        n_keep_more = self.keep - 1  # newest is always kept and counts
        victims = unpinned[:max(0, len(unpinned) - n_keep_more)]
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
                hint = ("a checkpoint is only valid with the tokenizer it was trained with" if key == "tokenizer"
                        else "resume with the run's config.resolved.yaml, pass allow_config_change=True "
                             "for a deliberate change, or use init_from (weights only)")
                if key == "config_hash":
                    # name what differs among the fields the manifest records (a changed sp or
                    # ZeRO stage is the usual reason; the hash alone says nothing)
                    saved, now = m.get("meta") or {}, _jsonable(self.meta)
                    diff = []
                    for k in _CONFIG_META:
                        a, b = saved.get(k), now.get(k)
                        if k not in saved or k not in now or a == b:
                            continue
                        if isinstance(a, dict) and isinstance(b, dict):   # model/rope: the fields that differ
                            diff += [f"{k}.{j} saved {a.get(j)!r}, now {b.get(j)!r}"
                                     for j in sorted(set(a) | set(b)) if a.get(j) != b.get(j)]
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
        if not (root / MANIFEST).exists() and (root / CKPT_DIR).is_dir():
            newest = newest_verified(root) if _rank() == 0 else None
            newest = _bcast(str(newest) if newest else None)
            if newest is None:
                raise CheckpointError(f"{root}: no verified checkpoint in this run")
            root = Path(newest)
        problems = _verify_collective(root)
        if problems:
            raise CheckpointError(f"{root}: refusing to load, checkpoint is not intact: " + "; ".join(problems))
        m = read_manifest(root)
        self.check_compatible(m, allow_config_change)
        stage = int(engine.zero_optimization_stage())
        if m["zero_stage"] != stage:
            raise CheckpointError(f"{root}: saved with ZeRO stage {m['zero_stage']}, this run uses {stage}; "
                                  f"resume needs the same stage (init_from loads weights for any stage)")
        parts = _zero_partitions(engine)
        if m["zero_partitions"] == parts:
            load_path, _ = engine.load_checkpoint(str(root), tag=DS_TAG, load_module_strict=True,
                                                  load_optimizer_states=load_optimizer,
                                                  load_lr_scheduler_states=load_optimizer)
        else:
            # another data-parallel world: DeepSpeed's universal checkpoint reshards the
            # optimizer (per-parameter fp32 master, exp_avg, exp_avg_sq, step)
            log.warning("%s: %d ZeRO partitions saved (world %s, dp %s, sp %s), %d now (world %d): "
                        "resharding through a universal checkpoint", root, m["zero_partitions"],
                        m["world_size"], m["dp"], m["sp"], parts, _world())
            load_path = self._load_resharded(engine, root, m, load_optimizer)
        if load_path is None:
            raise CheckpointError(f"{root}: DeepSpeed could not load the checkpoint")
        # per-rank trainer state: this rank's file when the world size matches, else rank 0's
        r = _rank() if m["world_size"] == _world() else 0
        if m["world_size"] != _world():
            log.warning("world size %d -> %d: per-rank RNG states are taken from rank 0", m["world_size"], _world())
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
        if _rank() == 0:
            try:
                from deepspeed.checkpoint import ds_to_universal

                shutil.rmtree(udir, ignore_errors=True)
                args = argparse.Namespace(input_folder=str(root / DS_TAG), output_folder=str(udir / DS_TAG),
                                          num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                          strict=True, no_strict=False, inject_missing_state=True)
                with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout is for results
                    ds_to_universal.main(args)
            except BaseException as e:  # SystemExit included: the converter exits on bad input
                err = f"rank 0: universal conversion of {root / DS_TAG} failed: {type(e).__name__}: {e}"
        errs = [e for e in _all_gather(err) if e]
        if errs:
            raise CheckpointError(f"{root}: cannot reshard {m['zero_partitions']} -> {_zero_partitions(engine)} "
                                  f"ZeRO partitions: {' | '.join(errs)}; resume with the saved world size "
                                  f"(world {m['world_size']}, dp {m['dp']}, sp {m['sp']}) or use init_from")
        cfg = engine._config
        cfg.load_universal_checkpoint = True
        try:
            load_path, _ = engine.load_checkpoint(str(udir), tag=DS_TAG, load_module_strict=True,
                                                  load_optimizer_states=load_optimizer,
                                                  load_lr_scheduler_states=load_optimizer)
        finally:
            cfg.load_universal_checkpoint = False
        _all_gather(None)  # every rank has read the universal files
        if _rank() == 0:
            shutil.rmtree(udir, ignore_errors=True)
        return load_path


# --------------------------------------------------------------------------- weights (init_from, export)
INDEX = "model.safetensors.index.json"
_PARENT_KINDS = ("a run dir, a checkpoint step dir, an exported or transformers model dir, a .safetensors file or "
                 "a model.safetensors.index.json")


def resolve_parent(path: PathLike, deep: bool = True) -> Path:
    """What an init_from / eval path means: a run dir -> its newest verified step (`scan_steps`,
    the rule resume and `ckpt` use too), anything else -> itself. The weights (`resolve_weights`)
    and the record (`parent_record`) are both read from this one path, so they cannot come from
    two different steps. deep=False checks the steps by size only. Raises CheckpointError."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"init_from {p}: no such file or directory")
    if p.is_dir() and (p / CKPT_DIR).is_dir() and not (p / MANIFEST).exists():
        newest, skipped = scan_steps(p, deep=deep)
        if newest is None:
            why = "; ".join(f"{s.name}: {'; '.join(ps)}" for s, ps in skipped) or "no step saved"
            raise CheckpointError(f"init_from {p}: run has no verified checkpoint ({why})")
        for s, ps in skipped:
            log.error("checkpoint %s is not usable: %s", s, "; ".join(ps))
        log.info("init_from %s: newest verified step is %s", p, newest.name)
        return newest
    return p


def resolve_weights(path: PathLike, deep: bool = True) -> tuple[list[Path], Optional[dict]]:
    """safetensors files for a step dir, a run dir (newest verified), an export dir, a weights
    file or a sharded model's index file.

    Returns (files, manifest or None). Raises CheckpointError with what was looked for.
    deep=False checks a step's files by size only (the load itself hashes them).
    """
    p = resolve_parent(path, deep=deep)
    if p.is_file():
        if p.name.endswith(".safetensors"):
            return [p], None
        if p.name.endswith(".safetensors.index.json"):
            return _index_shards(p), None
        raise CheckpointError(f"init_from {p}: {p.name} is not safetensors weights; give {_PARENT_KINDS}")
    if not p.is_dir():
        raise CheckpointError(f"init_from {p}: no such file or directory")
    m = None
    if (p / MANIFEST).exists():
        problems = verify_checkpoint(p, deep=deep)
        if problems:
            raise CheckpointError(f"init_from {p}: not intact: " + "; ".join(problems))
        m = read_manifest(p)
    if (p / WEIGHTS).is_file():
        return [p / WEIGHTS], m
    if (p / INDEX).is_file():
        return _index_shards(p / INDEX), m
    raise CheckpointError(f"init_from {p}: no {WEIGHTS} or {INDEX} (expected {_PARENT_KINDS})")


def _index_shards(idx: Path) -> list[Path]:
    """The shard files a (transformers) model.safetensors.index.json names, beside it."""
    try:
        shards = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"init_from {idx}: not a readable safetensors index ({type(e).__name__}: {e})") from None
    missing = [s for s in shards if not (idx.parent / s).is_file()]
    if missing or not shards:
        raise CheckpointError(f"init_from {idx}: index names missing shards {missing}" if missing else
                              f"init_from {idx}: index names no shard")
    return [idx.parent / s for s in shards]


def parent_record(path: PathLike, deep: bool = True):
    """What an init_from parent records about its training: a `ParentRecord` (window, rope, source).

    Read from the step `resolve_parent` gives (a run dir: its newest verified step, the one the
    weights are loaded from): its manifest, the run's config.resolved.yaml for manifests older
    than the meta, an export's or a transformers dir's config.json, or the same beside a weights
    file. A record that is absent gives window/rope None; a record that cannot be read raises
    CheckpointError. deep=False: the run's steps checked by size only.
    """
    import yaml

    from ..config.lineage import ParentRecord
    from ..config.schema import RopeConfig

    p = resolve_parent(path, deep=deep)
    d = p.parent if p.is_file() else p
    if (d / MANIFEST).exists():
        meta = read_manifest(d).get("meta", {})
        rope, window, src = meta.get("rope"), meta.get("window"), f"{d}/{MANIFEST}"
        cfg_file = d.parent.parent / "config.resolved.yaml"
        if (rope is None or window is None) and cfg_file.is_file():
            raw = yaml.safe_load(cfg_file.read_text()) or {}
            rope, window = rope or raw.get("rope"), window or (raw.get("data") or {}).get("window")
            src = str(cfg_file)
        try:
            return ParentRecord(src, int(window) if window else None, RopeConfig(**rope) if rope else None)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"init_from {src}: unreadable rope record {rope!r}: {e}") from None
    cj = d / "config.json"
    if cj.is_file():
        from ..model.hf import rope_record_from_hf

        try:
            rope, window = rope_record_from_hf(json.loads(cj.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"init_from {cj}: cannot read the parent's rope: {e}") from None
        return ParentRecord(str(cj), window, rope)
    return ParentRecord(str(p), None, None)


def read_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """State dict in BluModel names (HF `model.` prefix stripped, aliases restored)."""
    return read_weights_and_provenance(path)[0]


def _provenance(first: Path, m: Optional[dict]) -> dict:
    """tokenizer / run_id / step recorded beside the weights: the step's manifest, or an export's
    megablu_export.json (also for a weights file given inside such a dir); {} for foreign weights."""
    if m is None:
        d = first.parent
        if (d / MANIFEST).is_file():
            m = read_manifest(d)
        elif (d / "megablu_export.json").is_file():
            m = json.loads((d / "megablu_export.json").read_text())
    return {k: m.get(k) for k in ("tokenizer", "run_id", "step")} if m else {}


def _read_safetensors(files: list[Path], get) -> dict:
    """{BluModel name: get(handle, file key)} over the files; HF `model.` prefix stripped, aliases restored."""
    from safetensors import safe_open

    sd: dict = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata() or {}
            part = {k: get(h, k) for k in h.keys()}
        for alias, target in json.loads(meta.get("aliases", "{}")).items():
            part[alias] = part[target]
        sd.update(part)
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}


def read_weights_and_provenance(path: PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(read_weights(path), _provenance of those weights)."""
    files, m = resolve_weights(path)
    return _read_safetensors(files, lambda h, k: h.get_tensor(k)), _provenance(files[0], m)


def read_weight_shapes(path: PathLike, deep: bool = True) -> tuple[dict[str, tuple], dict]:
    """({name: shape} from the safetensors headers only, provenance): what init_from would load."""
    files, m = resolve_weights(path, deep=deep)
    return _read_safetensors(files, lambda h, k: tuple(h.get_slice(k).get_shape())), _provenance(files[0], m)


def weights_mismatch(own: dict[str, tuple], theirs: dict[str, tuple], tied: set) -> list[str]:
    """How weights of shapes `theirs` fail to fit a model of shapes `own` (empty = they fit).

    Names and shapes must match exactly; a tied lm_head may be absent (HF exports omit it)."""
    missing = [k for k in own if k not in theirs and k not in tied]
    unexpected = [k for k in theirs if k not in own]
    shapes = [f"{k}: file {tuple(theirs[k])} vs model {tuple(own[k])}"
              for k in own if k in theirs and tuple(theirs[k]) != tuple(own[k])]
    out = []
    emb = "embed_tokens.weight"
    if emb in own and emb in theirs and tuple(own[emb]) != tuple(theirs[emb]):
        (v, d), (v2, d2) = own[emb], theirs[emb]
        if v != v2:
            out.append(f"the weights were trained with vocab {v2}, model.vocab_size is {v}: set model.vocab_size={v2} "
                       f"(the parent's tokenizer and vocabulary)")
        if d != d2:
            out.append(f"the weights have d_model {d2}, model.d_model is {d}")
    if missing or unexpected or shapes:
        out.append(f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                   f"{'...' if len(unexpected) > 8 else ''}, shapes {shapes[:8]}{'...' if len(shapes) > 8 else ''}")
    return out


def tied_keys(own: dict) -> set:
    """lm_head.weight when it is the embedding's tensor (tie_embeddings)."""
    return {k for k in own if k == "lm_head.weight" and "embed_tokens.weight" in own
            and own[k].data_ptr() == own["embed_tokens.weight"].data_ptr()}


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: PathLike, tokenizer: Optional[str] = None) -> dict:
    """init_from: copy weights into model; names and shapes must match exactly.

    A tied lm_head may be absent from the file (HF exports omit it). `tokenizer` (an identity)
    must equal the one recorded with the weights, when they record one: embeddings trained
    with another tokenizer have the right shape and mean nothing. Returns the provenance
    {tokenizer, run_id, step} ({} for weights megablu did not write).
    """
    sd, prov = read_weights_and_provenance(path)
    if tokenizer is not None and prov.get("tokenizer") not in (None, tokenizer):
        raise CheckpointError(f"{path}: weights trained with tokenizer {prov['tokenizer']!r}, but the tokenizer "
                              f"here is {tokenizer!r}; configure the tokenizer the weights were trained with")
    own = model.state_dict(keep_vars=True)
    bad = weights_mismatch({k: tuple(t.shape) for k, t in own.items()}, {k: tuple(t.shape) for k, t in sd.items()},
                           tied_keys(own))
    if bad:
        raise CheckpointError(f"init_from {path}: weights do not match the model: " + "; ".join(bad))
    for k, t in own.items():
        if k in sd:
            t.copy_(sd[k].to(t.dtype))
    return prov
