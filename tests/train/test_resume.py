"""End to end through the deepspeed launcher on CPU (2 ranks, sp=2, ZeRO-2):
N steps straight == N/2 + resume + N/2 (same loss and LR at every step, bit for bit)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny_cpu_ext.yaml"
# the tiny YaRN arm trained from random weights (no parent): a permission, since YaRN without
# init_from is otherwise refused (config/lineage.py); these tests are about resume, not lineage
SCRATCH = "rope.allow_yarn_from_scratch=true"


def launch(ranks, sets, resume=None):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
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
        str(TINY),
        "--set",
        SCRATCH,
    ]
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd += ["--resume", resume]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        tail = [ln for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.strip()][-60:]  # the whole story
        pytest.fail(f"launch {sets} resume={resume} exit {r.returncode}:\n" + "\n".join(tail))
    from megablu.utils.dist import CLOSED

    assert CLOSED in r.stderr, r.stderr[-3000:]  # every rank left the gloo group together (no exit-time abort)
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


def rows(run_dir):
    with open(Path(run_dir) / "metrics.csv") as f:
        return [(int(r["step"]), r["loss"], r["lr"]) for r in csv.DictReader(f)]


def common(data, runs) -> list[str]:
    """6 steps at sp=2 (tiny_cpu_ext) through a data.mix of two sources (long documents packed, short
    ones whole), so a resumed loader must continue each source where it stopped."""
    mix = (
        "data.mix=[{name: long, path: %s, bucket: 'b1,b2,b3,b4,b5,b6', mode: pack, weight: 0.6}, "
        "{name: short, path: %s, bucket: b0, mode: fit, weight: 0.4}]" % (data, data)
    )
    return [
        f"runs_dir={runs}",
        "data.path=null",
        mix,
        "train.max_steps=6",
        "schedule.warmup_steps=2",
        "schedule.decay_start=3",
        "checkpoint.every_steps=0",
        "data.max_epochs=100",
    ]


@pytest.fixture(scope="module")
def straight(stdlib_data, tmp_path_factory):
    """The uninterrupted 6-step run at sp=2 that both tests compare a split run with (launched once)."""
    return launch(2, common(stdlib_data, tmp_path_factory.mktemp("straight") / "runs"))


def test_split_run_with_resume_equals_straight_run(stdlib_data, straight, tmp_path):
    """3 steps, a session stopped by its wall-clock budget after 1 more, then the last 2 == the
    straight run (a resume of a single data.path: tests/train/test_run_lifecycle.py)."""
    sets = common(stdlib_data, tmp_path / "runs")
    first = launch(2, sets + ["train.stop_after=3"])
    assert first["steps"] == 3
    # a session's wall-clock budget (a SLURM limit, a device call): stops at the first step end that
    # leaves no time for another step and its checkpoint -- here after step 4 -- saved, exit 0
    timed = launch(2, sets + ["train.stop_after_s=0.001", "train.probe_steps=0"], resume=first["run_dir"])
    assert timed["steps"] == 4 and timed["stopped"] == "train.stop_after_s=0.001"
    resumed = launch(2, sets, resume=first["run_dir"])
    assert resumed["run_dir"] == first["run_dir"] and resumed["steps"] == 6
    a, b = rows(straight["run_dir"]), rows(first["run_dir"])
    assert [r[0] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b  # identical losses and learning rates, as strings (bit for bit)
    assert "stopped" not in resumed
    mixture = json.loads((Path(first["run_dir"]) / "mixture.json").read_text())
    assert [s["name"] for s in mixture["sources"]] == ["long", "short"]
    assert sum(s["planned_sequences"] for s in mixture["sources"]) == mixture["planned_sequences"] == 6 * 4


def test_resume_with_another_sp_continues_the_same_run(stdlib_data, straight, tmp_path):
    """2 ranks: 3 steps at sp=1 (dp 2), resumed at sp=2 (dp 1) for 3 more == 6 steps at sp=2.
    Same global sequences per step (the loader's position is global, each source's too) and the
    same weights and optimizer state (Ulysses does not shard weights), so the losses agree to float
    rounding."""
    sets = common(stdlib_data, tmp_path / "runs") + ["train.probe_steps=0"]
    first = launch(2, sets + ["parallel.sp=1", "train.stop_after=3"])
    resumed = launch(2, sets + ["parallel.sp=2"], resume=first["run_dir"])
    assert resumed["steps"] == 6 and "sp 2" in resumed["world"]
    a, b = rows(straight["run_dir"]), rows(first["run_dir"])
    assert [r[0] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r[2] for r in a] == [r[2] for r in b]  # the schedule did not move
    for (s, la, _), (_, lb, _) in zip(a, b):
        assert float(la) == pytest.approx(float(lb), rel=1e-4), s
