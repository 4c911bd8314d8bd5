"""The memory planner: hand-checkable terms, the measured H200 rows, calibration, the table."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megablu import plan
from megablu.config import load_config
from megablu.config.schema import ModelConfig

BENCH = Path(__file__).resolve().parents[2] / "bench"
OFFLOAD_RESULTS = BENCH.parent / "experiments" / "zero_offload" / "results" / "2026-12-03"
sys.path.insert(0, str(BENCH))  # bench/offload_table.py and offload_bench.py (no GPU imports at top)

BLU05B = ModelConfig(n_layers=36, d_model=1024, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=100352)
TINY = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=1000)

# MEASURED on one H200 (experiments/speed/LOG.md, "Training step: BluModel vs HF transformers",
# 2026-12-02): blu-0.5b, bf16, batch 1, one fwd+bwd without optimizer, loss chunk 4096,
# pure-torch ops; peak = torch.cuda.max_memory_allocated in GB (1e9 B).
MEASURED = [
    ("none", 16384, 33.2),
    ("selective", 16384, 16.3),
    ("full", 16384, 8.4),
    ("none", 32768, 59.4),
    ("selective", 32768, 25.6),
    ("full", 32768, 9.8),
]


def bench_setup(recompute, T):
    return plan.Setup(BLU05B, T, recompute=recompute, loss_chunk=4096, ops="torch", optimizer=False, zero_stage=0)


@pytest.mark.parametrize("recompute,T,peak_gb", MEASURED)
def test_model_within_10pct_of_measured_h200_peaks(recompute, T, peak_gb):
    pred = plan.estimate(bench_setup(recompute, T)).allocated_gb
    assert abs(pred / peak_gb - 1) < 0.10, (recompute, T, pred, peak_gb)


def test_calibration_from_16k_probes_predicts_32k_within_10pct():
    probes = []
    for r, T, peak in MEASURED:
        if T == 16384:
            s = bench_setup(r, T)
            d = {k: getattr(s, k) for k in s.__dataclass_fields__}
            d["model"] = BLU05B.model_dump()
            # static = weights only (grads appear in backward); BENCHMARKS' static subtracts 2 x 2N
            probes.append({"setup": d, "peak_gb": peak, "static_gb": 2 * BLU05B.n_params() / 1e9})
    cal = plan.calibrate(probes)
    assert 0.9 < cal.act_scale < 1.1 and abs(cal.static_offset_gb) < 0.5
    for r, T, peak in MEASURED:
        if T == 32768:
            assert abs(plan.estimate(bench_setup(r, T), cal).allocated_gb / peak - 1) < 0.10


def test_calibration_scales_activations(tmp_path):
    s = plan.Setup(TINY, 1024, recompute="none", ops="cuda", optimizer=False, zero_stage=0)
    e = plan.estimate(s)
    d = {k: getattr(s, k) for k in s.__dataclass_fields__}
    d["model"] = TINY.model_dump()
    # a probe that measured twice the predicted dynamic memory and 1 GB more static
    probe = {
        "setup": d,
        "static_gb": e.static / 1e9 + 1.0,
        "peak_gb": (e.static + 2 * (e.allocated - e.static)) / 1e9 + 1.0,
    }
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    cal = plan.load_calibration(tmp_path / "probe.json")
    assert cal.act_scale == pytest.approx(2.0, rel=0.02)
    assert cal.static_offset_gb == pytest.approx(1.0, rel=1e-6)
    assert plan.estimate(s, cal).allocated_gb == pytest.approx(probe["peak_gb"], rel=0.02)
    cal.save(tmp_path / "cal.json")
    assert plan.load_calibration(tmp_path / "cal.json").act_scale == cal.act_scale


def test_calibrate_refuses_only_oom_probes():
    with pytest.raises(ValueError):
        plan.calibrate([{"oom": True, "peak_gb": None}])


def test_static_terms_by_zero_stage_and_offload():
    N = TINY.n_params()
    base = dict(model=TINY, window=64, gpus=4, sp=4, recompute="full", loss_chunk=16)

    def t(**kw):
        return plan.estimate(plan.Setup(**{**base, **kw})).terms

    z0, z1, z2 = t(zero_stage=0), t(zero_stage=1), t(zero_stage=2)
    assert z0["params (bf16)"] == 2 * N and z0["optimizer (fp32 master+Adam)"] == 12 * N
    assert z1["optimizer (fp32 master+Adam)"] == 12 * N / 4 and z1["grads (bf16)"] == 2 * N
    assert z2["grads (bf16)"] == 2 * (N / 4 + min(plan.ZERO_REDUCE_BUCKET, N))
    assert "optimizer (fp32 master+Adam)" not in t(zero_stage=1, offload_optimizer=True)
    z3 = t(zero_stage=3)
    z3p = t(zero_stage=3, offload_params=True)
    assert z3["params (bf16)"] - z3p["params (bf16)"] == 2 * N / 4


def test_activation_terms_hand_checked():
    # TINY: d=64, F=128, H=4, Hkv=2, D=16 -> q=64, kv=32 ; cuda ops
    lb = plan.layer_bytes_per_token(TINY, "cuda")
    assert lb["attn"] == (2 * 64 + 4) + 2 * 64 + 2 * (64 + 64) + 2 * 64 + 4 * 4
    assert lb["mlp"] == (2 * 64 + 4) + 2 * 64 + 2 * 128 * 3
    extra = 2 * 64 + 2 * 2 * 16 + 24  # final norm r, cos/sin, ids/labels/positions
    assert plan.saved_per_token(TINY, "full", "cuda") == 2 * 2 * 64 + extra
    assert plan.saved_per_token(TINY, "selective", "cuda") == 2 * (lb["attn"] + 2 * 64) + extra
    assert plan.saved_per_token(TINY, "none", "cuda") == 2 * (lb["attn"] + lb["mlp"]) + extra
    # torch norms keep r.float() and the normalised bf16: 4d + 2d more... per norm 6d+4 vs 2d+4
    lt = plan.layer_bytes_per_token(TINY, "torch")
    assert lt["attn"] - lb["attn"] == 4 * 64 and lt["mlp"] - lb["mlp"] == 4 * 64 + 2 * 128
    # sp=2: attention output saved twice; kv heads (2) already a multiple of 2
    assert plan.layer_bytes_per_token(TINY, "cuda", sp=2)["attn"] - lb["attn"] == 2 * 64


def test_loss_terms():
    V, d = TINY.vocab_size, TINY.d_model
    const, per = plan.loss_bytes(TINY, 4096, 256)
    assert const == max(10 * 256 * V, 6 * 256 * V + 6 * V * d) + 4 * V * d and per == 2 * d
    assert plan.loss_bytes(TINY, 4096, 0) == (0.0, 12.0 * V + 2 * d)
    # unchunked loss dominates a long window
    s = plan.Setup(TINY, 65536, recompute="full", loss_chunk=0)
    assert plan.estimate(s).limiting.startswith("loss (unchunked")


def test_sp_divides_tokens_and_full_recompute_is_cheapest():
    s1 = plan.Setup(BLU05B, 65536, gpus=1, sp=1, recompute="selective", loss_chunk=4096)
    s2 = plan.Setup(BLU05B, 65536, gpus=2, sp=2, recompute="selective", loss_chunk=4096)
    assert s2.tokens_per_rank == 32768
    assert plan.estimate(s2).allocated < plan.estimate(s1).allocated
    g = {
        r: plan.estimate(plan.Setup(BLU05B, 131072, recompute=r, loss_chunk=4096)).allocated
        for r in ("none", "selective", "full")
    }
    assert g["full"] < g["selective"] < g["none"]


def test_parse_tokens_and_verdicts():
    assert plan.parse_tokens("16k,32k,1M,2M,1000") == [16384, 32768, 1048576, 2097152, 1000]
    assert plan.verdict(0.5) == "comfortable" and plan.verdict(0.914) == "tight-probe-first"
    assert plan.verdict(1.75) == "impossible"


def test_fit_table_and_suggestion():
    cfg = load_config("configs/l2.yaml", [])
    rows = plan.fit_table(cfg, [1, 2], plan.parse_tokens("16k,64k,1M"), 141.0)
    by = {(r["gpus"], r["window"]): r for r in rows}
    assert by[(2, 65536)]["verdict"] == "comfortable" and by[(2, 65536)]["tokens_per_rank"] == 32768
    one_m = by[(1, 1048576)]
    assert one_m["verdict"] == "impossible" and one_m["suggestion"]
    # at 2 GPUs, 1M the cheapest switch is offloading the activations (measured ~2% slower),
    # and the suggestion says how much pinned host memory that takes ...
    assert by[(2, 1048576)]["suggestion"].startswith("memory.offload_activations [")
    assert "GB pinned host per GPU" in by[(2, 1048576)]["suggestion"]
    # ... which a host with less memory cannot give: then full recompute (selective keeps
    # attention's tensors)
    limited = plan.fit_table(cfg, [2], [1048576], 141.0, host_gb=100.0)
    assert "recompute=full" in limited[0]["suggestion"] and "offload_activations" not in limited[0]["suggestion"]
    text = plan.format_table(rows, 141.0)
    assert "| 2 | 2 | 64k | 32,768 |" in text and "Cheapest change to fit:" in text


def test_suggestion_prefers_loss_chunk_when_loss_limits():
    s = plan.Setup(BLU05B, 131072, gpus=1, sp=1, recompute="full", loss_chunk=0)
    assert plan.estimate(s).limiting.startswith("loss")
    assert plan.suggest(s, 141.0).startswith("memory.loss_chunk=4096")


def _cli(*args):
    # the subcommands as `megablu` will register them (cli._SUBCOMMAND_MODULES)
    return subprocess.run([sys.executable, "-c", REGISTER, *args], capture_output=True, text=True, timeout=120)


REGISTER = (
    "import sys, argparse\nimport megablu.plan.cli as pc, megablu.train.cli as tc\n"
    "p = argparse.ArgumentParser(); s = p.add_subparsers(dest='c', required=True)\n"
    "pc.register(s); tc.register(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


def test_plan_cli_table_on_stdout_and_exit_codes(tmp_path):
    r = _cli("plan", "--config", "configs/l2.yaml", "--gpus", "1,2", "--windows", "16k,32k,64k")
    assert r.returncode == 0, r.stderr
    assert "| GPUs | sp | target |" in r.stdout and "comfortable" in r.stdout
    r = _cli("plan", "--config", "configs/l2.yaml", "--windows", "32k", "--json")
    assert json.loads(r.stdout)[0]["window"] == 32768
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "inherit: "
        + str((__import__("pathlib").Path("configs/base.yaml")).resolve())
        + "\nmemory: {recompute: sometimes}\n"
    )
    r = _cli("plan", "--config", str(bad))
    assert r.returncode == 2 and r.stdout == "" and "recompute" in r.stderr


def test_probe_cli_dry_run_builds_the_entry_command():
    r = _cli("probe", "--config", "configs/l2.yaml", "--gpus", "1", "--dry-run", "--set", "parallel.sp=1")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip()
    # the launch `megablu train` makes: the entry module, from any directory
    assert "-m deepspeed.launcher.runner --num_gpus 1 " in cmd and "--module megablu.train.entry" in cmd
    for s in (
        "train.max_steps=3",
        "train.probe_steps=3",
        "schedule.kind=cosine",
        "checkpoint.save_final=false",
        "eval.final=false",
        "name=l2_probe",
    ):
        assert f"--set {s}" in cmd
    # the probe's overrides come after the user's so they win
    assert cmd.index("parallel.sp=1") < cmd.index("train.max_steps=3")


def test_fit_table_with_the_configs_sp_shards_zero_over_dp_times_sp():
    cfg = load_config("configs/l2.yaml", [])  # sp=2
    rows = plan.fit_table(cfg, [1, 2, 4], [32768], 141.0, sp=cfg.parallel.sp)
    assert [(r["gpus"], r["sp"], r["tokens_per_rank"]) for r in rows] == [(2, 2, 16384), (4, 2, 16384)]
    # same tokens per rank; 4 GPUs shard the optimizer over 4 ranks instead of 2
    assert rows[1]["gb_per_gpu"] < rows[0]["gb_per_gpu"]


FAKE_DEEPSPEED = r"""
# stands in for `python -m deepspeed.launcher.runner ... --module megablu.train.entry`: writes the
# probe.json the trainer would
import json, sys
from pathlib import Path
from megablu.config import load_config
from megablu.train.probe import setup_dict
a = sys.argv[1:]
cfg_path = a[a.index("--config") + 1]
sets = [a[i + 1] for i, x in enumerate(a) if x == "--set"]
cfg = load_config(cfg_path, sets)
run = Path(cfg.runs_dir) / (cfg.name + "-0001")
run.mkdir(parents=True)
oom = {oom}
print("[deepspeed] chatter on stdout")
res = {{"setup": setup_dict(cfg, int(a[a.index("--num_gpus") + 1])), "steps": cfg.train.probe_steps,
       "static_gb": 5.0, "peak_gb": None if oom else 20.0, "oom": oom}}
