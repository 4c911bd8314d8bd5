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

import pytest
import torch
import yaml

from megablu.checkpoint import parent_record, save_weights
from megablu.checkpoint.layout import _manifest_digest
from megablu.config.lineage import ParentRecord, rope_differences, rope_lineage_problems
from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.model.decoder import BluModel

ROOT = Path(__file__).resolve().parents[2]
TINY_EXT = ROOT / "tests" / "configs" / "tiny_cpu_ext.yaml"


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
    assert rope_lineage_problems(rope(), 256, blind) == []  # nothing to check against, warned
    errs = rope_lineage_problems(rope(factor=2.0, orig=256), 512, blind)
    assert len(errs) == 1 and "records no training window" in errs[0]


def test_rope_differences_names_fields():
    assert rope_differences(rope(factor=2.0, orig=256), rope(factor=2.0, orig=256)) == []
    d = rope_differences(rope(factor=2.0, orig=256), rope())
    assert (
        len(d) == 1
        and d[0].startswith("rope.yarn: {'factor': 2.0, 'original_max_position': 256")
        and d[0].endswith("} vs None")
    )
    assert rope_differences(rope(factor=2.0, orig=256), rope(factor=4.0, orig=256)) == ["rope.yarn.factor: 2.0 vs 4.0"]
    assert rope_differences(rope(factor=2.0, orig=256), rope(factor=2.0, orig=256, apply="beyond_original")) == [
        "rope.yarn.apply: always vs beyond_original"
    ]


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
    assert parent_record(tmp_path / "hf" / "model.safetensors").window == 256  # a file inside such a dir
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
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "ext32k.py"),
            "--config",
            str(TINY_EXT),
            "--set",
            f"runs_dir={tmp_path}/runs",
            *sum((["--set", s] for s in sets), []),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def _hf_parent(tmp_path, window=256, r=None) -> Path:
    """The tiny_cpu shape saved by transformers, trained (so its config says) at `window`."""
    from megablu.config import load_config
    from megablu.model.hf import to_hf

    cfg = load_config(ROOT / "tests" / "configs" / "tiny_cpu.yaml")
    torch.manual_seed(0)
    to_hf(BluModel(cfg.model, r or cfg.rope), max_position=window).save_pretrained(tmp_path / "parent")
    return tmp_path / "parent"


