"""train.profile_step: one step of the real entry under torch.profiler, split by phase, changes nothing
else (every step's loss and lr equal a run without it, bit for bit), and is an invocation's setting."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megablu.config import ConfigError, config_hash, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny_cpu.yaml"


def _train(runs: Path, data: Path, *sets: str) -> Path:
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "ext32k.py"),
        "--config",
        str(TINY),
        "--set",
        f"runs_dir={runs}",
        "--set",
        f"data.path={data}",
        "--set",
        "train.max_steps=3",
        "--set",
        "checkpoint.every_steps=3",
        "--set",
        "train.probe_steps=0",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "train.micro_batch=1",
        "--set",
        "train.tokens_per_step=512",
    ]  # 2 micro-batches of 256
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "DS_ACCELERATOR": "cpu"}, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = sorted(runs.glob("tiny_cpu-*"))
    return run


def _rows(run: Path) -> list:
    with open(run / "metrics.csv") as f:
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in csv.DictReader(f)]


@pytest.mark.e2e
def test_profiled_step_is_split_by_phase_and_changes_no_step(stdlib_data, tmp_path):
    plain = _train(tmp_path / "plain", stdlib_data)
    prof = _train(tmp_path / "prof", stdlib_data, "train.profile_step=2")
    assert _rows(prof) == _rows(plain)  # loss, lr and grad norm of every step, bit for bit
    assert not (plain / "profile").exists()
    assert sorted(p.name for p in (prof / "profile").iterdir()) == ["step_2.md", "step_2.trace.json.gz"]
    md = (prof / "profile" / "step_2.md").read_text()
    calls = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[1].isdigit():
            calls[cells[0]] = int(cells[1])
    # the optimizer steps at the second micro-batch
    assert calls == {
        "data": 1,
        "shard_and_count": 1,
        "forward": 2,
        "backward": 2,
        "engine_step": 1,
        "optimizer_step": 1,
        "loss_reduce": 1,
        "grad_norm": 1,
    }, md
    assert "unprofiled steps' median" in md and "top ops" in md


def test_profile_step_is_checked_and_is_not_part_of_the_run(tmp_path):
    with pytest.raises(ConfigError, match=r"train.profile_step: 41 > train.max_steps 40"):
        load_config(TINY, ["train.profile_step=41"])
    # an invocation's choice: a resume may add or change it (the checkpoints' config hash ignores it)
    assert config_hash(load_config(TINY, ["train.profile_step=5"])) == config_hash(load_config(TINY))


def test_cupti_teardown_only_on_cuda_and_never_over_the_users(monkeypatch):
    from megablu.train.step_profile import cupti_teardown

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    cupti_teardown("cpu")
    assert "TEARDOWN_CUPTI" not in os.environ
    cupti_teardown("cuda")
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")  # the user's choice stays
    cupti_teardown("cuda")
    assert os.environ["TEARDOWN_CUPTI"] == "0"
