"""`megablu train`: the launch resolved (topology, config check for that world, the exact launcher
command with the entry module), --dry-run stopping there; a real one-rank run from a directory
that is not the checkout (the entry is a module, not a relative script path)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu"}


def megablu(*args, cwd=ROOT, timeout=600):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "megablu.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def test_dry_run_prints_topology_check_and_the_module_command(tmp_path):
    cfg = ROOT / "tests" / "configs" / "tiny_cpu_ext.yaml"
    r = megablu("train", "--config", str(cfg), "--dry-run", "--set", "train.max_steps=20", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "1 node(s) x 2 ranks = world 2 -> dp 1 x sp 2" in lines[0]  # --gpus: parallel.sp
    assert "config check (world 2, cpu): ok" in lines  # device auto: no GPU here
    (command,) = [ln for ln in lines if ln.startswith("command: ")]
    assert command.startswith("command: DS_ACCELERATOR=cpu LOCAL_WORLD_SIZE=2 ")
    assert (
        f"-m deepspeed.launcher.runner --num_gpus 2 --master_port 29500 --module megablu.train.entry "
        f"--config {cfg} --set train.max_steps=20"
    ) in command
    assert "launch/ext32k.py" not in command
    assert not (tmp_path / "runs").exists()  # nothing started


def test_dry_run_torchrun_and_refusals(tmp_path):
    r = megablu(
        "train",
        "--config",
        "configs/ext32k.yaml",
        "--device",
        "cuda",
        "--launcher",
        "torchrun",
        "--nodes",
        "2",
        "--gpus",
        "2",
        "--node-rank",
        "1",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    assert "-m torch.distributed.run --nnodes 2 --node_rank 1 --nproc-per-node 2" in r.stdout
    assert "--module megablu.train.entry --config configs/ext32k.yaml" in r.stdout
    # a world the config cannot use: exit 2, the check says why
    r = megablu("train", "--config", "configs/ext32k.yaml", "--device", "cuda", "--gpus", "1", "--dry-run")
    assert r.returncode == 2 and "config check (world 1, cuda): INVALID" in r.stdout
    assert "parallel.sp=2 > world size 1" in r.stderr
    bad = tmp_path / "hosts"
    bad.write_text("node0 4\n")
    r = megablu("train", "--config", "configs/ext32k.yaml", "--hostfile", str(bad), "--dry-run")
    assert r.returncode == 2 and "expected '<hostname> slots=<n>'" in r.stderr and r.stdout == ""


@pytest.mark.e2e
def test_train_runs_the_entry_module_from_any_directory(tmp_path, stdlib_data):
    r = megablu(
        "train",
        "--config",
        str(ROOT / "tests" / "configs" / "tiny_cpu.yaml"),
        "--gpus",
        "1",
        "--master-port",
        str(free_port()),
        "--set",
        f"runs_dir={tmp_path / 'runs'}",
        "--set",
        f"data.path={stdlib_data}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.probe_steps=0",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "checkpoint.every_steps=0",
        "--set",
        "data.max_epochs=100",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "config check (world 1, cpu): ok" in r.stderr and "--module megablu.train.entry" in r.stderr
    s = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert s["steps"] == 2 and Path(s["run_dir"]).parent == tmp_path / "runs"


def _ranks(code, world, port, tmp_path):
    """`world` ranks of `python -c code` started the way a launcher starts them (RANK, WORLD_SIZE,
    MASTER_*), without its `python -u`: stdout goes to a file, block-buffered. [(rc, out, err)]."""
    base = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
    procs = []
    for r in range(world):
        out, err = (open(tmp_path / f"rank{r}.{port}.{k}", "w+") for k in ("out", "err"))
        env = {
            **base,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            (subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, cwd=ROOT, env=env), out, err)
        )
    results = []
    for p, out, err in procs:
        rc = p.wait(timeout=600)
        results.append((rc, *(f.seek(0) or f.read() for f in (out, err))))
        out.close()
        err.close()
    return results


@pytest.mark.e2e
def test_a_finished_two_rank_run_ends_by_the_hard_exit_with_its_output_flushed(tmp_path, stdlib_data):
    """After a run whose ranks left their process group together, each rank ends with os._exit (the
    interpreter's teardown can abort a finished gloo rank): no atexit handler runs, and rank 0's
    JSON line on a block-buffered stdout and the --json file are whole all the same. One rank and
    failing runs keep the ordinary exit."""
    argv = [
        "launch/ext32k.py",
        "--config",
        "tests/configs/tiny_cpu.yaml",
        "--json",
        str(tmp_path / "s.json"),
        "--set",
        f"runs_dir={tmp_path / 'runs'}",
        "--set",
        f"data.path={stdlib_data}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.probe_steps=0",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "checkpoint.every_steps=0",
        "--set",
        "data.max_epochs=100",
    ]
    code = (
        "import atexit, runpy, sys; atexit.register(lambda: print('ATEXIT-RAN', file=sys.stderr)); "
        f"sys.argv = {argv!r}; runpy.run_path('launch/ext32k.py', run_name='__main__')"
    )
    (rc0, out0, err0), (rc1, _, err1) = _ranks(code, 2, free_port(), tmp_path)
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert "ATEXIT-RAN" not in err0 + err1
    s = json.loads([ln for ln in out0.splitlines() if ln.startswith("{")][-1])
    assert s["steps"] == 2 and json.loads((tmp_path / "s.json").read_text()) == s
    [(rc, out, err)] = _ranks(code, 1, free_port(), tmp_path)  # one rank: no peer to race, the ordinary exit
    assert rc == 0 and "ATEXIT-RAN" in err and out.splitlines()[-1].startswith("{"), err[-2000:]
    [(rc, _, err)] = _ranks(code.replace("train.max_steps=2", "train.max_steps=-1"), 1, free_port(), tmp_path)
    assert rc == 2 and "ATEXIT-RAN" in err, err[-2000:]
