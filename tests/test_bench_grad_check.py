"""bench/grad_check_bench.py on CPU: both variants run, and the fused one makes none of DeepSpeed's per-tensor
check calls (what the GPU run measures the time of)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_grad_check_bench_cpu(tmp_path):
    r = subprocess.run([sys.executable, "bench/grad_check_bench.py", "--iters", "2", "--T", "32", "--out",
                        str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port())})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads((tmp_path / "grad_check_bench.json").read_text())}
    stock, fused = rows["deepspeed"], rows["fused"]
    assert stock["tensors"] == fused["tensors"] == 327   # blu-0.5b's tensor count
    assert stock["top_calls"]["isfinite"] >= 2 * 327 and "isfinite" not in fused["top_calls"]
    assert stock["torch_calls"] - fused["torch_calls"] > 10 * 327, (stock["torch_calls"], fused["torch_calls"])
    assert "| fused |" in (tmp_path / "grad_check_bench.md").read_text()
