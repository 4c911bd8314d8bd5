"""The probe on CPU: timings, probe.json contents, and the OOM path (a real torch.cuda.OutOfMemoryError)."""

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from megablu import plan
from megablu.config import load_config
from megablu.train.probe import ProbeOOM, run_probe, setup_dict


def test_probe_measures_steps_and_writes_json(tmp_path):
    calls = []

    def step(i):
        calls.append(i)
        torch.ones(64, 64) @ torch.ones(64, 64)

    out = tmp_path / "run" / "probe.json"
    r = run_probe(
        step,
        steps=3,
        tokens_per_rank=1000,
        tokens_per_step=4000,
        device="cpu",
        flops_per_token=1e6,
        peak_tflops=989.0,
        out=out,
    )
    assert calls == [0, 1, 2]
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(r))
    assert saved["steps_done"] == 3 and saved["oom"] is False and len(saved["step_times_s"]) == 3
    # median of the steps after the first; throughput per rank from tokens_per_step
    assert saved["step_time_s"] == pytest.approx(statistics.median(saved["step_times_s"][1:]))
    assert saved["tokens_per_s"] == pytest.approx(4000 / saved["step_time_s"])
    assert saved["mfu"] == pytest.approx(1e6 * 4000 / saved["step_time_s"] / 989e12)
    assert saved["peak_gb"] is None and saved["static_gb"] is None  # no memory accounting on CPU
    # no peak given and none known for this device (CPU): no MFU rather than one against a guessed peak
    r = run_probe(step, steps=2, tokens_per_rank=1000, device="cpu", flops_per_token=1e6, out=None)
    assert "mfu" not in r


def test_probe_oom_is_a_clean_abort_with_numbers_and_suggestion(tmp_path):
    cfg = load_config(
        "configs/l2.yaml",
        ["parallel.sp=1", "data.window=1048576", "rope.yarn={factor: 64, original_max_position: 16384}"],
    )
    setup = setup_dict(cfg, world_size=1)
    assert setup["ops"] == "cuda" and setup["ops_config"] == "auto"

    def step(i):
        if i == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 49.00 GiB")

    out = tmp_path / "probe.json"
    with pytest.raises(ProbeOOM) as ei:
        run_probe(step, steps=3, tokens_per_rank=1048576, device="cpu", setup=setup, out=out)
    e = ei.value
    msg = str(e)
    assert "out of memory in step 2 of 3" in msg and "1,048,576 tokens per rank" in msg
    assert "Tried to allocate 49.00 GiB" in msg
    assert e.measured["steps_done"] == 1 and len(e.measured["step_times_s"]) == 1
    # the planner's view of the same setup rides along: predicted GB and the cheapest fix
    est = plan.estimate(plan.Setup.from_config(cfg, gpus=1))
    assert e.measured["planned_gb"] == pytest.approx(est.allocated_gb)
    assert e.suggestion and e.suggestion in msg
    saved = json.loads(out.read_text())
    assert saved["oom"] is True and saved["suggestion"] == e.suggestion and saved["steps_done"] == 1
    assert saved["error"].startswith("CUDA out of memory")
    assert saved["setup"]["ops"] == "torch"  # step 0 ran on CPU: the reference ops


def test_probe_json_setup_calibrates_the_planner():
    cfg = load_config("configs/l2.yaml", ["parallel.sp=1"])
    s = setup_dict(cfg, world_size=1)
    est = plan.estimate(plan.Setup.from_config(cfg, gpus=1))
    probe = {"setup": s, "static_gb": est.static / 1e9, "peak_gb": est.allocated_gb}
    cal = plan.calibrate(probe)
    assert cal.act_scale == pytest.approx(1.0, rel=1e-6) and cal.static_offset_gb == pytest.approx(0, abs=1e-9)


def test_probe_rejects_zero_steps():
    with pytest.raises(ValueError):
        run_probe(lambda i: None, steps=0, tokens_per_rank=1, device="cpu")


def test_probe_setup_keeps_the_memory_switches():
    """A probe of a tiled/offloaded run calibrates the planner for that setup, not the plain one."""
    cfg = load_config(
        "configs/l2.yaml", ["parallel.sp=1", "memory.mlp_tiles=8", "memory.offload_activations=true"], device="cuda"
    )
    s = plan.Setup.from_json(setup_dict(cfg, world_size=1))
    assert s.mlp_tiles == 8 and s.offload_activations is True
    plain = plan.estimate(plan.Setup.from_config(load_config("configs/l2.yaml", ["parallel.sp=1"]), gpus=1))
    same = plan.estimate(plan.Setup.from_config(cfg, gpus=1))
    assert plan.estimate(s).allocated_gb == pytest.approx(same.allocated_gb)
    assert plan.estimate(s).allocated_gb < plain.allocated_gb


