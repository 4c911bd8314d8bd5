"""Checkpoint pieces that need no DeepSpeed engine: RNG capture, weights files, init_from.

Engine-level save/load/kill tests: test_checkpoint_faults.py.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from megablu.checkpoint import (
    CheckpointError,
    get_rng_state,
    load_weights,
    read_weights,
    save_weights,
    set_rng_state,
    verify_checkpoint,
)
from megablu.config.schema import ModelConfig, RopeConfig, YarnConfig
from megablu.model.decoder import BluModel

TINY = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return BluModel(ModelConfig(**{**TINY, **kw}), RopeConfig(theta=10000))


def test_rng_state_roundtrip_all_three_generators():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    st = get_rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(st)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("tie", [False, True])
def test_weights_roundtrip_exact(tmp_path, tie):
    src, dst = _model(0, tie_embeddings=tie), _model(1, tie_embeddings=tie)
    save_weights(src.state_dict(), tmp_path / "model.safetensors")
    load_weights(dst, tmp_path / "model.safetensors")
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), k
    if tie:  # stored once, restored as an alias, still tied after loading
        assert dst.lm_head.weight.data_ptr() == dst.embed_tokens.weight.data_ptr()


def test_shape_mismatch_and_missing_are_named(tmp_path):
    save_weights(_model(0).state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight: file \(64, 32\) vs model \(80, 32\)"):
        load_weights(_model(0, ffn_dim=80), tmp_path / "model.safetensors")
    sd = _model(0).state_dict()
    del sd["layers.1.self_attn.k_proj.weight"]
    save_weights(sd, tmp_path / "partial.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \['layers.1.self_attn.k_proj.weight'\]"):
        load_weights(_model(0), tmp_path / "partial.safetensors")


def test_init_from_clear_error_when_absent(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_weights(_model(), tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="expected a run dir, a checkpoint step dir, an exported or transformers"):
        load_weights(_model(), tmp_path / "empty")


def test_init_from_hf_directory_saved_by_transformers(tmp_path):
    """A transformers save_pretrained dir (HF names, tied lm_head omitted) loads into BluModel."""
    from megablu.model.hf import to_hf

    rope = RopeConfig(theta=10000, yarn=YarnConfig(factor=2.0, original_max_position=64))
    torch.manual_seed(0)
    src = BluModel(ModelConfig(**TINY, tie_embeddings=True), rope)
    to_hf(src).save_pretrained(tmp_path / "hf")
    dst = BluModel(ModelConfig(**TINY, tie_embeddings=True), rope)
    load_weights(dst, tmp_path / "hf")
    x = torch.randint(0, 97, (1, 20))
    assert torch.equal(src(x), dst(x))


def test_verify_reports_missing_manifest(tmp_path):
    assert "no manifest.json" in verify_checkpoint(tmp_path)[0]
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {}}))
    assert "checksum mismatch" in verify_checkpoint(tmp_path)[0]


def test_read_weights_strips_hf_prefix(tmp_path):
    sd = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(2, 4)}
    save_weights(sd, tmp_path / "model.safetensors")
    assert sorted(read_weights(tmp_path / "model.safetensors")) == ["lm_head.weight", "norm.weight"]


def test_config_hash_refusal_names_what_changed(tmp_path):
    """A resume whose config hash differs says which recorded field changed (e.g. parallel.sp),
    not only two opaque hashes."""
    from megablu.checkpoint import CheckpointManager

    meta = {
        "config_hash": "aaa",
        "tokenizer": "t",
        "dp": 1,
        "sp": 2,
        "zero_stage": 1,
        "model": {"n_layers": 2, "d_model": 32},
        "rope": {"theta": 1e4, "yarn": None},
        "window": 512,
    }
    saved = {"config_hash": "aaa", "tokenizer": "t", "meta": dict(meta)}
    mgr = CheckpointManager(
        tmp_path / "run-0001",
        keep=1,
        meta={**meta, "config_hash": "bbb", "sp": 1, "dp": 2, "rope": {"theta": 1e4, "yarn": {"factor": 2.0}}},
    )
    with pytest.raises(CheckpointError) as e:
        mgr.check_compatible(saved)
    msg = str(e.value)
    assert "config_hash='aaa' but this run has config_hash='bbb'" in msg
    assert "sp saved 2, now 1" in msg and "rope.yarn saved None, now {'factor': 2.0}" in msg
    assert "dp saved" not in msg and "model." not in msg  # unchanged fields are not listed
    mgr.check_compatible(saved, allow_config_change=True)  # a deliberate change


def _publish(mgr, step: int) -> None:
    """step_<step> as save() publishes it (a manifest naming this run, every file listed with its
    size and sha256), then save()'s keep-N: prune(newest=the step just published)."""
    from megablu.checkpoint import MANIFEST, WEIGHTS, step_name
    from megablu.checkpoint.layout import _manifest_digest
    from megablu.utils.files import sha256_file

    d = mgr.ckpt_dir / step_name(step)
    d.mkdir(parents=True)
    (d / WEIGHTS).write_bytes(bytes([step]) * 8)
    m = {
        "format": 1,
        "run_id": mgr.run_id,
        "step": step,
        "files": {WEIGHTS: {"size": 8, "sha256": sha256_file(d / WEIGHTS)}},
    }
    m["manifest_sha256"] = _manifest_digest(m)
    (d / MANIFEST).write_text(json.dumps(m))
    mgr.prune(newest=d)


def _rotate(run_dir, keep: int, keep_every: int, steps: int = 10, half_written=()) -> dict[int, list[int]]:
    """A save every step through the run's CheckpointManager: {step: the steps on disk after its save}."""
    from megablu.checkpoint import CheckpointManager, step_name, step_of

    mgr = CheckpointManager(run_dir, keep=keep, meta={}, keep_every=keep_every)
    after = {}
    for s in range(1, steps + 1):
        if s in half_written:  # a step dir without its manifest (not what save() publishes, but on disk)
            (mgr.ckpt_dir / step_name(s)).mkdir(parents=True)
        else:
            _publish(mgr, s)
        after[s] = [step_of(p) for p in mgr.steps()]
    return after


def test_keep_every_steps_are_never_rotated_out(tmp_path):
    """keep=1, keep_every=3, a save every step: 3, 6, 9 stay beside the newest; keep counts only the
    others (after the save of 9, kept by keep_every, the newest other step, 8, is still there)."""
    from megablu.checkpoint import newest_verified, scan_steps, step_name

    run = tmp_path / "run-0001"
    after = _rotate(run, keep=1, keep_every=3)
    assert after[10] == [3, 6, 9, 10]
    assert after[9] == [3, 6, 8, 9] and after[4] == [3, 4] and after[2] == [2]
    # the run's newest verified checkpoint is still its newest, not a kept older one
    assert newest_verified(run) == run / "checkpoints" / step_name(10)
    assert scan_steps(run) == (run / "checkpoints" / step_name(10), [])
    # a half-written step is neither counted in keep nor deleted
    after = _rotate(tmp_path / "run-0002", keep=1, keep_every=3, half_written=(5,))
    assert after[10] == [3, 5, 6, 9, 10]


def test_keep_every_off_rotates_as_before(tmp_path):
    assert _rotate(tmp_path / "run-0001", keep=1, keep_every=0)[10] == [10]
    assert _rotate(tmp_path / "run-0002", keep=2, keep_every=0)[10] == [9, 10]
    # keep_every larger than the run: nothing is kept by it
    assert _rotate(tmp_path / "run-0003", keep=1, keep_every=11)[10] == [10]