def test_entry_refuses_the_seeds_trap_before_any_rank(tmp_path, stdlib_data):
    """The issue's case: a parent trained at 256, extended with factor 4 x original 128 = 512."""
    parent = _hf_parent(tmp_path)
    r = _entry(
        tmp_path,
        [
            f"init_from={parent}",
            f"data.path={stdlib_data}",
            "rope.yarn.factor=4",
            "rope.yarn.original_max_position=128",
        ],
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "rope.yarn.original_max_position=128 but the parent" in r.stderr and "trained at window 256" in r.stderr
    assert "set rope.yarn.original_max_position=256 and rope.yarn.factor=2" in r.stderr
    assert not (tmp_path / "runs").exists()
    # and a parent that is itself YaRN-extended: say what to set
    yp = _hf_parent(tmp_path / "y", window=512, r=rope(theta=1e4, factor=2.0, orig=256))
    r = _entry(
        tmp_path,
        [
            f"init_from={yp}",
            f"data.path={stdlib_data}",
            "data.window=1024",
            "rope.yarn.factor=2",
            "rope.yarn.original_max_position=512",
        ],
    )
    assert r.returncode == 2 and "itself YaRN-extended" in r.stderr, r.stderr[-3000:]
    assert "set rope.yarn.original_max_position=256 and rope.yarn.factor=4" in r.stderr


@pytest.mark.e2e
def test_eval_refuses_another_rope_unless_overridden(tmp_path):
    """megablu eval of a plain-RoPE parent with a YaRN config: exit 2, unless --rope-override,
    and then the result records the override and the checkpoint's rope."""
    parent = _hf_parent(tmp_path)
    base = [
        sys.executable,
        "-m",
        "megablu.cli",
        "eval",
        "--config",
        str(TINY_EXT),
        "--hf",
        str(parent),
        "--step",
        "0",
        "--lengths",
        "120",
        "--n",
        "1",
        "--no-plot",
        "--out",
        str(tmp_path / "ev"),
        "--set",
        "eval.max_new=8",
        "--set",
        "eval.pad=8",
    ]
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
    assert res["rope"]["yarn"]["factor"] == 2.0  # what the eval actually ran with
    # the same rope as the weights: no override needed, none recorded (another model than the override's: another
    # --out, since an eval never writes over another model's result)
    r = subprocess.run(
        base + ["--set", "rope.yarn=null", "--set", "data.window=256", "--out", str(tmp_path / "ev2")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rope_override" not in json.loads((tmp_path / "ev2" / "step_0.json").read_text())


# --------------------------------------------------------------------------- holes found by the second review
# Each of these trained (or read a record that lied) on the code before the fix.
def test_yarn_without_any_parent_is_refused_unless_allowed():
    """An empty `--set init_from=$PARENT` left init_from null: the 'extension' trained YaRN on
    random weights with exit 0. Without a parent, YaRN is refused unless allowed on purpose."""
    errs = rope_lineage_problems(rope(factor=4.0, orig=128), 512, None)
    assert len(errs) == 1 and errs[0].startswith("init_from: not set, but rope.yarn is (YaRN factor 4")
    assert "rope.allow_yarn_from_scratch=true" in errs[0]
    assert rope_lineage_problems(rope(), 256, None) == []  # plain RoPE from scratch: a pretrain
    ok = RopeConfig(theta=1e4, yarn=YarnConfig(factor=4.0, original_max_position=128), allow_yarn_from_scratch=True)
    assert rope_lineage_problems(ok, 512, None) == []


def test_empty_init_from_and_no_parent_are_refused_by_the_launch_checks(tmp_path, stdlib_data):
    base = [
        sys.executable,
        "-m",
        "megablu.cli",
        "config",
        "check",
        str(TINY_EXT),
        "--world-size",
        "2",
        "--set",
        f"runs_dir={tmp_path}/runs",
        "--set",
        f"data.path={stdlib_data}",
        "--set",
        "rope.yarn.factor=4",
        "--set",
        "rope.yarn.original_max_position=128",
    ]
    for empty, want in (
        ("init_from=", "init_from: not set, but rope.yarn is"),  # YAML null
        ('init_from=""', "init_from='' is empty"),
    ):
        r = subprocess.run(base + ["--set", empty], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 2 and want in r.stderr, (empty, r.stderr[-2000:])
    assert not (tmp_path / "runs").exists()
    r = subprocess.run(
        base + ["--set", "rope.allow_yarn_from_scratch=true"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_explicit_parent_attention_factor_is_not_silently_dropped():
    parent = rec(512, rope(factor=2.0, orig=256, attention_factor=1.0))
    errs = rope_lineage_problems(rope(factor=4.0, orig=256), 1024, parent)
    assert len(errs) == 1 and errs[0].startswith("rope.yarn.attention_factor: unset (so 1.139 = 0.1 ln(4) + 1)")
    assert "set rope.yarn.attention_factor=1 to keep" in errs[0]
    # an explicit value is a decision, kept; a parent on YaRN's default has nothing to keep
    assert rope_lineage_problems(rope(factor=4.0, orig=256, attention_factor=1.2), 1024, parent) == []
    assert rope_lineage_problems(rope(factor=4.0, orig=256), 1024, rec(512, rope(factor=2.0, orig=256))) == []


def test_the_record_is_read_from_the_step_the_weights_come_from(tmp_path):
    """A run whose newest step is damaged (same size, a byte flipped): the weights come from the
    older step, so must the record. Before, the record came from the newest step by size only."""
    from tests.bad_input_lab import Lab, flip_byte_keep_stat

    lab = Lab(tmp_path / "lab")
    run = lab.fresh("parent") / "p-0001"
    run.mkdir()
    old, new = lab.config(), lab.config(["data.window=128", "train.tokens_per_step=1024"])
    lab.step(run, 2, old, weights=lab.weights(old))  # trained at 256
    s4 = lab.step(run, 4, new, weights=lab.weights(new))  # records 128; damaged below
    flip_byte_keep_stat(s4 / "model.safetensors", offset=(s4 / "model.safetensors").stat().st_size - 5)
    assert parent_record(run).window == 256 and parent_record(run).source.endswith("step_0000002/manifest.json")
    child = [
        "init_from=" + str(run),
        "data.window=512",
        "train.tokens_per_step=2048",
        "rope.yarn={factor: 4.0, original_max_position: 128}",
    ]  # right for the damaged step only
    r = lab.check(child)
    assert r.rc == 2 and "trained at window 256" in r.err, r.err[-2000:]


def test_trainer_built_without_the_preflight_refuses_a_contradicting_rope(tmp_path):
    """The Python API (Trainer(cfg)) skips launch/ext32k.py's preflight: the Trainer applies the
    same rule before any rank or run dir exists."""
    from megablu.config import ConfigError
    from megablu.train.trainer import Trainer
    from tests.bad_input_lab import Lab

    lab = Lab(tmp_path / "lab")
    parent = lab.parent()
    child = lab.config(
        [
            f"init_from={parent}",
            "data.window=512",
            "train.tokens_per_step=2048",
            "rope.yarn={factor: 4.0, original_max_position: 128}",
        ]
    )
    with pytest.raises(ConfigError, match="rope.yarn.original_max_position=128 but the parent"):
        Trainer(child)
    with pytest.raises(ConfigError, match="init_from: not set, but rope.yarn is"):
        Trainer(child.model_copy(update={"init_from": None}))
    assert not (tmp_path / "lab" / "runs").exists()


def test_resume_of_a_run_whose_rope_contradicts_its_parent_is_refused(tmp_path):
    """A run started before the check (or through the API) with the seed's trap: every step
    inherits it, so a resume is refused with the reason, and nothing is written."""
    from tests.bad_input_lab import Lab

    lab = Lab(tmp_path / "lab")
    parent = lab.parent()
    sets = [
        f"init_from={parent}",
        "data.window=512",
        "train.tokens_per_step=2048",
        "rope.yarn={factor: 4.0, original_max_position: 128}",
    ]
    runs, run = lab.run(sets=sets)
    r = lab.check([f"runs_dir={runs}", *sets], "--resume", run.name)
    assert r.rc == 2, r.err[-2000:]
    assert f"--resume {run.name}: the run started from init_from {parent}" in r.err
    assert "rope.yarn.original_max_position=128 but the parent" in r.err and "start a new run" in r.err
    # the same run with the rope its parent allows resumes
    good = [
        f"init_from={parent}",
        "data.window=512",
        "train.tokens_per_step=2048",
        "rope.yarn={factor: 2.0, original_max_position: 256}",
    ]
    runs, run = lab.run(sets=good)
    assert lab.check([f"runs_dir={runs}", *good], "--resume", run.name).rc == 0


def test_a_sharded_transformers_parent_by_its_index_file(tmp_path):
    """model.safetensors.index.json given directly: the shards it names are the weights (one
    clear message for a bad rope, none for a good one; before: 'no such file or directory')."""
    from megablu.checkpoint import read_weights
    from megablu.config import load_config
    from megablu.model.hf import to_hf
    from tests.bad_input_lab import Lab

    cfg = load_config(ROOT / "tests" / "configs" / "tiny_cpu.yaml")
    torch.manual_seed(0)
    model = BluModel(cfg.model, cfg.rope)
    to_hf(model, max_position=256).save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    idx = tmp_path / "hf" / "model.safetensors.index.json"
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    sd = read_weights(idx)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items() if k != "lm_head.weight")
    lab = Lab(tmp_path / "lab")
    assert lab.check([f"init_from={idx}"]).rc == 0
    r = lab.check(
        [
            f"init_from={idx}",
            "data.window=512",
            "train.tokens_per_step=2048",
            "rope.yarn={factor: 4.0, original_max_position: 128}",
        ]
    )
    problems = [ln for ln in r.err.splitlines() if ln.startswith("  - ")]
    assert r.rc == 2 and len(problems) == 1 and "trained at window 256" in problems[0], r.err
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"x")
    r = lab.check([f"init_from={tmp_path / 'hf' / 'pytorch_model.bin'}"])
    assert r.rc == 2 and "pytorch_model.bin is not safetensors weights" in r.err, r.err


def test_no_default_window_in_an_hf_config():
    """to_hf / hf_config_dict wrote max_position_embeddings=4096 when not told: a record saying
    the model was trained at 4096, which a child's original_max_position was then checked against."""
    from megablu.model.hf import hf_config_dict, to_hf

    m = BluModel(ModelConfig(**TINY), rope())
    with pytest.raises(ValueError, match="max_position: the window the model was trained at"):
        hf_config_dict(m.cfg, m.rope_cfg)
    with pytest.raises(ValueError, match="max_position"):
        to_hf(m)
    assert hf_config_dict(m.cfg, m.rope_cfg, 256)["max_position_embeddings"] == 256
    y = rope(factor=4.0, orig=256)  # YaRN: factor * original is the trained window
    assert hf_config_dict(m.cfg, y)["max_position_embeddings"] == 1024


def test_export_of_a_step_that_records_no_window_is_refused(tmp_path):
    from megablu.cli import main
    from tests.bad_input_lab import Lab

    step = Lab(tmp_path / "lab").run_without_window()
    assert main(["ckpt", "export", str(step), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "rope_json,top",
    [
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, {}),  # original left out
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {"rope_theta": 5e4}),  # 4.x
        (
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32},
            {"original_max_position_embeddings": 64},
        ),  # Phi-3: top level wins
    ],
)
def test_hf_yarn_record_is_what_transformers_computes(rope_json, top):
    """The parent's record from config.json must be the rope transformers runs the weights with,
    whatever the spelling; the frequencies and attention factor are compared with its own."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megablu.model.hf import rope_record_from_hf
    from megablu.model.rope import yarn_inv_freq

    d = dict(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=80,
        vocab_size=97,
        max_position_embeddings=256,
        **top,
    )
    d["rope_parameters" if "rope_theta" in rope_json else "rope_scaling"] = rope_json
    r, window = rope_record_from_hf(d)
    assert window == 256
    cfg = transformers.LlamaConfig(**d)
    ref, ref_att = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    y = r.yarn
    inv, att = yarn_inv_freq(
        16, r.theta, y.factor, y.original_max_position, y.beta_fast, y.beta_slow, y.truncate, y.attention_factor
    )
    torch.testing.assert_close(inv.float(), ref.float())
    assert att == pytest.approx(ref_att)


def test_hf_records_transformers_cannot_run_are_refused():
    from megablu.model.hf import rope_record_from_hf

    base = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
    for rp, why in (
        ({"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 64}, "factor"),
        ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "rope_type='llama3'"),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}, "mscale"),
        ({"rope_type": "default"}, "no rope_theta"),
    ):
        with pytest.raises(ValueError, match=why):
            rope_record_from_hf({**base, "rope_parameters": rp})


def test_entry_refuses_through_the_trainer_guard_when_the_preflight_let_it_pass(tmp_path, monkeypatch):
    """Defence in depth: with the preflight's init_from check removed, the entry still exits 2 with
    the rule's message from Trainer() (no traceback, no run dir)."""
    from megablu.train import preflight
    from tests.bad_input_lab import Lab

    monkeypatch.setattr(preflight, "CHECKS", [c for c in preflight.CHECKS if c[0] != "init_from"])
    lab = Lab(tmp_path / "lab")
    runs = tmp_path / "runs"
    r = lab.entry(
        [
            f"runs_dir={runs}",
            f"init_from={lab.parent()}",
            "data.window=512",
            "train.tokens_per_step=2048",
            "rope.yarn={factor: 4.0, original_max_position: 128}",
        ]
    )
    assert r.rc == 2 and r.exc is None and "Traceback" not in r.err, r.err[-2000:]
    assert "rope.yarn.original_max_position=128 but the parent" in r.err
    assert not runs.exists()


def test_export_of_a_run_evaluated_with_string_says_the_export_scores_plain(tmp_path, caplog):
    """STRING (eval.string) changes megablu's attention at inference; transformers has none. An export
    of a run whose checkpoint was evaluated with it still writes the weights, and says -- in a warning
    and in megablu_export.json -- that the exported model scores as the plain one. The STRING eval
    here writes its result outside the run (as experiments/smol32k/run.sh does): `megablu eval` records it
    in the run's eval/string_evals.jsonl. A plain eval leaves no note; unreadable records are skipped."""
    import logging

    from megablu.cli import main
    from tests.bad_input_lab import Lab

    lab = Lab(tmp_path / "lab")
    _, run = lab.run(steps=(2,), with_weights=True)
    ev = [
        "eval",
        "--config",
        str(lab.cfg_file),
        "--ckpt",
        str(run / "checkpoints" / "step_0000002"),
        "--tasks",
        "passkey",
        "--lengths",
        "200",
        "--n",
        "2",
        "--no-plot",
        "--set",
        "eval.lengths=[200]",
        "--set",
        "eval.loss.data=null",
    ]
    assert main([*ev, "--out", str(tmp_path / "plain_eval")]) in (0, 1)
    assert not (run / "eval").exists()  # a plain eval records nothing
    (run / "eval").mkdir()
    (run / "eval" / "step_0000001.json").write_text("[]")  # parses, but no mapping
    (run / "eval" / "string_evals.jsonl").write_text("not json\n")
    assert main(["ckpt", "export", str(run), "--out", str(tmp_path / "plain")]) == 0
    assert "string_not_exported" not in json.loads((tmp_path / "plain" / "megablu_export.json").read_text())
    assert main(
        [
            *ev,
            "--out",
            str(tmp_path / "elsewhere"),
            "--set",
            "eval.string.variant=fixed_shift",
            "--set",
            "eval.string.shift=64",
            "--set",
            "eval.string.local=8",
        ]
    ) in (0, 1)
    with caplog.at_level(logging.WARNING, logger="megablu.checkpoint.weights"):
        assert main(["ckpt", "export", str(run), "--out", str(tmp_path / "str")]) == 0
    note = json.loads((tmp_path / "str" / "megablu_export.json").read_text())["string_not_exported"]
    assert str((tmp_path / "elsewhere").resolve()) in note and "scores as the plain model" in note, note
    assert any("transformers has no STRING" in r.getMessage() for r in caplog.records)


def test_a_norm_eps_that_passed_through_float32_is_the_same_architecture():
    """transformers' GGUF loader records rms_norm_eps as float32(1e-5) = 9.999999747378752e-06;
    that is SmolLM2's own eps, not another function. Another eps (1e-6) still differs."""
    from megablu.config.lineage import architecture_problems

    base = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
    cfg = ModelConfig(**base, norm_eps=1e-5)
    assert architecture_problems(ModelConfig(**base, norm_eps=9.999999747378752e-06), cfg, "ckpt") == []
    (p,) = architecture_problems(ModelConfig(**base, norm_eps=1e-6), cfg, "ckpt")
    assert "model.norm_eps=1e-05 vs 1e-06" in p