def test_probe_setup_records_the_loss_that_ran(monkeypatch):
    """memory.loss=auto: probe.json's setup holds the implementation the model's head runs (the trainer
    passes model.lm_head.loss, resolved by apply_memory) and the configured value as loss_config; without
    a run, the planner's view of auto for a GPU here (liger when liger_kernel imports)."""
    from megablu.ops import cross_entropy

    monkeypatch.setattr(cross_entropy, "liger_import_problem", lambda: None)
    cfg = load_config("configs/l2.yaml", ["parallel.sp=1"])
    assert cfg.memory.loss == "auto"
    ran = setup_dict(cfg, world_size=1, loss_used="chunked")  # e.g. a CPU run: auto picked chunked
    assert (ran["loss"], ran["loss_config"]) == ("chunked", "auto")
    assert plan.Setup.from_json(ran).loss == "chunked"
    assert setup_dict(cfg, world_size=1)["loss"] == plan.Setup.from_config(cfg, gpus=1).loss == "liger"
    monkeypatch.setattr(cross_entropy, "liger_import_problem", lambda: "liger_kernel is not importable")
    assert plan.Setup.from_config(cfg, gpus=1).loss == "chunked"
    explicit = load_config("configs/l2.yaml", ["parallel.sp=1", "memory.loss=liger"], device="cuda")
    assert (setup_dict(explicit, 1)["loss"], setup_dict(explicit, 1)["loss_config"]) == ("liger", "liger")


def test_oom_suggestion_asks_no_more_pinned_host_than_this_node_has(monkeypatch):
    """The OOM report's suggestion is for this node: an activation offload needing more pinned
    host memory than 80% of its RAM per GPU is not offered."""
    from megablu import plan
    from megablu.config.schema import ModelConfig
    from megablu.train import probe

    assert 0 < probe._host_gb_per_gpu() < 1e5  # Linux: this node's RAM, read
    m = ModelConfig(n_layers=36, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=151936)
    setup = {
        "model": m.model_dump(),
        "window": 1 << 20,
        "gpus": 2,
        "sp": 2,
        "recompute": "selective",
        "loss_chunk": 4096,
    }
    s = plan.Setup.from_json(setup)
    free = plan.suggest(s, 141.0)
    assert free.startswith("memory.offload_activations")  # the cheapest when the host is big enough
    need = plan.estimate(plan.apply_change(s, "offload_activations")).host_gb
    monkeypatch.setattr(probe, "_host_gb_per_gpu", lambda: need / 2)
    _, sug = probe._planner(setup, 141.0)
    assert sug and "offload_activations" not in sug and "recompute=full" in sug


@pytest.mark.e2e
def test_a_run_records_the_loss_auto_picked(tmp_path, stdlib_data, monkeypatch):
    """One CPU rank through the launcher where liger_kernel imports (a stand-in that fails if called):
    the run's auto picks chunked (a CPU run), trains, and probe.json records what ran, not the
    planner's GPU view (which would be liger here)."""
    from tests.train.test_resume import launch

    fake = tmp_path / "fake" / "liger_kernel" / "transformers"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "functional.py").write_text(
        "def liger_fused_linear_cross_entropy(*a, **k):\n    raise AssertionError('a CPU run called Liger')\n"
    )
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "fake"), os.environ.get("PYTHONPATH")]))
    )
    out = launch(
        1,
        [
            f"runs_dir={tmp_path}/runs",
            f"data.path={stdlib_data}",
            "parallel.sp=1",
            "train.micro_batch=1",
            "train.tokens_per_step=512",
            "train.max_steps=1",
            "train.probe_steps=1",
            "schedule.kind=cosine",
            "schedule.warmup_steps=0",
            "schedule.decay_start=null",
            "checkpoint.every_steps=0",
            "eval.final=false",
            "data.max_epochs=100",
        ],
    )
    setup = json.loads((Path(out["run_dir"]) / "probe.json").read_text())["setup"]
    assert (setup["loss"], setup["loss_config"]) == ("chunked", "auto")
    # memory.attention=auto on a CPU run: the first step ran sdpa, recorded beside the configured value
    assert (setup["attention"], setup["attention_config"]) == ("sdpa", "auto")
