"""A run's life through real launches (issue 19, items 2, 7, 8, 9): extending max_steps on
resume, resuming a finished run, a rank that dies, a launcher killed with -9; the checkpoints
checkpoint.keep_every keeps across a stop and a resume.

Single-rank runs use `python launch/ext32k.py` (~10 s each); the two that need a launcher
use DeepSpeed's on 2 CPU ranks (~30-40 s each).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.dist_utils import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny_cpu.yaml"
TINY_EXT = ROOT / "tests" / "configs" / "tiny_cpu_ext.yaml"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu"}


def entry(sets, resume=None, config=TINY, extra=()):
    cmd = [sys.executable, str(ROOT / "launch" / "ext32k.py"), "--config", str(config), *extra]
    cmd += sum((["--set", s] for s in sets), [])
    if resume:
        cmd += ["--resume", str(resume)]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def summary(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


def rows(run_dir):
    with open(Path(run_dir) / "metrics.csv") as f:
        return [(int(r["step"]), r["loss"], r["lr"]) for r in csv.DictReader(f)]


def runs_states(runs: Path, capsys) -> dict:
    """`megablu runs RUNS --json`: {run id: (state, why)}."""
    from megablu.cli import main

    capsys.readouterr()
    assert main(["runs", str(runs), "--json"]) == 0
    return {r["run"]: (r["state"], r["why"]) for r in json.loads(capsys.readouterr().out)}


def tree(p: Path) -> dict:
    return {str(f.relative_to(p)): f.stat().st_mtime_ns for f in sorted(p.rglob("*")) if f.is_file()}


def test_extend_wsd_max_steps_on_resume_then_resume_the_finished_run(tmp_path, stdlib_data, capsys):
    """max_steps 6 -> 10 (decay_start 3 -> 7) at step 3, before the decay: the same losses and LRs
    as a straight 10-step run, bit for bit; summary.json covers both sessions; config.resolved.yaml
    now resumes the extended run. Then a resume of the finished run: 'already complete', exit 0,
    nothing in the run changed."""
    common = [
        f"runs_dir={tmp_path}/runs",
        f"data.path={stdlib_data}",
        "data.max_epochs=100",
        "schedule.kind=wsd",
        "schedule.warmup_steps=1",
        "checkpoint.every_steps=0",
        "train.probe_steps=0",
    ]
    long = ["train.max_steps=10", "schedule.decay_start=7"]
    straight = summary(entry(common + long))
    first = summary(entry(common + ["train.max_steps=6", "schedule.decay_start=3", "train.stop_after=3"]))
    assert first["steps"] == 3
    run = Path(first["run_dir"])
    st = runs_states(tmp_path / "runs", capsys)  # megablu runs: one finished, one stopped by stop_after
    assert st[Path(straight["run_dir"]).name][0] == "finished" and st[run.name][0] == "stopped", st
    resumed = summary(entry(common + long, resume=run.name))
    assert resumed["run_dir"] == str(run) and resumed["steps"] == 10
    assert rows(run) == rows(straight["run_dir"])  # losses and LRs as strings: bit for bit
    # the summary is the whole run's, from metrics.csv, with both sessions
    assert resumed["first_loss"] == float(rows(run)[0][1]) and resumed["last_loss"] == float(rows(run)[-1][1])
    assert [(s["from_step"], s["to_step"]) for s in resumed["sessions"]] == [(0, 3), (3, 10)]
    assert resumed["tokens_seen"] == straight["tokens_seen"]
    # the run's config is now the extended one (stop_after is an invocation's, not the run's)
    resolved = (run / "config.resolved.yaml").read_text()
    assert "max_steps: 10" in resolved and "decay_start: 7" in resolved and "stop_after: null" in resolved
    assert len(list(run.glob("config.before.*.yaml"))) == 1 and not list(run.glob("config.resume.*"))
    assert runs_states(tmp_path / "runs", capsys)[run.name] == ("finished", "step 10 of 10")

    before, summ = tree(run), (run / "summary.json").read_bytes()
    r = entry(
        [],
        resume=run.name,
        config=run / "config.resolved.yaml",  # the command the run prints
        extra=["--json", str(tmp_path / "result.json")],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run {run.name} is already complete" in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == json.loads(summ)
    assert (tmp_path / "result.json").read_text() == r.stdout.strip().splitlines()[-1] + "\n"  # --json FILE
    assert (run / "summary.json").read_bytes() == summ and tree(run) == before


def _launch(ranks, sets, config=TINY_EXT, resume=None, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(free_port()),
        str(ROOT / "launch" / "ext32k.py"),
        "--config",
        str(config),
        *extra,
    ]
    cmd += sum((["--set", s] for s in sets), [])
    if resume:
        cmd += ["--resume", resume]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT, start_new_session=True
    )


def _wait_for(pred, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _ranks(proc) -> list[psutil.Process]:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [
        k for k in kids if "ext32k.py" in " ".join(k.cmdline()) and "deepspeed.launcher" not in " ".join(k.cmdline())
    ]


def _run_dir(runs: Path) -> Path:
    return _wait_for(
        lambda: next((d for d in runs.glob("tiny_cpu_ext-*") if (d / "checkpoints" / "step_0000002").is_dir()), None),
        240,
        "the first checkpoint",
    )


@pytest.fixture
def group_reaper():
    """Kills what a test started (its own session) if the test ends early."""
    procs = []
    yield procs.append
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_keep_every_keeps_its_steps_across_a_resume(tmp_path, stdlib_data, capsys):
    """A save every step, keep=1, keep_every=3: stopped at 4 ({3, 4} on disk), resumed from 4 to 7:
    3 and 6 stay beside the newest, 7, which the run tools name."""
    common = [
        f"runs_dir={tmp_path}/runs",
        f"data.path={stdlib_data}",
        "data.max_epochs=100",
        "train.max_steps=7",
        "checkpoint.every_steps=1",
        "checkpoint.keep=1",
        "checkpoint.keep_every=3",
        "train.probe_steps=0",
    ]
    first = summary(entry(common + ["train.stop_after=4"]))
    run = Path(first["run_dir"])
    assert first["steps"] == 4 and sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_0000003",
        "step_0000004",
    ]
    resumed = summary(entry(common, resume=run.name))
    assert resumed["run_dir"] == str(run) and resumed["steps"] == 7
    assert [r[0] for r in rows(run)] == list(range(1, 8))
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_0000003",
        "step_0000006",
        "step_0000007",
    ]
    from megablu.cli import main

    capsys.readouterr()
    assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "finished" and row["checkpoint"] == "step_0000007", row


def test_kill9_of_the_launcher_ends_the_ranks_and_a_resume_beside_them_is_refused(
    tmp_path, stdlib_data, group_reaper, capsys
):
    runs = tmp_path / "runs"
    sets = [
        f"runs_dir={runs}",
        f"data.path={stdlib_data}",
        "rope.allow_yarn_from_scratch=true",
        "data.max_epochs=1000",
        "train.max_steps=2000",
        "schedule.decay_start=1990",
        "checkpoint.every_steps=2",
        "train.probe_steps=0",
    ]
    p = _launch(2, sets)
    group_reaper(p)
    run = _run_dir(runs)
    ranks = _wait_for(lambda: len(_ranks(p)) == 2 and _ranks(p), 30, "two ranks")
    lock = json.loads((run / "run.lock").read_text())
    assert lock["pid"] in {r.pid for r in ranks}
    assert runs_states(runs, capsys)[run.name][0] == "running"
    # a resume while the ranks train: refused by name, before anything is written
    check = [
        sys.executable,
        "-m",
        "megablu.cli",
        "config",
        "check",
        str(TINY_EXT),
        "--world-size",
        "2",
        "--device",
        "cpu",
        *sum((["--set", s] for s in sets), []),
        "--resume",
        run.name,
    ]
    r = subprocess.run(check, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "is in use by a live job" in r.stderr and f"pid {lock['pid']}" in r.stderr, r.stderr
    # kill -9 of the `deepspeed` runner: the ranks notice within seconds and stop
    os.kill(p.pid, signal.SIGKILL)
    t0 = time.time()
    _wait_for(
        lambda: not any(x.is_running() and x.status() != psutil.STATUS_ZOMBIE for x in ranks),
        30,
        "the ranks to exit after their launcher died",
    )
    assert time.time() - t0 < 15
    n = len(rows(run))
    time.sleep(2)
    assert len(rows(run)) == n  # nobody trains this run any more
    # megablu runs: killed. Either the rank died with its lock left stale, or (on a slower box) it
    # caught the launcher's death first, recorded LauncherGone and released the lock: both say why
    state, why = runs_states(runs, capsys)[run.name]
    assert state == "killed" and (
        f"stale run.lock (pid {lock['pid']} is not running" in why or "LauncherGone: the launcher" in why
    ), why
    # now the lock names a dead pid: a resume may go on
    r = subprocess.run(check, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_rank_that_dies_leaves_one_line_per_rank_and_the_resume_command_last(
    tmp_path, stdlib_data, group_reaper, capsys
):
    runs = tmp_path / "runs"
    sets = [
        f"runs_dir={runs}",
        f"data.path={stdlib_data}",
        "rope.allow_yarn_from_scratch=true",
        "data.max_epochs=1000",
        "train.max_steps=2000",
        "schedule.decay_start=1990",
        "checkpoint.every_steps=2",
        "train.probe_steps=0",
    ]
    p = _launch(2, sets)
    group_reaper(p)
    run = _run_dir(runs)
    ranks = _wait_for(lambda: len(_ranks(p)) == 2 and _ranks(p), 30, "two ranks")
    lock_pid = json.loads((run / "run.lock").read_text())["pid"]
    other = next(r for r in ranks if r.pid != lock_pid)  # rank 1 (rank 0 holds the lock)
    other.kill()
    out, err = p.communicate(timeout=120)
    assert p.returncode not in (0, None)
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert any(ln.startswith("rank 0: ") for ln in lines), err[-3000:]
    assert lines[-1] == (
        f"resume with: deepspeed --num_gpus 2 launch/ext32k.py --config "
        f"{run.resolve()}/config.resolved.yaml --resume {run.name}"
    ), lines[-4:]
    assert (run / "logs" / "rank0.error.txt").is_file()  # the traceback is kept, not printed
    state, why = runs_states(runs, capsys)[run.name]  # megablu runs: failed, rank 0's error
    assert state == "failed" and why.startswith("rank 0: "), why
    # the printed command resumes the run (for 2 more steps of this session)
    cmd = lines[-1].removeprefix("resume with: ").split()
    step = max(int(d.name.split("_")[1]) for d in (run / "checkpoints").glob("step_*"))
    q = _launch(
        2,
        [f"train.stop_after={step + 2}"],
        config=Path(cmd[5]),
        resume=cmd[-1],
        extra=["--json", str(tmp_path / "resumed.json")],
    )
    group_reaper(q)
    out, err = q.communicate(timeout=300)
    assert q.returncode == 0, err[-3000:]
    assert json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])["steps"] == step + 2
    # under deepspeed the launcher's own lines share stdout; --json FILE holds the result alone
    assert any(not ln.startswith("{") for ln in out.splitlines() if ln.strip()), out[-2000:]
    assert json.loads((tmp_path / "resumed.json").read_text())["steps"] == step + 2
    assert runs_states(runs, capsys)[run.name][0] == "stopped"  # the old session's error no longer counts
