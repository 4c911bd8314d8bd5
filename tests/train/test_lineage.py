"""The child's rope against the init_from parent's record (the seed's -27 pp trap).

`factor * original_max_position == window` holds for 4 * 128 = 512 as well as for 2 * 256:
only the parent's record can tell that the parent was trained at 256. These tests make
parents of every kind megablu reads (a run dir, a step dir, a transformers dir, an export,
a bare weights file) and check that the entry refuses a mismatched child with exit 2
before any rank starts, and that `megablu eval` refuses a rope the checkpoint was not
trained with unless --rope-override, which the result records.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from megablu.checkpoint import parent_record, save_weights
from megablu.checkpoint.layout import _manifest_digest
from megablu.config.lineage import ParentRecord, rope_differences, rope_lineage_problems
from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.model.decoder import BluModel

ROOT = Path(__file__).resolve().parents[2]
TINY_EXT = ROOT / "yaml_configs" / "tiny_cpu_ext.yaml"


def rope(theta=1e4, factor=None, orig=None, **kw):
    return RopeConfig(theta=theta, yarn=YarnConfig(factor=factor, original_max_position=orig, **kw) if factor else None)


def rec(window, r, src="parent"):
    return ParentRecord(src, window, r)


# --------------------------------------------------------------------------- the rules
def test_yarn_original_must_be_the_parents_trained_window():
    assert rope_lineage_problems(rope(factor=2.0, orig=256), 512, rec(256, rope())) == []
    errs = rope_lineage_problems(rope(factor=4.0, orig=128), 512, rec(256, rope()))
    assert len(errs) == 1
    assert "rope.yarn.original_max_position=128" in errs[0] and "trained at window 256" in errs[0]
    assert "set rope.yarn.original_max_position=256 and rope.yarn.factor=2" in errs[0]


def test_theta_change_is_refused_unless_allowed():
    errs = rope_lineage_problems(rope(theta=5e5), 256, rec(256, rope(theta=1e4)))
    assert len(errs) == 1 and "rope.theta=500000" in errs[0] and "rope.theta=10000" in errs[0]
    allowed = RopeConfig(theta=5e5, allow_theta_change=True)
    assert rope_lineage_problems(allowed, 512, rec(256, rope(theta=1e4))) == []


def test_a_yarn_extended_parent_keeps_its_original_and_raises_the_factor():
    parent = rec(512, rope(factor=2.0, orig=256))
    assert rope_lineage_problems(rope(factor=4.0, orig=256), 1024, parent) == []
    # the natural mistake: original = the parent's window
    errs = rope_lineage_problems(rope(factor=2.0, orig=512), 1024, parent)
    assert len(errs) == 1 and "itself YaRN-extended" in errs[0]
    assert "set rope.yarn.original_max_position=256 and rope.yarn.factor=4" in errs[0]
    # dropping YaRN from a YaRN-trained parent
    errs = rope_lineage_problems(rope(), 512, parent)
    assert len(errs) == 1 and "rope.yarn: unset" in errs[0]
    # other betas: other frequencies than the parent learned
    errs = rope_lineage_problems(rope(factor=4.0, orig=256, beta_fast=16.0), 1024, parent)
    assert len(errs) == 1 and "rope.yarn.beta_fast=16.0" in errs[0]


def test_unrecorded_parent_cannot_be_yarn_extended():
    blind = ParentRecord("w.safetensors", None, None)
    assert rope_lineage_problems(rope(), 256, blind) == []          # nothing to check against, warned
    errs = rope_lineage_problems(rope(factor=2.0, orig=256), 512, blind)
    assert len(errs) == 1 and "records no training window" in errs[0]


def test_rope_differences_names_fields():
    assert rope_differences(rope(factor=2.0, orig=256), rope(factor=2.0, orig=256)) == []
    d = rope_differences(rope(factor=2.0, orig=256), rope())
    assert len(d) == 1 and d[0].startswith("rope.yarn: {'factor': 2.0, 'original_max_position': 256") \
        and d[0].endswith("} vs None")
    assert rope_differences(rope(factor=2.0, orig=256), rope(factor=4.0, orig=256)) == \
        ["rope.yarn.factor: 2.0 vs 4.0"]
    assert rope_differences(rope(factor=2.0, orig=256), rope(factor=2.0, orig=256, apply="beyond_original")) == \
        ["rope.yarn.apply: always vs beyond_original"]


# --------------------------------------------------------------------------- reading the record
TINY = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97)


def _step_dir(run: Path, meta: dict) -> Path:
    step = run / "checkpoints" / "step_0000004"
    step.mkdir(parents=True)
    m = {"format_version": 1, "run_id": run.name, "step": 4, "files": {}, "meta": meta}
    m["manifest_sha256"] = _manifest_digest(m)
    (step / "manifest.json").write_text(json.dumps(m))
    return step


def test_parent_record_from_a_run_a_step_and_an_old_manifest(tmp_path):
    r = rope(factor=2.0, orig=256)
    step = _step_dir(tmp_path / "p-0001", {"rope": r.model_dump(mode="json"), "window": 512})
    for src in (tmp_path / "p-0001", step):
        got = parent_record(src)
        assert got.window == 512 and got.rope == r
    # a manifest older than the meta: the run's resolved config says it
    old = tmp_path / "q-0001"
    _step_dir(old, {})
    (old / "config.resolved.yaml").write_text(yaml.safe_dump({"rope": {"theta": 5e5}, "data": {"window": 128}}))
    got = parent_record(old)
    assert got.window == 128 and got.rope == rope(theta=5e5) and got.source.endswith("config.resolved.yaml")


def test_parent_record_from_transformers_dirs_and_bare_files(tmp_path):
    from megablu.model.hf import to_hf

    torch.manual_seed(0)
    plain = BluModel(ModelConfig(**TINY), rope(theta=1e5))
    to_hf(plain, max_position=256).save_pretrained(tmp_path / "hf")
    got = parent_record(tmp_path / "hf")
    assert got.window == 256 and got.rope == rope(theta=1e5)
    assert parent_record(tmp_path / "hf" / "model.safetensors").window == 256   # a file inside such a dir
    ext = BluModel(ModelConfig(**TINY), rope(theta=1e5, factor=4.0, orig=256))
    to_hf(ext).save_pretrained(tmp_path / "hf_yarn")
    got = parent_record(tmp_path / "hf_yarn")
    assert got.window == 1024 and got.rope == rope(theta=1e5, factor=4.0, orig=256)
    (tmp_path / "bare").mkdir()
    save_weights(plain.state_dict(), tmp_path / "bare" / "w.safetensors")
    got = parent_record(tmp_path / "bare" / "w.safetensors")
    assert got.window is None and got.rope is None


# --------------------------------------------------------------------------- the entry and eval
def _entry(tmp_path, sets, world=2):
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0"}
    return subprocess.run([sys.executable, str(ROOT / "launch" / "ext32k.py"), "--config", str(TINY_EXT),
                           "--set", f"runs_dir={tmp_path}/runs", *sum((["--set", s] for s in sets), [])],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _hf_parent(tmp_path, window=256, r=None) -> Path:
    """The tiny_cpu shape saved by transformers, trained (so its config says) at `window`."""
    from megablu.config import load_config
    from megablu.model.hf import to_hf

    cfg = load_config(ROOT / "yaml_configs" / "tiny_cpu.yaml")
    torch.manual_seed(0)
    to_hf(BluModel(cfg.model, r or cfg.rope), max_position=window).save_pretrained(tmp_path / "parent")
    return tmp_path / "parent"


def test_entry_refuses_the_seeds_trap_before_any_rank(tmp_path, stdlib_data):
    """The issue's case: a parent trained at 256, extended with factor 4 x original 128 = 512."""
    parent = _hf_parent(tmp_path)
    r = _entry(tmp_path, [f"init_from={parent}", f"data.path={stdlib_data}", "rope.yarn.factor=4",
                          "rope.yarn.original_max_position=128"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert "rope.yarn.original_max_position=128 but the parent" in r.stderr and "trained at window 256" in r.stderr
    assert "set rope.yarn.original_max_position=256 and rope.yarn.factor=2" in r.stderr
    assert not (tmp_path / "runs").exists()
    # and a parent that is itself YaRN-extended: say what to set
    yp = _hf_parent(tmp_path / "y", window=512, r=rope(theta=1e4, factor=2.0, orig=256))
    r = _entry(tmp_path, [f"init_from={yp}", f"data.path={stdlib_data}", "data.window=1024",
                          "rope.yarn.factor=2", "rope.yarn.original_max_position=512"])
    assert r.returncode == 2 and "itself YaRN-extended" in r.stderr, r.stderr[-3000:]
    assert "set rope.yarn.original_max_position=256 and rope.yarn.factor=4" in r.stderr


def test_eval_refuses_another_rope_unless_overridden(tmp_path):
    """megablu eval of a plain-RoPE parent with a YaRN config: exit 2, unless --rope-override,
    and then the result records the override and the checkpoint's rope."""
    parent = _hf_parent(tmp_path)
    base = [sys.executable, "-m", "megablu.cli", "eval", "--config", str(TINY_EXT), "--hf", str(parent),
            "--step", "0", "--lengths", "120", "--n", "1", "--no-plot", "--out", str(tmp_path / "ev"),
            "--set", "eval.max_new=4", "--set", "eval.pad=8"]
    r = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "differs from the one" in r.stderr and "--rope-override" in r.stderr
    assert "rope.yarn: None vs" in r.stderr
    assert not (tmp_path / "ev").exists()
    r = subprocess.run(base + ["--rope-override"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "ev" / "step_0.json").read_text())
    ov = res["rope_override"]
    assert ov["checkpoint"]["yarn"] is None and ov["differences"][0].startswith("rope.yarn: None vs")
    assert res["rope"]["yarn"]["factor"] == 2.0          # what the eval actually ran with
    # the same rope as the weights: no override needed, none recorded
    r = subprocess.run(base + ["--set", "rope.yarn=null", "--set", "data.window=256"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rope_override" not in json.loads((tmp_path / "ev" / "step_0.json").read_text())
