"""bench/eval_decode.py runs on a CPU at a tiny size: one row per (length, mode), the modes' tokens equal."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_eval_decode_bench_tiny(tmp_path):
    out = tmp_path / "rows.json"
    args = [
        "--model",
        "tiny",
        "--lengths",
        "64",
        "160",
        "--max-new",
        "6",
        "--batch",
        "3",
        "--batches",
        "1",
        "--modes",
        "eager",
        "static",
        "--device",
        "cpu",
        "--json",
        str(out),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "eval_decode.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["length"], x["mode"]) for x in rows] == [(64, "eager"), (64, "static"), (160, "eager"), (160, "static")]
    assert all(x["agree"] == 1.0 and x["prompts"] == 3 for x in rows)
    assert r.stdout.count("\n| ") == 5  # the header rule and four rows, on stdout
