"""experiments/smol32k/run.sh rehearsed on CPU (REHEARSE_CPU=1): a `timeout` on PATH logs every guarded
command instead of running it, so the phases' flow is checked before device time is spent on it.
Phase c of a new arm (far): with the run stopped mid-way, the mid-run checkpoint is hard-linked and
evaluated beside the resumed training and the arm's own cells wait; with the run finished, the
arm's cells, the temperature probe and the compare run. Phase a: reuse check, synth options,
the Liger check. A tiny real run stands in for the arm's (its name is all the script looks at)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_rehearse import assert_configs_load

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "smol32k" / "run.sh"
FAKE_TIMEOUT = """#!/bin/bash
shift 2   # --kill-after=10 SECONDS
echo "$*" >> "$REHEARSE_LOG"
[ -n "${REHEARSE_FAIL:-}" ] && [[ "$*" == *"$REHEARSE_FAIL"* ]] && exit 1
case "$*" in   # what runs side by side: the reuse check outlasts the synthetic set
  *" data synth "*) sleep "${REHEARSE_SLOW_S:-0}" ;;
  *prompts-match*) sleep "$(( ${REHEARSE_SLOW_S:-0} * 3 / 2 ))" ;;
esac
exit 0
"""


def _train(dev: Path, stdlib_data, *extra, arm: str = "far"):
    tiny = ROOT / "tests" / "configs" / "tiny_cpu.yaml"
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "ext32k.py"),
        "--config",
        str(tiny),
        "--set",
        f"name=smol32k_{arm}",
        "--set",
        f"runs_dir={dev / 'runs'}",
        "--set",
        f"data.path={stdlib_data}",
        "--set",
        "train.max_steps=6",
        "--set",
        "checkpoint.every_steps=3",
        "--set",
        "train.probe_steps=0",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "DS_ACCELERATOR": "cpu"}, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _phase(tmp_path: Path, dev: Path, phase: str, rc: int = 0, **extra_env) -> list[str]:
    """The commands one phase ran (its stderr's lines when rc, the expected exit status, is not 0)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "timeout").write_text(FAKE_TIMEOUT)
    (fake / "timeout").chmod(0o755)
    log = tmp_path / f"cmds_{phase}.log"
    reuse = tmp_path / "dense_results.tar.gz"  # the earlier arm's evals a new arm reuses (a stand-in)
    if not reuse.exists():
        (tmp_path / "reuse" / "eval" / "native_1k").mkdir(parents=True)
        subprocess.run(["tar", "czf", str(reuse), "-C", str(tmp_path / "reuse"), "./eval"], check=True)
    log.unlink(missing_ok=True)  # one invocation's commands
    env = {
        **os.environ,
        "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "REHEARSE_CPU": "1",
        "REHEARSE_LOG": str(log),
        "I14_DEV": str(dev),
        "OUT": str(tmp_path / "out"),
        "ARM": "far",
        "PHASE": phase,
        "BUDGET_S": "555",
        "DS_ACCELERATOR": "cpu",
        "I14_REUSE": str(reuse),
        **extra_env,
    }
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if rc:
        assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-2000:]
        return r.stderr.splitlines()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"phase {phase} done" in r.stdout
    cmds = log.read_text().splitlines() if log.exists() else []
    assert_configs_load(cmds)
    return cmds


