"""The benchmark's ALST-style peer (HF + checkpointing + DeepSpeed TiledMLP + TiledFusedLogitsLoss)
computes the same loss and gradients as plain HF: the comparison in BENCHMARKS.md is fair."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]


def test_alst_peer_equals_plain_hf():
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "alst_peer.py"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "alst peer == plain HF" in r.stdout
