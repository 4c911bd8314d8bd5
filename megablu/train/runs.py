"""Run ids: allocated atomically, never reused, safe under concurrent launches.

The seed numbered runs by "first free log file", so two launches could pick the same
number and a keep-N of one pruned a live checkpoint of the other. Here a run id is
claimed with two exclusive filesystem operations, both atomic on POSIX filesystems and
on NFSv3+ (O_EXCL create / mkdir):

  1. `runs_dir/.ids/<run_id>`: a tombstone created with O_CREAT|O_EXCL. It is never
     deleted, so an id stays taken after its run directory is removed (never reused).
  2. `runs_dir/<run_id>/`: created with mkdir (fails if it exists, e.g. a run made by
     hand or by an older tool), then `run.json` records who claimed it.

A launch that loses either race moves to the next number. The run id is the directory
name and the checkpoint prefix: a run's checkpoints live only under its own directory,
so two runs cannot share a prefix.

Only global rank 0 allocates; the trainer broadcasts the path to the other ranks.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Union

log = logging.getLogger(__name__)

IDS_DIR = ".ids"
RUN_META = "run.json"
_NUM = re.compile(r"^(?P<name>.+)-(?P<n>\d{4,})$")


class RunError(Exception):
    """A run directory could not be allocated or found."""


def _check_name(name: str) -> None:
    from ..config.schema import run_name_problem   # the config's `name` rule, one source

    why = run_name_problem(name)
    if why:
        raise RunError(why)


def _taken_numbers(runs_dir: Path, name: str) -> list[int]:
    nums = []
    for d in (runs_dir / IDS_DIR, runs_dir):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            m = _NUM.match(p.name)
            if m and m.group("name") == name:
                nums.append(int(m.group("n")))
    return nums


def allocate_run(runs_dir: Union[str, Path], name: str, max_tries: int = 10000) -> Path:
    """Claim a fresh `runs_dir/<name>-NNNN` directory and return it.

    Numbers increase monotonically per name (1 + the highest ever claimed, including
    deleted runs), and the claim is exclusive, so concurrent launches get distinct ids.
    """
    _check_name(name)
    runs_dir = Path(runs_dir)
    ids = runs_dir / IDS_DIR
    ids.mkdir(parents=True, exist_ok=True)
    n = max(_taken_numbers(runs_dir, name), default=0) + 1
    for _ in range(max_tries):
        run_id = f"{name}-{n:04d}"
        try:
            fd = os.open(ids / run_id, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            n += 1
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}) + "\n")
        run_dir = runs_dir / run_id
        try:
            run_dir.mkdir()
        except FileExistsError:
            # a directory made outside this allocator; the tombstone keeps the id taken
            log.warning("run dir %s exists without an id claim; skipping that id", run_dir)
            n += 1
            continue
        meta = {"run_id": run_id, "name": name, "host": socket.gethostname(), "pid": os.getpid(),
                "created_unix": time.time()}
        tmp = run_dir / f".{RUN_META}.tmp"
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, run_dir / RUN_META)
        log.info("allocated run %s", run_dir)
        return run_dir
    raise RunError(f"could not allocate a run id for {name!r} in {runs_dir} after {max_tries} tries")


def run_id_of(run_dir: Union[str, Path]) -> str:
    return Path(run_dir).resolve().name


def find_run(runs_dir: Union[str, Path], run_id_or_path: Union[str, Path]) -> Path:
    """A run directory from a path or an id inside runs_dir; RunError when absent."""
    p = Path(run_id_or_path)
    if p.is_dir() and ((p / RUN_META).exists() or (p / "checkpoints").is_dir()):
        return p
    q = Path(runs_dir) / str(run_id_or_path)
    if q.is_dir():
        return q
    known = sorted(d.name for d in Path(runs_dir).iterdir() if d.is_dir() and not d.name.startswith(".")) \
        if Path(runs_dir).is_dir() else []
    raise RunError(f"no run {str(run_id_or_path)!r}: not a run directory and not in {runs_dir} "
                   f"(runs there: {', '.join(known[-10:]) or 'none'})")


def list_runs(runs_dir: Union[str, Path]) -> list[Path]:
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
