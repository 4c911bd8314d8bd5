"""Run ids: allocated atomically, never reused, safe under concurrent launches.

Numbering runs by "first free log file" lets two launches pick the same
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
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

log = logging.getLogger(__name__)

IDS_DIR = ".ids"
RUN_META = "run.json"
_NUM = re.compile(r"^(?P<name>.+)-(?P<n>\d{4,})$")


class RunError(Exception):
    """A run directory could not be allocated or found."""


def _check_name(name: str) -> None:
    from ..config.schema import run_name_problem  # the config's `name` rule, one source

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
        meta = {
            "run_id": run_id,
            "name": name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "created_unix": time.time(),
        }
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
    known = (
        sorted(d.name for d in Path(runs_dir).iterdir() if d.is_dir() and not d.name.startswith("."))
        if Path(runs_dir).is_dir()
        else []
    )
    raise RunError(
        f"no run {str(run_id_or_path)!r}: not a run directory and not in {runs_dir} "
        f"(runs there: {', '.join(known[-10:]) or 'none'})"
    )


def list_runs(runs_dir: Union[str, Path]) -> list[Path]:
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))


# --------------------------------------------------------------------------- liveness lock
# One job at a time per run dir. The C++ seed had none: after a kill -9 of the launcher its
# ranks trained on, a resume started beside them, and both wrote one run (duplicate metrics
# rows, then a crash). `run.lock` names the job that holds the run (host, pid, start time,
# heartbeat); it is created with O_EXCL, refreshed by a heartbeat thread, removed on exit.
# A lock is stale when its pid is dead on this host (or another process has taken the pid)
# or its heartbeat is older than STALE_AFTER_S (the only test possible across hosts).
LOCK = "run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 180.0


def proc_start(pid: int) -> Optional[str]:
    """The kernel's start time of pid (/proc/<pid>/stat field 22), to tell a reused pid; None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def pid_alive(pid: int) -> bool:
    """pid runs on this host (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _read_lock(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def lock_state(info: Optional[dict], path: Path, now: Optional[float] = None) -> tuple[bool, str]:
    """(live, why) for a lock's content (None: unreadable, judged by the file's age)."""
    now = time.time() if now is None else now
    if info is None:
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            return False, "gone"
        return (age <= STALE_AFTER_S), f"unreadable lock file, {age:.0f} s old"
    age = now - float(info.get("heartbeat_unix", 0))
    if info.get("host") == socket.gethostname():
        pid = int(info.get("pid", -1))
        if not pid_alive(pid):
            return False, f"pid {pid} is not running on this host"
        start = info.get("proc_start")
        if start is not None and proc_start(pid) not in (None, start):
            return False, f"pid {pid} is now another process"
    if age > STALE_AFTER_S:
        return False, f"heartbeat {age:.0f} s old (> {STALE_AFTER_S:.0f} s)"
    return True, f"heartbeat {max(age, 0):.0f} s ago"


def describe_holder(info: Optional[dict], why: str) -> str:
    if info is None:
        return f"a job whose lock file cannot be read ({why})"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started_unix", 0))))
    return f"host {info.get('host')}, pid {info.get('pid')}, started {started}, {why}" + (
        f", command: {info['command']}" if info.get("command") else ""
    )


def live_holder(run_dir: Union[str, Path]) -> Optional[str]:
    """Who holds the run while alive ('host ..., pid ...'), or None when no live job does."""
    path = Path(run_dir) / LOCK
    if not path.exists():
        return None
    info = _read_lock(path)
    live, why = lock_state(info, path)
    return describe_holder(info, why) if live else None


def in_use_message(run_dir: Union[str, Path], holder: str) -> str:
    return (
        f"run {run_id_of(run_dir)} is in use by a live job ({holder}); a second job writing the same run "
        f"duplicates its metrics and checkpoints: wait for it to finish, or stop it first "
        f"(its lock: {Path(run_dir) / LOCK})"
    )


class RunLock:
    """The liveness lock of one run dir, held by the job's rank 0 (acquire / heartbeat / release)."""

    def __init__(self, path: Path, info: dict, heartbeat_s: float):
        self.path, self.info, self._beat = path, info, heartbeat_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, run_dir: Union[str, Path], heartbeat_s: float = HEARTBEAT_S) -> RunLock:
        """Take the run's lock or raise RunError naming the live job that holds it."""
        import sys
        import uuid

        path = Path(run_dir) / LOCK
        now = time.time()
        info: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "proc_start": proc_start(os.getpid()),
            "started_unix": now,
            "heartbeat_unix": now,
            "token": uuid.uuid4().hex,
            "command": " ".join(sys.argv)[:300],
        }
        for _ in range(5):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                old = _read_lock(path)
                live, why = lock_state(old, path)
                if live:
                    raise RunError(in_use_message(run_dir, describe_holder(old, why))) from None
                # stale: move it aside, and only proceed if what was moved is the stale lock
                # (two resumes racing for one dead run: the second must not remove the first's)
                aside = path.with_name(f".{LOCK}.stale-{os.getpid()}-{info['token'][:8]}")
                try:
                    os.rename(path, aside)
                except FileNotFoundError:
                    continue
                moved = _read_lock(aside)
                if (moved or {}).get("token") != (old or {}).get("token") or (moved is None) != (old is None):
                    try:  # a fresh lock taken meanwhile: put it back, it wins
                        os.link(aside, path)
                    except FileExistsError:
                        pass
                    os.unlink(aside)
                    holder = describe_holder(moved, "it took the lock just now")
                    raise RunError(in_use_message(run_dir, holder)) from None
                os.unlink(aside)
                log.warning("run %s: taking over a stale lock (%s)", run_id_of(run_dir), describe_holder(old, why))
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info) + "\n")
                f.flush()
                os.fsync(f.fileno())
            lock = cls(path, info, heartbeat_s)
            lock._start()
            return lock
        raise RunError(
            f"run {run_id_of(run_dir)}: could not take {path} (it keeps changing); is another job starting on this run?"
        )

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="megablu-run-lock", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._beat):
            cur = _read_lock(self.path)
            if (cur or {}).get("token") != self.info["token"]:
                log.error(
                    "run lock %s is no longer this job's (now: %s); heartbeat stopped",
                    self.path,
                    describe_holder(cur, "") if cur else "gone",
                )
                return
            self.info["heartbeat_unix"] = time.time()
            tmp = self.path.with_name(f".{LOCK}.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(self.info) + "\n")
                os.replace(tmp, self.path)
            except OSError as e:  # a full disk must not stop training; the lock ages instead
                log.warning("run lock heartbeat failed: %s", e)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this job's. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        cur = _read_lock(self.path)
        if (cur or {}).get("token") == self.info["token"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
