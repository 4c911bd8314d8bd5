"""Ranks exit when their launcher dies.

`deepspeed` starts `deepspeed.launcher.launch` per node, which starts the ranks. A kill -9 of
the `deepspeed` process (or of launch.py) leaves the ranks running, unattended: the issue
found 5 of 5 such ranks training on, and a `--resume` started meanwhile wrote the same run.
Each rank therefore watches the processes whose death orphans it: its parent (launch.py,
torchrun) and, when that is DeepSpeed's per-node launcher started by the `deepspeed` runner
on this host, the runner too. A watched pid that is gone (or reused: its start time
changed), or a parent that changed (the rank was re-parented), ends the rank within
`interval` seconds: one line on stderr (what died, and how to resume), exit code 1.
The run's lock (runs.py) then names a dead pid and a resume may take it.

A rank can also fail *because* its launcher died before its own watchdog fires: its peer's
watchdog ended the peer first and the collective in flight says "Connection closed by peer".
`launcher_gone()` lets the failing rank see that, so the run is recorded as stopped from
outside (LauncherGone), not as failed with a misleading gloo error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Optional

from .runs import pid_alive, proc_start

log = logging.getLogger(__name__)

EXIT_CODE = 1


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def launcher_pids() -> list[int]:
    """The parent, plus DeepSpeed's runner above it when the parent is DeepSpeed's per-node launcher."""
    parent = os.getppid()
    pids = [parent]
    if "deepspeed.launcher.launch" in _cmdline(parent):
        gp = _ppid(parent)
        if gp and gp > 1 and ("deepspeed" in _cmdline(gp)):
            pids.append(gp)
    return pids


_DEAD: Optional[Callable[[], Optional[str]]] = None  # set by exit_with_launcher


def launcher_gone() -> Optional[str]:
    """Why this rank's launcher is gone, or None (also None when no watchdog was started)."""
    return _DEAD() if _DEAD is not None else None


def exit_with_launcher(
    message: Callable[[], str], interval: float = 1.0, record: Optional[Callable[[str], None]] = None
) -> threading.Thread:
    """Start a daemon thread that ends this process when a launcher pid dies; `message()` is
    printed first (its last line: how to resume) and `record(why)` is called before that, so the
    run says why it stopped even when the exit cuts a failing rank's own report short."""
    global _DEAD
    pids = launcher_pids()
    starts = {p: proc_start(p) for p in pids}
    parent = pids[0]

    def dead() -> Optional[str]:
        if os.getppid() != parent:
            return f"the launcher (pid {parent}) exited: this rank was re-parented to pid {os.getppid()}"
        for p in pids:
            if not pid_alive(p) or proc_start(p) != starts[p]:
                return f"the launcher (pid {p}: {_cmdline(parent if p == parent else p)[:80] or '?'}) is gone"
        return None

    _DEAD = dead

    def watch() -> None:
        ev = threading.Event()
        while not ev.wait(interval):
            why = dead()
            if why:
                rank = os.environ.get("RANK", "?")
                try:
                    if record is not None:
                        with contextlib.suppress(Exception):  # the exit must happen; stderr still says why
                            record(why)
                    sys.stderr.write(
                        f"rank {rank}: {why}; stopping so that no rank trains unattended\n"
                        + message().rstrip("\n")
                        + "\n"
                    )
                    sys.stderr.flush()
                finally:
                    os._exit(EXIT_CODE)

    log.debug("watching launcher pids %s", pids)
    t = threading.Thread(target=watch, name="megablu-launcher-watchdog", daemon=True)
    t.start()
    return t
