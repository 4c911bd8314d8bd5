"""bench/grad_check_bench.py on CPU: both variants run, and the fused one makes none of DeepSpeed's per-tensor
check calls (what the GPU run measures the time of)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MEGABLU_SLOW") != "1",
    reason="the device bench's CPU rehearsal (~20 s on CI): "
    "MEGABLU_SLOW=1; tests/train/test_grad_check.py counts the same calls",
)
def test_grad_check_bench_cpu(tmp_path):
    r = subprocess.run(
        [sys.executable, "bench/grad_check_bench.py", "--iters", "2", "--T", "32", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port())},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads((tmp_path / "grad_check_bench.json").read_text())}
    stock, fused = rows["deepspeed"], rows["fused"]
    assert stock["tensors"] == fused["tensors"] == 327  # blu-0.5b's tensor count
    sc, fc = stock["check_calls"], fused["check_calls"]
    assert sc["isfinite"] >= 2 * 327 and sc["amax"] == sc["amin"] == 327 and sc["linalg_vector_norm"] >= 327, sc
    assert fc["amax"] == fc["amin"] == 0 and fc["isfinite"] < 10 and fc["linalg_vector_norm"] <= 1, fc
    assert fc["_foreach_norm"] == 3, fc  # the overflow pass, and the norm's per parameter group
    # the rest of the step's calls are DeepSpeed's own per-tensor bookkeeping, launch-free (and the fused check's
    # reads of each tensor's dtype and device): fewer calls in all
    assert stock["torch_calls"] > fused["torch_calls"], (stock["torch_calls"], fused["torch_calls"])
    assert "| fused |" in (tmp_path / "grad_check_bench.md").read_text()


def test_grad_check_bench_l2_model():
    """--model l2 (the GPU run's) is blu-0.5b: configs/l2.yaml's model, loadable on one process."""
    sys.path.insert(0, str(ROOT / "bench"))
    import grad_check_bench

    l2, small = grad_check_bench.model_config("l2"), grad_check_bench.model_config("small36")
    assert (l2.n_layers, l2.d_model, l2.ffn_dim, l2.vocab_size) == (36, 1024, 2816, 100352)
    assert small.n_layers == l2.n_layers and small.tie_embeddings == l2.tie_embeddings
