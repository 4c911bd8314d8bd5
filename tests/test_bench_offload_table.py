"""bench/offload_table.py joins the offload calls' jsonl into the experiments/zero_offload/README.md table: a
run's lines merge into one row, a later call replaces a row, ratios use the same call's
ZeRO-1 step at the same window, and an unverified window says why."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import offload_table  # noqa: E402

pytestmark = pytest.mark.bench


def _row(setting, **kw):
    r = {"shape": "s", "setting": setting, "params_b": 0.5, "static_gb": 6.0, "mb_per_token": 0.4, "fit_T": 16384}
    return json.dumps(dict(r, **kw))


def _write(path, *lines):
    path.write_text("\n".join(lines) + "\nnot json: a log line\n")
    return str(path)


def test_merge_replace_and_ratios(tmp_path):
    a = _write(
        tmp_path / "a.jsonl",
        _row("z1", tok_s_at_fit=30000, predicted_T=300000),
        _row("z1", tok_s_at_fit=30000, predicted_T=300000, max_T=280000, oom_at=[300000]),
        _row("z2_opt", tok_s_at_fit=15000, predicted_T=330000, max_T=330000),
        _row("z3_opt", tok_s_at_fit=9000, predicted_T=320000),
    )  # fit only: verification cut
    b = _write(
        tmp_path / "b.jsonl",
        _row("z1", tok_s_at_fit=24000, predicted_T=290000, max_T=290000),
        _row("z3_opt", tok_s_at_fit=12000, predicted_T=330000),
        _row("z3_opt", tok_s_at_fit=12000, predicted_T=330000, oom_at=[330000]),
        json.dumps({"shape": "s", "setting": "z3_opt", "error": "exit 124"}),
    )
    rows, base = offload_table.load([a, b])
    by = {r["setting"]: r for r in rows}
    assert [r["setting"] for r in rows] == ["z1", "z2_opt", "z3_opt"]
    assert by["z1"]["max_T"] == 290000 and "oom_at" not in by["z1"]  # b replaced a's whole row
    md = offload_table.table(rows, base).splitlines()
    z2 = next(line for line in md if "ZeRO-2" in line)
    assert "330,000 | 1.14x" in z2  # window vs the newest ZeRO-1 row
    assert "15,000 (16k) | 0.50x" in z2  # tok/s vs ZeRO-1 of the SAME call (30k)
    z3 = next(line for line in md if "ZeRO-3 + optimizer offload" in line)
    assert "none verified (330,000 predicted; OOM at 330,000; the retry at -10% ran out of time)" in z3
    assert "12,000 (16k) | 0.50x" in z3  # b's own baseline: 24k


def test_cli_refuses_empty_input(tmp_path):
    empty = _write(tmp_path / "e.jsonl")
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "offload_table.py"), empty], capture_output=True, text=True
    )
    assert r.returncode == 1 and "no rows" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "offload_table.py")], capture_output=True, text=True)
    assert r.returncode == 2


def test_results_of_2026_12_03_render():
    results = ROOT / "experiments" / "zero_offload" / "results" / "2026-12-03"
    files = sorted(str(p) for p in results.glob("offload_*.jsonl"))
    rows, base = offload_table.load(files)
    assert len(rows) == 10  # every shape x setting was measured
    md = offload_table.table(rows, base)
    assert "| blu-1.5b | ZeRO-1, no offload | 1.527B | 26.38 | 0.7029 | 33.66 | 163,840 |" in md
    assert "none verified" not in md  # offload_4 re-ran the two that were not
    assert "| ZeRO-2 + optimizer offload | 1.527B | 8.46 | 0.7029 | 3.53 | 172,032 (OOM at 192,512) | 1.05x |" in md
