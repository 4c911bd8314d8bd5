"""dev/rep_tools.py prompts-match: results of an earlier session are reused only when today's code
builds the very same prompts (digest per cell); --prune removes the ones that differ."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megablu.config.schema import EvalConfig, TokenizerConfig
from megablu.data.tokenizer import load_tokenizer
from megablu.eval.harness import build_prompts
from megablu.eval.prompts import prompt_digest

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]


def _result(d: Path, cfg: EvalConfig, digest_of) -> None:
    cells = [{"task": t, "length": L, "n": cfg.n, "digest": digest_of(t, L)} for t in cfg.tasks for L in cfg.lengths]
    d.mkdir(parents=True)
    (d / "step_0.json").write_text(json.dumps({"eval": cfg.model_dump(), "cells": cells}))


def test_prompts_match_keeps_same_prompts_and_prunes_others(tmp_path):
    tok = load_tokenizer(TokenizerConfig(kind="tiktoken_file", path="megablu:stdlib4k"))
    cfg = EvalConfig(tasks=["passkey", "vt"], lengths=[700, 1000], n=5, seed=3)
    real = build_prompts(cfg, tok)
    _result(tmp_path / "ev" / "same", cfg, lambda t, L: prompt_digest(real[(t, L)]))
    other = build_prompts(cfg.model_copy(update={"seed": 4}), tok)  # an earlier session's prompts: another seed
    _result(
        tmp_path / "ev" / "old",
        cfg,
        lambda t, L: prompt_digest(other[(t, L)]) if L == 1000 else prompt_digest(real[(t, L)]),
    )
    # a dir of two results (two steps of one arm), the second of other prompts: the dir as a whole is not reusable
    _result(tmp_path / "ev" / "two", cfg, lambda t, L: prompt_digest(real[(t, L)]))
    (tmp_path / "ev" / "two" / "step_5.json").write_text(
        json.dumps(
            {
                "eval": cfg.model_dump(),
                "cells": [{"task": "vt", "length": 700, "n": cfg.n, "digest": prompt_digest(other[("vt", 700)])}],
            }
        )
    )
    cmd = [
        sys.executable,
        str(ROOT / "dev" / "rep_tools.py"),
        "prompts-match",
        str(tmp_path / "ev"),
        "--tokenizer",
        "tiktoken_file:megablu:stdlib4k",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert "same: same prompts" in r.stdout
    assert "old: DIFFERENT prompts: passkey@1000, vt@1000" in r.stdout, r.stdout
    assert "two: DIFFERENT prompts: vt@700" in r.stdout, r.stdout
    r = subprocess.run(cmd + ["--prune"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["same"]


def test_positions_bins_samples_by_needle_position(tmp_path):
    """rep_tools.py positions: correct/n per bin of the needle's position, and the tokens back to the question."""
    samples = [
        {"task": "passkey", "length": 8192, "depth": d, "correct": ok}
        for d, ok in ((0.01, True), (0.2, False), (0.3, False), (0.3, True), (0.9, True))
    ]
    samples.append({"task": "needle", "length": 8192, "depth": 0.5, "correct": True})  # another task: left out
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"arm": "x", "step": 7, "samples": samples}))
    r = subprocess.run(
        [sys.executable, str(ROOT / "dev" / "rep_tools.py"), "positions", str(f), "--bin", "2048"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "x@7 passkey 8192"
    assert lines[1].split() == ["at", "0.0k", "2.0k", "6.0k"]  # bins 0 (0.01, 0.2), 1 (0.3 x2), 3 (0.9)
    assert lines[2].split() == ["back", "8.0k", "6.0k", "2.0k"]
    assert lines[3].split() == ["found", "1/2", "1/2", "1/1"]
