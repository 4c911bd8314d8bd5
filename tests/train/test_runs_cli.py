"""`megablu runs` on run dirs as the trainer leaves them (written here file by file; the real
launches of tests/train/test_run_lifecycle.py check the same states on real runs)."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from megablu.cli import main
from megablu.train.metrics import COLUMNS

ROOT = Path(__file__).resolve().parents[2]


def _run(
    root: Path,
    name: str,
    steps: int,
    max_steps: int,
    *,
    summary=None,
    lock=None,
    errors=None,
    probe=None,
    eval_result=None,
    ckpt=False,
) -> Path:
    d = root / name
    (d / "logs").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"run_id": name}))
    (d / "config.resolved.yaml").write_text(f"name: x\ntrain:\n  max_steps: {max_steps}\n")
    with open(d / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for s in range(1, steps + 1):
            w.writerow(
                {
                    "step": s,
                    "loss": 10.0 - s * 0.1,
                    "lr": 1e-3,
                    "tokens_seen": 512 * s,
                    "step_time_s": 0.5,
                    "tokens_per_s": 1000.0 if s > 1 else 10.0,
                    "max_mem_gb": 0.0,
                    "grad_norm": 1.0,
                }
            )
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    if lock is not None:
        (d / "run.lock").write_text(json.dumps(lock))
    for rank, text in (errors or {}).items():
        time.sleep(0.01)
        (d / "logs" / f"rank{rank}.error.txt").write_text(text)
        t = time.time() + 1  # written after the last metrics row, as a failing rank does
        os.utime(d / "logs" / f"rank{rank}.error.txt", (t, t))
    if probe is not None:
        (d / "probe.json").write_text(json.dumps(probe))
    if eval_result is not None:
        (d / "eval").mkdir()
        (d / "eval" / f"step_{eval_result['step']}.json").write_text(json.dumps(eval_result))
    if ckpt:  # a step dir whose manifest does not verify: resume would not take it
        (d / "checkpoints" / "step_0000002").mkdir(parents=True)
        (d / "checkpoints" / "step_0000002" / "manifest.json").write_text("{}")
    return d


def _result(step: int) -> dict:
    from megablu.eval.report import SCHEMA

    cells = [
        {
            "task": "passkey",
            "length": L,
            "n": 20,
            "correct": k,
            "acc_pp": 5 * k,
            "ci_pp": [0.0, 100.0],
            "digest": "d",
            "all_correct": k,
        }
        for L, k in ((240, 18), (480, 9))
    ]
    return {
        "schema": SCHEMA,
        "arm": "ext",
        "step": step,
        "window": 512,
        "cells": cells,
        "samples": [],
        "loss": {
            "data": "x",
            "by_length": [
                {"length": 240, "n": 4, "loss": 3.5, "tail_loss": 3.4, "ppl": 33.1},
                {"length": 480, "n": 4, "loss": 3.25, "tail_loss": 3.2, "ppl": 25.8},
            ],
            "short": None,
        },
        "gate": {"passed": True, "message": "ok"},
    }


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    host = socket.gethostname()
    now = time.time()
    _run(
        root, "a-0001", 8, 8, summary={"steps": 8, "sessions": [{"from_step": 0, "to_step": 8}]}, eval_result=_result(8)
    )
    _run(
        root, "b-0001", 5, 20, lock={"host": host, "pid": os.getpid(), "heartbeat_unix": now, "started_unix": now}
    )  # this process: live
    _run(
        root,
        "c-0001",
        4,
        20,
        errors={
            0: "Traceback ...\nValueError: loss is nan at step 5\n",
            1: "Traceback ...\nTerminated: stopped by SIGTERM\n",
        },
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _run(
        root,
        "d-0001",
        6,
        20,
        lock={"host": host, "pid": dead.pid, "heartbeat_unix": now, "started_unix": now},
        ckpt=True,
    )  # kill -9: stale lock
    _run(root, "e-0001", 3, 20, errors={0: "Traceback ...\n__main__.Terminated: stopped by SIGTERM\n"})
    _run(
        root,
        "f-0001",
        3,
        20,
        summary={"steps": 3, "stopped": "train.stop_after_s=60", "sessions": [{"from_step": 0, "to_step": 3}]},
    )
    _run(root, "g-0001", 0, 20, probe={"oom": True})
    (root / ".ids").mkdir()
    (root / "not-a-run").mkdir()
    return root, dead.pid


def test_runs_lists_every_state(tmp_path, capsys):
    root, dead = _tree(tmp_path)
    assert main(["runs", str(root), "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == ["a-0001", "b-0001", "c-0001", "d-0001", "e-0001", "f-0001", "g-0001"]
    state = {k: r["state"] for k, r in rows.items()}
    assert state == {
        "a-0001": "finished",
        "b-0001": "running",
        "c-0001": "failed",
        "d-0001": "killed",
        "e-0001": "killed",
        "f-0001": "stopped",
        "g-0001": "failed",
    }
    assert rows["c-0001"]["why"] == "rank 0: ValueError: loss is nan at step 5"  # the real error, not SIGTERM
    assert "stale run.lock" in rows["d-0001"]["why"] and f"pid {dead} is not running" in rows["d-0001"]["why"]
    assert "SIGTERM" in rows["e-0001"]["why"] and "stop_after_s" in rows["f-0001"]["why"]
    assert "out of memory" in rows["g-0001"]["why"]
    a = rows["a-0001"]
    assert a["steps"] == 8 and a["max_steps"] == 8
    assert abs(a["loss"] - sum(10.0 - s * 0.1 for s in range(1, 9)) / 8) < 1e-9  # mean of the last steps
    assert a["tokens_per_s"] == 1000.0  # first step left out
    assert a["eval"] == "step 8: passkey@480 45.0%, loss@480 3.250, gate passed"
    assert rows["d-0001"]["checkpoint"] is None and rows["d-0001"]["checkpoints_unusable"] == ["step_0000002"]

    assert main(["runs", str(root)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["run", "state", "steps", "loss", "tokens/s", "checkpoint", "last", "eval"]
    assert len(lines) == 8 and lines[1].split()[:3] == ["a-0001", "finished", "8/8"]
    assert "c-0001: failed: rank 0: ValueError" in err and "a-0001" not in err


def test_runs_show_plot_and_eval_tables(tmp_path, capsys):
    root, _ = _tree(tmp_path)
    assert main(["runs", "show", "a-0001", "--runs-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "state       finished: step 8 of 8" in out
    assert "### passkey" in out and "### held-out loss" in out  # the newest eval's tables
    png = root / "a-0001" / "train.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["runs", "show", str(root / "c-0001"), "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "state       failed: rank 0: ValueError" in out and "## eval: none" in out
    assert (tmp_path / "c.png").is_file()


def test_runs_bad_input_exit_2(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    root, _ = _tree(tmp_path)
    assert main(["runs", "show", "zz-0001", "--runs-dir", str(root)]) == 2
    assert "no run 'zz-0001'" in capsys.readouterr().err
    assert main(["runs", "show"]) == 2
    assert main(["runs", "a", "b"]) == 2


def test_a_rank_error_after_its_launcher_died_is_killed_not_failed(tmp_path, monkeypatch, capsys):
    """kill -9 of `deepspeed`: one rank's watchdog ends it, the other's collective then fails with
    gloo's 'Connection closed by peer' before its own watchdog fires. That rank's error follows the
    launcher's death: the run is killed (stale lock named), not failed with the gloo error."""
    from megablu.train import entry, watchdog

    root = tmp_path / "runs"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, now = socket.gethostname(), time.time()
    run = _run(root, "k-0001", 4, 20, lock={"host": host, "pid": dead.pid, "heartbeat_unix": now, "started_unix": now})
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19881")
    monkeypatch.setattr(watchdog, "_DEAD", lambda: "the launcher (pid 12345: deepspeed) is gone")
    assert entry._failed(gloo, run, 0, lambda: "resume with: x") == 1
    err = capsys.readouterr().err
    assert "rank 0: LauncherGone: the launcher (pid 12345: deepspeed) is gone" in err and "Connection closed" in err
    assert main(["runs", str(root), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["state"] == "killed", row
    assert "LauncherGone" in row["why"] and f"stale run.lock (pid {dead.pid} is not running" in row["why"], row

    # the launcher alive: the same error is the run's failure
    monkeypatch.setattr(watchdog, "_DEAD", lambda: None)
    assert entry._failed(gloo, run, 0, lambda: "resume with: x") == 1
    capsys.readouterr()
    assert main(["runs", str(root), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["state"] == "failed" and "Connection closed by peer" in row["why"], row


_ORPHAN = r"""
import os, sys, time
from pathlib import Path
from megablu.train import watchdog
from megablu.train.entry import _record_gone

run, ready = Path(sys.argv[1]), Path(sys.argv[2])
os.environ["RANK"] = "1"
watchdog.exit_with_launcher(lambda: "resume with: x", interval=0.1,
                            record=lambda why: _record_gone(run, 1, why))
ready.write_text(str(os.getpid()))
time.sleep(60)
"""

_LAUNCHER = r"""
import subprocess, sys, time
from pathlib import Path
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
while not Path(sys.argv[3]).exists():   # the rank watches this process, then it dies without a word
    time.sleep(0.05)
"""


def test_a_rank_ended_by_its_watchdog_records_why_even_with_its_lock_released(tmp_path, capsys):
    """The watchdog's exit can cut a failing rank's report short (its lock released, no error file
    yet): the watchdog writes the rank's error file itself before it exits, so the run reads killed
    with the launcher named, not 'no error recorded'."""
    import psutil

    root = tmp_path / "runs"
    run = _run(root, "w-0001", 3, 20)  # no lock: rank 0 released it on its way out
    (run / "logs" / "rank1.error.txt").write_text("Traceback ...\nRuntimeError: Connection closed by peer\n")
    os.utime(run / "logs" / "rank1.error.txt", (1.0, 1.0))  # an earlier session's, since resumed
    ready = tmp_path / "ready"
    launcher = subprocess.run([sys.executable, "-c", _LAUNCHER, _ORPHAN, str(run), str(ready)], cwd=ROOT, timeout=120)
    assert launcher.returncode == 0
    rank = int(ready.read_text())
    deadline = time.time() + 30
    while psutil.pid_exists(rank) and psutil.Process(rank).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, "the orphaned rank is still running"
        time.sleep(0.1)
    lines = (run / "logs" / "rank1.error.txt").read_text().splitlines()
    assert lines[:2] == ["Traceback ...", "RuntimeError: Connection closed by peer"], lines  # kept above
    assert lines[-1].startswith("LauncherGone: the launcher (pid ") and "watchdog stopped it" in lines[-1], lines
    assert main(["runs", str(root), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["state"] == "killed" and "rank 1: LauncherGone: the launcher (pid " in row["why"], row
