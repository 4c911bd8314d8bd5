"""Every portable benchmark in bench/ answers `--help` (usage on stdout, exit 0) without a GPU, so a user on
any box can see what it measures and how before renting one. The scripts start side by side: most import
torch, and one after the other they would take a minute."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # starts every bench/ script (~8 s of processes on 2 cores): the full tier

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted((ROOT / "bench").glob("*.py"))


def test_every_bench_script_answers_help():
    assert len(BENCHES) >= 10, BENCHES  # the folder is where the layout says
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    procs = {
        b.name: subprocess.Popen(
            [sys.executable, str(b), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        for b in BENCHES
    }
    bad = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        if p.returncode != 0 or "usage:" not in out:
            bad[name] = (p.returncode, (out + err)[-500:])
    assert not bad, bad