def test_phase_c_mid_run_then_finished(tmp_path, stdlib_data):
    dev = tmp_path / "dev"
    (dev / "eval").mkdir(parents=True)
    (dev / "eval" / ".reused").touch()
    _train(dev, stdlib_data, "--set", "train.stop_after=3")  # call B stopped here
    cmds = _phase(tmp_path, dev, "c")
    mid = [c for c in cmds if "far_midrun" in c]
    assert len(mid) == 1 and f"--ckpt {dev}/midrun/checkpoints/step_0000003" in mid[0] and "--n 200" in mid[0]
    assert (dev / "midrun" / "checkpoints" / "step_0000003" / "model.safetensors").stat().st_nlink >= 2  # hard link
    train = [c for c in cmds if c.startswith("deepspeed ")]
    assert len(train) == 1 and f"--resume {dev}/runs/smol32k_far-0001" in train[0] and "smol32k_far.yaml" in train[0]
    assert not any("--arm far " in c and "far_midrun" not in c for c in cmds)  # the arm's cells wait for the end

    run = dev / "runs" / "smol32k_far-0001"
    _train(dev, stdlib_data, "--resume", str(run))  # the run reaches max_steps
    cmds = _phase(tmp_path, dev, "c")
    outs = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--out " in c}
    assert {
        "far_1k",
        "far_mid",
        "far_pk32k",
        "far_pk16k",
        "far_needle",
        "far_ruler",
        "far_temp8",
        "far_temp8_16k",
        "yarn4_temp8",
        "far_temp13",
    } <= outs, outs
    probe = next(c for c in cmds if "/far_temp13 " in c)
    assert "--rope-override" in probe and "rope.yarn.attention_factor=1.3" in probe
    # without CONFIRM (arm_cells): what decides the target first (the gate's 1024, STRING on fresh prompts, the
    # paired seed-0 pair), the suite after every passkey and needle cell, the probes last
    order = [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--out " in c]
    arm = [o for o in order if o.startswith("far_") and o != "far_midrun"]  # midrun: beside, until done
    assert arm[:14] == [
        "far_1k",
        "far_string_s1",
        "far_pk32k",
        "far_string",
        "far_mid",
        "far_plain_s1",
        "far_string_needle",
        "far_needle",
        "far_pk16k",
        "far_string_pk16k",
        "far_ruler",
        "far_string_1k",
        "far_string_mid",
        "far_string_ruler",
    ], order
    assert len(arm) == len(set(arm)), order  # no cell twice
    for c in cmds:  # STRING's cells: one arm (its slope and gate in compare), the shift on each; no other cell has it
        if " eval " in c and "--out " in c and "/far_" in c:
            string = c.split("--out ")[1].split()[0].rsplit("/", 1)[1].startswith("far_string")
            assert ("eval.string.shift=10922" in c) == string, c
            assert not string or "--arm far_string " in c or "--arm far_string_s1 " in c, c
    plain_s1 = next(c for c in cmds if "/far_plain_s1 " in c)
    assert "--arm far_s1 " in plain_s1 and "eval.seed=1" in plain_s1 and "eval.string" not in plain_s1
    assert "--ckpt " + str(run / "checkpoints" / "step_0000006") in next(c for c in cmds if "/far_pk32k " in c)
    assert not any(c.startswith("deepspeed ") for c in cmds)  # finished: no training
    # no native results here (the logged evals wrote nothing): no gate parent, so no compare
    assert not (dev / "native.json").exists() and not any(" compare " in c for c in cmds)


def test_phase_a_builds_the_far_set_and_checks_liger(tmp_path):
    dev = tmp_path / "dev"
    (dev / "corpus").mkdir(parents=True)
    (dev / "corpus" / "manifest.json").write_text("{}")  # carried corpus already unpacked
    cmds = _phase(tmp_path, dev, "a", REHEARSE_SLOW_S="2")
    synth = next(c for c in cmds if " data synth " in c)
    for opt in ("--distances 10k-20k", "--distance-share 0.5", "--filler kv,text,repeat", f"--out {dev}/synth_far"):
        assert opt in synth, synth
    assert any("tests/model/test_kernel_choices.py" in c and "--junitxml" in c for c in cmds)
    assert any("profile_step.py" in c and "selective+offload+liger" in c for c in cmds)
    assert any("prompts-match" in c and "--prune" in c for c in cmds)  # the reused evals are checked first
    assert any(" data mix " in c and "smol32k_far.yaml" in c for c in cmds)
    # the reuse check (3 s here) beside the synthetic set (2 s), both done before the mixture
    steps = {
        ln.split("\t")[0]: [int(x) for x in ln.split("\t")[1:3]]
        for ln in (dev / "work_a" / "timeline.tsv").read_text().splitlines()
    }
    assert abs(steps["reuse_check"][0] - steps["synth"][0]) <= 1, steps
    assert steps["mixture"][0] >= max(steps["reuse_check"][1], steps["synth"][1]), steps


def test_phase_a_edge_builds_far_s_set_and_the_edge_set_side_by_side(tmp_path):
    """ARM=edge (far with half its synthetic share on keys 24-32k back): far's set and the edge set are
    built at once, beside the reuse check, and both before the mixture that reads them."""
    dev = tmp_path / "dev"
    (dev / "corpus").mkdir(parents=True)
    (dev / "corpus" / "manifest.json").write_text("{}")
    cmds = _phase(tmp_path, dev, "a", ARM="edge", LIGER="0", REHEARSE_SLOW_S="2")
    synth = [c for c in cmds if " data synth " in c]
    assert len(synth) == 2, synth
    far = next(c for c in synth if f"--out {dev}/synth_far " in c)
    edge = next(c for c in synth if f"--out {dev}/synth_edge " in c)
    for opt in ("--distances 10k-20k", "--distance-share 0.5", "--filler kv,text,repeat"):
        assert opt in far, far
    for opt in ("--distances 24k-32k", "--lengths 30k-32700", "--filler kv,text,repeat", "--seed 1"):
        assert opt in edge, edge
    assert any(" data mix " in c and "smol32k_edge.yaml" in c for c in cmds)
    steps = {
        ln.split("\t")[0]: [int(x) for x in ln.split("\t")[1:3]]
        for ln in (dev / "work_a" / "timeline.tsv").read_text().splitlines()
    }
    assert abs(steps["synth2"][0] - steps["synth"][0]) <= 1, steps
    assert steps["mixture"][0] >= max(steps["synth"][1], steps["synth2"][1], steps["reuse_check"][1]), steps


def test_phase_a_liger_0_builds_the_data_and_leaves_the_gpu_alone(tmp_path):
    # LIGER=0: the GPU quick start shares the call (or no liger wheel travels): no Liger tests or profile
    dev = tmp_path / "dev"
    (dev / "corpus").mkdir(parents=True)
    (dev / "corpus" / "manifest.json").write_text("{}")
    cmds = _phase(tmp_path, dev, "a", LIGER="0")
    assert any(" data synth " in c for c in cmds) and any(" data mix " in c for c in cmds)
    assert not any("--junitxml" in c or "profile_step.py" in c for c in cmds), cmds


def test_phase_a_ops17_a_runs_the_gpu_ops_tests_and_the_rmsnorm_variants_beside_the_data(tmp_path):
    # OPS17=a: issue 17's GPU tests and the add+RMSNorm backward's two paths, before the mixture is resolved
    dev = tmp_path / "dev"
    (dev / "corpus").mkdir(parents=True)
    (dev / "corpus" / "manifest.json").write_text("{}")
    cmds = _phase(tmp_path, dev, "a", LIGER="0", OPS17="a")
    ops = [i for i, c in enumerate(cmds) if "pytest" in c and c.rstrip().endswith("tests/ops")]
    rms = [i for i, c in enumerate(cmds) if "rmsnorm_bwd_variants.py" in c]
    mix = [i for i, c in enumerate(cmds) if " data mix " in c]
    assert len(ops) == 1 and len(rms) == 1 and len(mix) == 1, cmds
    assert ops[0] < rms[0] < mix[0], cmds
    assert any(" data synth " in c for c in cmds)
    assert not any(
        ("pytest" in c and "tests/ops" in c) or "rmsnorm_bwd" in c for c in _phase(tmp_path, dev, "a", LIGER="0")
    ), "OPS17 unset must leave the GPU alone"


def test_phase_c_confirm_scores_every_kept_checkpoint_on_fresh_prompts(tmp_path, stdlib_data):
    """CONFIRM=1 (far trained again, every KEEP_EVERY-th checkpoint kept): beside the resumed training the
    kept checkpoints are scored on fresh prompts (eval.seed=1) and CONFIRM_S0 also on the old ones; once
    the run is finished the temperature probe comes first, then the final checkpoint, then the arm's cells.
    CONFIRM_STOP (the short form) on the mid-run state: the probe only once the run stopped where asked."""
    dev = tmp_path / "dev"
    (dev / "eval").mkdir(parents=True)
    (dev / "eval" / ".reused").touch()
    env = {"CONFIRM": "1", "KEEP_EVERY": "2", "CONFIRM_FROM": "2", "CONFIRM_S0": "4"}
    keep = (
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "checkpoint.keep_every=2",
        "--set",
        "checkpoint.keep=1",
        "--set",
        "train.max_steps=7",
    )
    _train(dev, stdlib_data, "--set", "train.stop_after=5", *keep)  # call B stopped at step 5
    run = dev / "runs" / "smol32k_far-0001"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_0000002",
        "step_0000004",
        "step_0000005",
    ]
    cmds = _phase(tmp_path, dev, "c", **env)
    train = [c for c in cmds if c.startswith("deepspeed ")]
    assert len(train) == 1 and "checkpoint.keep_every=2" in train[0] and f"--resume {run}" in train[0]
    assert not (dev / "midrun").exists()  # no hard-linked mid-run copy
    scored = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in cmds if " eval " in c and "--arm far" in c}
    assert set(scored) == {"far_s1_2", "far_s1_4", "far_s0_4"}, set(scored)  # not step 5: no multiple, not final
    assert "eval.seed=1" in scored["far_s1_4"] and "eval.seed" not in scored["far_s0_4"]
    assert f"--ckpt {run}/checkpoints/step_0000004 " in scored["far_s0_4"] and "--n 200" in scored["far_s1_2"]
    assert all("memory.ops=auto" in c for c in scored.values())  # the CUDA ops, as every stored result

    # CONFIRM_STOP=N, the short form: the training asked to stop at N; stopped short of it (here 6), no probe
    # yet; stopped at it (5), the kept checkpoints' cells and the temperature probe on N, no arm cells
    cmds = _phase(tmp_path, dev, "c", **env, CONFIRM_STOP="6")
    assert "train.stop_after=6" in next(c for c in cmds if c.startswith("deepspeed "))
    assert not any("_temp" in c for c in cmds)
    cmds = _phase(tmp_path, dev, "c", **env, CONFIRM_STOP="5")
    outs = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--out " in c}
    assert {"far_s1_2", "far_s1_4", "far_s0_4", "far_temp8", "far_temp13"} <= outs, outs
    assert f"--ckpt {run}/checkpoints/step_0000005 " in next(c for c in cmds if "/far_temp8 " in c)
    assert not {"far_1k", "far_pk32k"} & outs, outs

    _train(dev, stdlib_data, "--resume", str(run), *keep)  # finished at step 7
    cmds = _phase(tmp_path, dev, "c", **env)
    outs = [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--out " in c]
    assert not any(c.startswith("deepspeed ") for c in cmds)
    assert {"far_s1_6", "far_s1_7", "far_temp8", "far_1k", "far_pk32k"} <= set(outs), outs
    first_kept = min(i for i, o in enumerate(outs) if o.startswith("far_s1_"))
    assert outs.index("far_temp13") < first_kept < outs.index("far_s1_7") < outs.index("far_1k"), outs  # probe first
    refused = _phase(tmp_path, dev, "d", rc=2, CONFIRM="0")  # the run is CONFIRM=1's
    assert any("started with CONFIRM=1" in ln for ln in refused), refused


def test_confirm_on_another_arm_scores_its_kept_checkpoints_without_far_s_probe(tmp_path, stdlib_data):
    """CONFIRM=1 with ARM=long_only: the kept checkpoints on fresh prompts and the arm's cells, as for far, but
    no temperature probe (far's question): once stopped where asked, and once finished."""
    dev = tmp_path / "dev"
    (dev / "eval").mkdir(parents=True)
    (dev / "eval" / ".reused").touch()
    env = {"ARM": "long_only", "CONFIRM": "1", "KEEP_EVERY": "2", "CONFIRM_FROM": "2", "CONFIRM_S0": "4"}
    keep = (
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "checkpoint.keep_every=2",
        "--set",
        "checkpoint.keep=1",
        "--set",
        "train.max_steps=5",
    )
    _train(dev, stdlib_data, "--set", "train.stop_after=4", *keep, arm="long_only")
    run = dev / "runs" / "smol32k_long_only-0001"
    cmds = _phase(tmp_path, dev, "c", **env, CONFIRM_STOP="4")
    outs = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--out " in c}
    assert {"long_only_s1_2", "long_only_s1_4", "long_only_s0_4"} <= outs, outs
    assert not any("_temp" in c for c in cmds), [c for c in cmds if "_temp" in c]

    _train(dev, stdlib_data, "--resume", str(run), *keep, arm="long_only")  # finished at step 5
    cmds = _phase(tmp_path, dev, "c", **env)
    outs = [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--out " in c]
    assert {"long_only_s1_5", "long_only_1k", "long_only_pk32k"} <= set(outs), outs
    assert outs.index("long_only_s1_5") < outs.index("long_only_1k"), outs
    assert f"--ckpt {run}/checkpoints/step_0000005 " in next(c for c in cmds if "/long_only_s1_5 " in c)
    # the position probe last, the arm's and untrained YaRN's, on the passkey cell's prompts (no eval.seed)
    # the arm's cells without the suite, STRING at eval on the arm (paired, fresh prompts, needle; under CONFIRM
    # the plain fresh cell is confirm_set's), the suite, then untrained YaRN with STRING, factor 5's and factor
    # 8's positions the same way, then attention factor 1.0
    assert outs[-11:] == [
        "long_only_needle",
        "long_only_string",
        "long_only_string_s1",
        "long_only_string_needle",
        "long_only_ruler",
        "yarn4_string",
        "long_only_pos5",
        "yarn4_pos5",
        "long_only_pos8",
        "yarn4_pos8",
        "long_only_temp10",
    ], outs
    for c in (c for c in cmds if "_string" in c and " eval " in c):
        assert "eval.string.shift=10922" in c and "eval.string.local=128" in c and "--lengths 32744" in c, c
        assert "rope.yarn.factor" not in c and ("eval.seed=1" in c) == ("_string_s1 " in c), c
    assert "--tasks needle " in next(c for c in cmds if "/long_only_string_needle " in c)
    assert "--arm long_only_string " in next(c for c in cmds if "/long_only_string_needle " in c)  # one arm, merged
    assert "--rope-override" in next(c for c in cmds if "/yarn4_string " in c)
    assert "smol32k_long_only.yaml" in next(c for c in cmds if "/yarn4_string " in c)
    for pos, window in (("8", 65536), ("5", 40960)):
        for c in (c for c in cmds if f"_pos{pos} " in c):
            assert "--rope-override" in c and f"rope.yarn.factor={pos}.0" in c and f"data.window={window}" in c, c
            assert "rope.yarn.attention_factor=1.1386" in c and "--lengths 32744" in c and "eval.seed" not in c, c
        assert "smol32k_long_only.yaml" in next(c for c in cmds if f"/yarn4_pos{pos} " in c)  # the baselines' config
    soft = next(c for c in cmds if "/long_only_temp10 " in c)
    assert "rope.yarn.attention_factor=1.0 " in soft and "rope.yarn.factor" not in soft and "--lengths 32744" in soft
    assert not any("_temp8" in c or "_temp13" in c for c in cmds), [c for c in cmds if "_temp" in c]  # far's probe


def test_phase_b_confirm_stop_scores_while_training_then_the_stop(tmp_path, stdlib_data):
    """CONFIRM_STOP in phase b (the two-call form): the kept checkpoints before the stop are scored on fresh
    prompts beside the training, then the stop's checkpoint on fresh and old prompts, each cell once."""
    dev = tmp_path / "dev"
    for d in ("eval", "smollm2", "corpus", "synth_far"):
        (dev / d).mkdir(parents=True)
    (dev / "eval" / ".reused").touch()
    (dev / "smollm2" / "model.safetensors").touch()  # joined + converted by an earlier call
    (dev / "corpus" / "manifest.json").write_text("{}")
    (dev / "synth_far" / "manifest.json").write_text("{}")
    _train(
        dev,
        stdlib_data,
        "--set",
        "train.stop_after=5",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "checkpoint.keep_every=2",
        "--set",
        "checkpoint.keep=1",
        "--set",
        "train.max_steps=7",
    )
    run = dev / "runs" / "smol32k_far-0001"
    cmds = _phase(tmp_path, dev, "b", CONFIRM="1", KEEP_EVERY="2", CONFIRM_FROM="2", CONFIRM_STOP="5")
    train = next(c for c in cmds if c.startswith("deepspeed "))
    assert "train.stop_after=5" in train and "checkpoint.keep_every=2" in train
    outs = [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in cmds if " eval " in c and "--arm far" in c]
    assert sorted(outs) == ["far_s0_5", "far_s1_2", "far_s1_4", "far_s1_5"], outs
    by = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in cmds if " eval " in c and "--arm far" in c}
    assert "eval.seed=1" in by["far_s1_5"] and "eval.seed" not in by["far_s0_5"]
    assert f"--ckpt {run}/checkpoints/step_0000005 " in by["far_s0_5"]
    assert f"--ckpt {run}/checkpoints/step_0000002 " in by["far_s1_2"]
    assert not any("_temp" in c for c in cmds)


def test_phase_b_ops17_b_runs_the_gpu_ops_tests_beside_the_training_and_no_timing(tmp_path):
    # OPS17=b: the tests start with the phase (beside join/convert and the training), the variants bench does not
    # run (the GPU is shared there); without OPS17 phase b runs no ops tests
    dev = tmp_path / "dev"
    for d in ("eval", "smollm2", "corpus", "synth_far"):
        (dev / d).mkdir(parents=True)
    (dev / "eval" / ".reused").touch()
    (dev / "smollm2" / "model.safetensors").touch()
    (dev / "corpus" / "manifest.json").write_text("{}")
    (dev / "synth_far" / "manifest.json").write_text("{}")
    cmds = _phase(tmp_path, dev, "b", OPS17="b")
    ops = [i for i, c in enumerate(cmds) if "pytest" in c and c.rstrip().endswith("tests/ops")]
    train = [i for i, c in enumerate(cmds) if c.startswith("deepspeed ")]
    assert len(ops) == 1 and len(train) == 1 and ops[0] < train[0], cmds
    assert not any("rmsnorm_bwd_variants" in c for c in cmds), cmds
    assert not any("tests/ops" in c for c in _phase(tmp_path, dev, "b")), "OPS17 unset: no ops tests"


def test_phase_a_checks_string_s_flex_kernel_and_a_failure_moves_later_phases_to_sdpa(tmp_path, stdlib_data):
    dev = tmp_path / "dev"
    (dev / "corpus").mkdir(parents=True)
    (dev / "corpus" / "manifest.json").write_text("{}")
    cmds = _phase(tmp_path, dev, "a", LIGER="0")
    idx = {
        name: [i for i, c in enumerate(cmds) if key in c]
        for name, key in (
            ("tests", "tests/model/test_string.py -k cuda"),
            ("bench", "bench/string_bench.py"),
            ("mix", " data mix "),
        )
    }
    assert all(len(v) == 1 for v in idx.values()), cmds
    assert idx["tests"][0] < idx["bench"][0] < idx["mix"][0]
    assert not (dev / ".string_impl").exists()  # both passed: the default (flex) stays
    assert not any("string_bench" in c for c in _phase(tmp_path, dev, "a", LIGER="0", STRING_CHECK="0"))

    _phase(tmp_path, dev, "a", LIGER="0", REHEARSE_FAIL="bench/string_bench.py")
    assert (dev / ".string_impl").read_text().strip() == "sdpa"
    (dev / "eval").mkdir(exist_ok=True)
    (dev / "eval" / ".reused").touch()
    _train(dev, stdlib_data)  # finished: phase d runs the arm's cells
    evals = [c for c in _phase(tmp_path, dev, "d") if " eval " in c]
    string_cells = [c for c in evals if "eval.string.shift" in c]
    assert string_cells and all("eval.string.kernel=sdpa" in c for c in string_cells), string_cells
    assert len(string_cells) < len(evals)  # the plain cells stay plain: no eval.string at all
    assert not any("eval.string" in c for c in evals if c not in string_cells)
