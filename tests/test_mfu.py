"""MFU in metrics.csv (issue 17 item 5): model flops per GPU per second over the GPU's dense bf16 peak."""

from pathlib import Path

import pytest

from megablu.config import load_config
from megablu.plan import flops_per_token
from megablu.train.metrics import COLUMNS
from megablu.utils.device import mfu, peak_bf16_tflops

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.1),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA B200", 2250.0),
        ("Tesla T4", None),
        ("NVIDIA H20", None),
    ],
)
def test_peak_by_device_name(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_one_peak_table():
    """The planner's step-time model reads its H200 peak from the same table as MFU (utils/device.py), not a
    number of its own."""
    from megablu.plan import PEAK_TFLOPS_H200

    assert PEAK_TFLOPS_H200 == peak_bf16_tflops("NVIDIA H200") is not None


def test_mfu_matches_the_documented_h200_figure():
    """blu-0.5b at 32k, 34.1k tokens/s on one H200: the 36% MFU experiments/speed/LOG.md and issue 17 quote."""
    cfg = load_config(ROOT / "configs" / "base.yaml", world_size=2, device="cuda")
    u = mfu(flops_per_token(cfg.model, 32768), 34_100, 1.0, peak_bf16_tflops("NVIDIA H200"))
    assert abs(u - 0.355) < 0.001  # 35.5%, quoted as 36% (34.2-34.9k there)
    assert mfu(1e9, 1000, 1.0, None) is None  # no peak known (CPU, an unlisted GPU): not guessed


@pytest.mark.e2e
def test_metrics_csv_has_mfu_and_a_cpu_run_leaves_it_empty(tmp_path, stdlib_data):
    import csv
    import os
    import subprocess
    import sys

    assert COLUMNS[-1] == "mfu"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "ext32k.py"),
            "--config",
            str(ROOT / "tests" / "configs" / "tiny_cpu.yaml"),
            "--set",
            f"runs_dir={tmp_path}",
            "--set",
            f"data.path={stdlib_data}",
            "--set",
            "train.max_steps=3",
            "--set",
            "schedule.warmup_steps=1",
            "--set",
            "checkpoint.every_steps=0",
            "--set",
            "train.probe_steps=0",
        ],
        capture_output=True,
        text=True,
        env={**env, "DS_ACCELERATOR": "cpu"},
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = tmp_path.glob("tiny_cpu-*")
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(row["mfu"] == "" for row in rows)