(run / ("probe.rank1.json" if oom else "probe.json")).write_text(json.dumps(res))
sys.exit(1 if oom else 0)
"""


@pytest.mark.parametrize("oom", [False, True])
def test_probe_cli_reads_the_runs_probe_json(tmp_path, oom):
    fake = tmp_path / "fake" / "deepspeed" / "launcher"  # a deepspeed package whose runner is the fake
    fake.mkdir(parents=True)
    for d in (fake, fake.parent):
        (d / "__init__.py").write_text("")
    (fake / "runner.py").write_text(FAKE_DEEPSPEED.format(oom=oom))
    os_ = __import__("os")
    env = {**os_.environ, "PYTHONPATH": os_.pathsep.join([str(tmp_path / "fake"), os_.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            REGISTER,
            "probe",
            "--config",
            "configs/l2.yaml",
            "--gpus",
            "1",
            "--set",
            "parallel.sp=1",
            "--set",
            f"runs_dir={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "chatter on stdout" in r.stderr  # the child's stdout is a log, not our result
    out = json.loads(r.stdout)
    assert out["setup"]["gpus"] == 1 and out["steps"] == 3
    if oom:
        assert r.returncode == 1 and out["oom"] is True and out["probe_json"].endswith("probe.rank1.json")
    else:
        assert r.returncode == 0
        assert out["plan_error"] == pytest.approx(out["planned_gb"] / 20.0 - 1)


def test_megablu_command_has_plan_and_probe():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megablu.cli",
            "plan",
            "--config",
            "configs/ext32k.yaml",
            "--gpus",
            "2",
            "--windows",
            "64k",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0, r.stderr
    assert "| 2 | 2 | 64k | 32,768 |" in r.stdout and "comfortable" in r.stdout
    h = subprocess.run([sys.executable, "-m", "megablu.cli", "probe", "--help"], capture_output=True, text=True)
    assert h.returncode == 0 and "--config" in h.stdout


def _measured_offload_overheads():
    """(setting row, measured added seconds) from the H200 offload rows: each row against the
    ZeRO-1 step of the same call at the same window (another call's when that call ran none)."""
    from offload_table import merge_file

    calls = [list(merge_file(str(f)).values()) for f in sorted(OFFLOAD_RESULTS.glob("offload_*.jsonl"))]
    z1 = [
        {
            (r["shape"], r["fit_T"]): r["fit_T"] / r["tok_s_at_fit"]
            for r in rows
            if r["setting"] == "z1" and "tok_s_at_fit" in r
        }
        for rows in calls
    ]
    any_call = {k: v for base in z1 for k, v in base.items()}
    out = []
    for rows, base in zip(calls, z1):
        for r in rows:
            key = (r["shape"], r.get("fit_T"))
            z1_s = base.get(key) or any_call.get(key)  # the same call's ZeRO-1 step first
            if r["setting"] != "z1" and "tok_s_at_fit" in r and z1_s:
                out.append((r, r["fit_T"] / r["tok_s_at_fit"] - z1_s))
    return out


def test_offload_step_cost_matches_the_h200_rows():
    """The fit table's cost of ZeRO-Offload is a fixed time per step (plan.change_cost); against the
    twelve H200 rows (ten settings, two of them re-run in a later call) its added seconds stay
    within the single steps' spread, and in sum within 15%."""
    from offload_bench import SETTINGS, SHAPES

    rows = _measured_offload_overheads()
    assert len(rows) == 12
    model_sum = meas_sum = 0.0
    for r, measured in rows:
        cfg = load_config(
            Path("configs") / SETTINGS["z1"][0], SETTINGS["z1"][1] + SHAPES[r["shape"]], world_size=1, device="cuda"
        )
        s, cost = replace(plan.Setup.from_config(cfg, gpus=1, window=r["fit_T"]), zero_stage=r["zero_stage"]), 1.0
        for change in [c for c in ("offload_optimizer", "offload_params") if r[c]]:
            s = plan.apply_change(s, change)
            cost *= plan.change_cost(change, s)
        added = plan.step_seconds(s) * (cost - 1)
        assert 0.6 < added / measured < 1.7, (r["shape"], r["setting"], r["fit_T"], added, measured)
        model_sum, meas_sum = model_sum + added, meas_sum + measured
    assert abs(model_sum / meas_sum - 1) < 0.15


def test_offload_cost_falls_with_the_window():
    s16, s256 = (
        plan.apply_change(
            plan.Setup(BLU05B, t, gpus=1, sp=1, recompute="selective", loss_chunk=4096), "offload_optimizer"
        )
        for t in (16384, 262144)
    )
    assert plan.change_cost("offload_optimizer", s16) > 1.5  # a 0.4 s CPU step against a ~0.3 s step
    assert plan.change_cost("offload_optimizer", s256) < 1.02  # hidden behind a ~40 s step
