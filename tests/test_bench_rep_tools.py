"""bench/rep_tools.py prompts-match: results of an earlier session are reused only when today's code
builds the very same prompts (digest per cell); --prune removes the ones that differ."""
import json
import subprocess
import sys
from pathlib import Path

from megablu.config.schema import EvalConfig, TokenizerConfig
from megablu.data.tokenizer import load_tokenizer
from megablu.eval.harness import build_prompts
from megablu.eval.prompts import prompt_digest

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
    other = build_prompts(cfg.model_copy(update={"seed": 4}), tok)   # an earlier session's prompts: another seed
    _result(tmp_path / "ev" / "old", cfg, lambda t, L: prompt_digest(other[(t, L)]) if L == 1000 else
            prompt_digest(real[(t, L)]))
    cmd = [sys.executable, str(ROOT / "bench" / "rep_tools.py"), "prompts-match", str(tmp_path / "ev"),
           "--tokenizer", "tiktoken_file:megablu:stdlib4k"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert "same: same prompts" in r.stdout
    assert "old: DIFFERENT prompts: passkey@1000, vt@1000" in r.stdout, r.stdout
    r = subprocess.run(cmd + ["--prune"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["same"]
