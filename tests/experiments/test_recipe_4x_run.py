"""experiments/recipe_4x/run.sh rehearsed on CPU (REHEARSE_CPU=1): the calls of one session in order on one
"warm machine" (a tmp dir). A `timeout` on PATH logs each guarded command instead of running it, except the
join, which runs (a GGUF stand-in cut into three pieces as the real one is); the conversion leaves a model
file, an eval a result file, and the training a checkpoint at REHEARSE_STEP (keep 1) with its metrics, as the
real ones would. Every logged megablu command must parse with megablu's own parser and load its config; the
launch's arguments go through the training entry's own parser; every eval must pass its setup checks."""

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.bench_rehearse import assert_configs_load, eval_problems_of, evals_by_out as _evals, parse_command

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "recipe_4x" / "run.sh"
FAKE_TIMEOUT = r"""#!/bin/bash
shift 2   # --kill-after=10 SECONDS
line=$(printf '%q ' "$@"); echo "$line" >> "$REHEARSE_LOG"
case "$*" in
  *"smollm2_pieces.py join "*) exec "$@" ;;   # it must find every piece the manifest names
  *"smollm2_pieces.py convert "*|*"megablu.cli eval "*)   # what they leave: the model dir, a cell's result
    to=; while [ $# -gt 0 ]; do case "$1" in --to|--out) to=$2 ;; esac; shift; done
    mkdir -p "$to"
    case "$to" in */eval/*) echo '{}' > "$to/step_0.json" ;; *) touch "$to/model.safetensors" ;; esac ;;
  "deepspeed "*)   # a session that stopped with a checkpoint at REHEARSE_STEP (checkpoint.keep 1)
    runs=; name=
    while [ $# -gt 0 ]; do case "$1" in runs_dir=*) runs=${1#runs_dir=} ;; name=*) name=${1#name=} ;; esac; shift; done
    run=$runs/$name-0001; rm -rf "$run/checkpoints"; ck=$run/checkpoints/$(printf 'step_%07d' "$REHEARSE_STEP")
    mkdir -p "$ck/ds"; touch "$ck/model.safetensors" "$ck/ds/mp_rank_00_model_states.pt"
    echo '{}' > "$ck/manifest.json"
    echo "step,loss" > "$run/metrics.csv"; echo '{}' > "$run/mixture.json" ;;
esac
exit 0
"""
SUITE = [1024, 4096, 8192, 16384, 32768]
PK = {1024: 1024, 4096: 4072, 8192: 8168, 16384: 16360, 32768: 32744}
# the plan's priority order (README "Session budget and order", item 3)
TRAINED_ORDER = [
    "suite_32768",
    "passkey_32744",
    "suite_1024",
    "suite_4096",
    "passkey_1024",
    "passkey_4072",
    "suite_8192",
    "suite_16384",
    "needle_32744",
    "needle_1024",
    "needle_4072",
    "needle_8168",
    "needle_16360",
    "passkey_8168",
    "passkey_16360",
]


@pytest.fixture
def pieces(tmp_path):
    """A 2.5 MiB stand-in for the GGUF, cut by the real split into three pieces (smol_0, smol_1, smol_2)."""
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(5 << 19))
    prefix = tmp_path / "pieces" / "smol"
    r = subprocess.run(
        [sys.executable, "dev/smollm2_pieces.py", "split", str(src), "--out", str(prefix), "--piece-mib", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["smol_0", "smol_1", "smol_2"]
    return prefix, hashlib.sha256(src.read_bytes()).hexdigest()


def _run(tmp_path: Path, prefix: Path, call: str, **knobs: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "timeout").write_text(FAKE_TIMEOUT)
    (fake / "timeout").chmod(0o755)
    log = tmp_path / f"cmds_{call}.log"
    log.unlink(missing_ok=True)
    knob_names = ("STEP", "ARM", "K", "LENGTHS", "N", "DEADLINE_S", "TRAIN_MARGIN_S", "SNAP_S")
    keep = {k: v for k, v in os.environ.items() if k not in knob_names}
    env = {
        **keep,
        "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "REHEARSE_CPU": "1",
        "REHEARSE_LOG": str(log),
        "R4X_DEV": str(tmp_path / "dev"),
        "R4X_CARRY": str(tmp_path / "carry_r4x"),
        "R4X_PIECES": str(prefix),
        "OUT": str(tmp_path / f"out_{call}"),
        "DS_ACCELERATOR": "cpu",
        **knobs,
    }
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _parse_train(argv: list[str]) -> argparse.Namespace:
    """The launch's arguments through megablu's own training parser (megablu/train/entry.py main, stopped right
    after it parsed them): a flag it does not know fails here, not on the device."""
    from megablu.train import entry

    class Parsed(Exception):
        pass

    orig = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        raise Parsed(orig(self, args, namespace))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", grab)
        try:
            entry.main(argv)
        except Parsed as e:
            return e.args[0]
        except SystemExit:
            raise AssertionError(f"the training entry refuses: {shlex.join(argv)}") from None
    raise AssertionError("entry.main returned before parsing its arguments")


def _call(tmp_path: Path, prefix: Path, call: str, rc: int = 0, **knobs: str) -> list[list[str]]:
    """One device call: the commands it ran, each as its argv, each checked against its program's parser."""
    r = _run(tmp_path, prefix, call, **knobs)
    assert r.returncode == rc, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / f"out_{call}"
    back = list(out.iterdir())
    assert len(back) <= 8 and all(p.is_file() for p in back), back
    log = tmp_path / f"cmds_{call}.log"
    cmds = [shlex.split(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    assert_configs_load(cmds)
    for c in cmds:
        parse_command(c)
        if c[:1] == ["deepspeed"]:
            assert c[1:4] == ["--num_gpus", "1", "launch/ext32k.py"], c  # the README's launch form
            _parse_train(c[4:])
    return cmds


def _trains(cmds) -> list[argparse.Namespace]:
    return [_parse_train(c[4:]) for c in cmds if c[:1] == ["deepspeed"]]


def _tar_names(path: Path) -> list[str]:
    with tarfile.open(path) as t:
        return t.getnames()


def test_one_training_prep_parent_train_resume_eval_on_one_warm_machine(tmp_path, pieces):
    from megablu.config import load_config

    prefix, sha = pieces
    dev = tmp_path / "dev"
    arm = dict(ARM="recipe", K="1")

    # A: carries smol_0 only: the data and the arm's synthetic set (seed K); the parent waits for its pieces
    away = tmp_path / "away"
    away.mkdir()
    for p in ("smol_1", "smol_2"):
        shutil.move(prefix.parent / p, away / p)
    cmds = _call(tmp_path, prefix, "a", STEP="prep parent", **arm)
    assert cmds[0][1:3] == ["dev/carry_data.py", "unpack"] and cmds[0][-2:] == ["--to", str(dev)]
    assert cmds[1][:2] == ["tar", "xJf"] and cmds[2][1:5] == ["-m", "megablu.cli", "data", "verify"]
    (synth,) = [parse_command(c)[1] for c in cmds if c[3:5] == ["data", "synth"]]
    assert synth.profile == "disjoint" and synth.seed == 1 and synth.out == f"{dev}/synth_disjoint"
    assert synth.filler_exclude.endswith("essays.txt.gz") and (ROOT / synth.filler_exclude).is_file()
    (mix,) = [c for c in cmds if c[3:5] == ["data", "mix"]]
    assert mix[-1] == "experiments/recipe_4x/recipe.yaml"
    assert not any("smollm2_pieces.py" in " ".join(c) for c in cmds)  # two pieces are still to come
    report = (tmp_path / "out_a" / "report_recipe_s1.md").read_text()
    assert "waiting for" in report and "smol_1/piece_1.bin" in report and "smol_2/piece_2.bin" in report
    # the same call again on the warm machine: everything is there, nothing runs twice
    cmds = _call(tmp_path, prefix, "a2", STEP="prep", **arm)
    assert not any(c[3:5] in (["data", "synth"], ["data", "verify"]) or "unpack" in c for c in cmds), cmds

    # B: the other pieces: joined bit-exact, converted; the training from scratch, stopping before the deadline
    for p in ("smol_1", "smol_2"):
        shutil.move(away / p, prefix.parent / p)
    cmds = _call(tmp_path, prefix, "b", STEP="parent train", DEADLINE_S="400", REHEARSE_STEP="40", **arm)
    assert [c[1:3] for c in cmds[:2]] == [["dev/smollm2_pieces.py", "join"], ["dev/smollm2_pieces.py", "convert"]]
    assert hashlib.sha256((dev / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()).hexdigest() == sha
    (train,) = _trains(cmds)
    cfg = load_config(ROOT / train.config, train.set)
    assert train.config == "experiments/recipe_4x/recipe.yaml" and train.resume is None
    assert (cfg.name, cfg.data.seed, cfg.train.seed, cfg.runs_dir) == ("r4x_recipe_s1", 1, 1235, f"{dev}/runs")
    assert 60 <= cfg.train.stop_after_s <= 400 - 30, cfg.train.stop_after_s
    run = dev / "runs" / "r4x_recipe_s1-0001"
    assert (run / "checkpoints" / "step_0000040" / "model.safetensors").is_file()  # what the fake training left

    # C: the training resumed from that checkpoint to the end, then the cells in the plan's priority order
    cmds = _call(tmp_path, prefix, "c", STEP="train eval", DEADLINE_S="500", REHEARSE_STEP="160", **arm)
    (train,) = _trains(cmds)
    assert train.resume == str(run)
    assert load_config(ROOT / train.config, train.set).train.stop_after_s <= 500 - 30
    i_train = next(i for i, c in enumerate(cmds) if c[:1] == ["deepspeed"])
    i_eval = next(i for i, c in enumerate(cmds) if c[3:4] == ["eval"])
    assert i_train < i_eval
    evals = _evals(cmds)
    assert list(evals) == [f"recipe_s1_{c}" for c in TRAINED_ORDER]
    for name, ns in evals.items():
        job, L = name.split("_")[-2], int(name.split("_")[-1])
        assert not eval_problems_of(ns), (name, eval_problems_of(ns))
        assert ns.ckpt == f"{run}/checkpoints/step_0000160" and ns.step is None and ns.arm == "r4x_recipe_s1"
        assert ns.lengths == [L] and ns.n == 100 and ns.out == f"{dev}/eval/{name}"
        e = load_config(ROOT / ns.config, ns.set).eval
        assert e.lengths == [L]
        if job == "suite":  # the YAML's eval: RULER's 11 tasks and both held-out losses
            assert ns.tasks is None and e.suite == "ruler" and len(e.tasks) == 11
            assert e.loss.data and e.loss.sets == {"essays": "megablu:essays"}
        else:  # the passkey/needle job: its task alone at L - max_new, no loss
            assert ns.tasks == [job] and e.suite is None and e.loss.data is None and not e.loss.sets
            assert L in PK.values()
    # what comes back: the cells and the run's metrics, never a checkpoint (one is there)
    names = _tar_names(tmp_path / "out_c" / "results_recipe_s1.tar.gz")
    assert "runs/r4x_recipe_s1-0001/metrics.csv" in names and "runs/r4x_recipe_s1-0001/mixture.json" in names
    assert "eval/recipe_s1_suite_32768/step_0.json" in names
    assert (run / "checkpoints" / "step_0000160" / "model.safetensors").is_file()
    assert not any("checkpoints" in n or n.endswith((".safetensors", ".pt")) for n in names), names

    # D: a cell cut by C's deadline and one done: the cut one runs again, nothing else; the run is finished
    (dev / "eval" / "recipe_s1_passkey_16360" / "step_0.json").unlink()
    cmds = _call(tmp_path, prefix, "d", STEP="train eval", **arm)
    assert not _trains(cmds) and list(_evals(cmds)) == ["recipe_s1_passkey_16360"]


def test_eval_runs_the_longest_first_and_skips_cells_already_done(tmp_path, pieces):
    """A step json in a cell's dir (an earlier call's) skips that cell; LENGTHS keeps the plan's order for the
    lengths it names."""
    prefix, _ = pieces
    dev = tmp_path / "dev"
    ck = dev / "runs" / "r4x_long_only_s0-0003" / "checkpoints" / "step_0000160"
    ck.mkdir(parents=True)
    (ck / "model.safetensors").touch()
    (dev / ".stamp_corpus").write_text("ok\n")
    for done in ("long_only_s0_passkey_32744", "long_only_s0_suite_1024"):
        (dev / "eval" / done).mkdir(parents=True)
        (dev / "eval" / done / "step_160.json").write_text("{}")
    evals = _evals(_call(tmp_path, prefix, "e", STEP="eval", ARM="long_only", K="0"))
    assert list(evals) == [f"long_only_s0_{c}" for c in TRAINED_ORDER if c not in ("passkey_32744", "suite_1024")]
    assert all(ns.ckpt == str(ck) for ns in evals.values())
    evals = _evals(_call(tmp_path, prefix, "f", STEP="eval", ARM="long_only", K="0", LENGTHS="32768 8192"))
    assert list(evals) == []  # every one of those cells is there now
    for name in list((dev / "eval").iterdir()):
        shutil.rmtree(name)
    evals = _evals(_call(tmp_path, prefix, "g", STEP="eval", ARM="long_only", K="0", LENGTHS="32768 8192"))
    order = ("suite_32768", "passkey_32744", "suite_8192", "needle_32744", "needle_8168", "passkey_8168")
    assert list(evals) == [f"long_only_s0_{c}" for c in order]


def test_eval_refuses_a_training_that_has_not_finished(tmp_path, pieces):
    prefix, _ = pieces
    dev = tmp_path / "dev"
    (dev / "runs" / "r4x_recipe_s0-0001" / "checkpoints" / "step_0000080").mkdir(parents=True)
    (dev / ".stamp_corpus").write_text("ok\n")
    r = _run(tmp_path, prefix, "h", STEP="eval", ARM="recipe", K="0")
    assert r.returncode == 1 and "step_0000160" in r.stderr and "not finished" in r.stderr, r.stderr
    assert not (tmp_path / "cmds_h.log").exists()


def test_controls_native_in_its_window_then_untrained_yarn_static_and_length_aware(tmp_path, pieces):
    from megablu.config import load_config
    from megablu.eval.cli import _rope_against_checkpoint
    from megablu.model.hf import hf_config_dict

    prefix, _ = pieces
    dev = tmp_path / "dev"
    _call(tmp_path, prefix, "a", STEP="prep parent")  # no arm: the corpus, no synthetic set, no mixture
    smol = load_config(ROOT / "experiments/recipe_4x/long_only.yaml", ["rope.yarn=null"])
    (dev / "smollm2" / "config.json").write_text(json.dumps(hf_config_dict(smol.model, smol.rope, 8192)))
    evals = _evals(_call(tmp_path, prefix, "b", STEP="controls"))
    native = ["suite_8192", "passkey_8168", "suite_1024", "suite_4096", "passkey_1024", "passkey_4072"]
    native += ["needle_8168", "needle_1024", "needle_4072"]
    assert list(evals) == (
        [f"native_{c}" for c in native]
        + [f"yarn_untrained_{c}" for c in TRAINED_ORDER]
        + [f"yarn_untrained_beyond_{c}" for c in TRAINED_ORDER]
    )
    for name, ns in evals.items():
        cfg = load_config(ROOT / ns.config, ns.set)
        assert not eval_problems_of(ns), (name, eval_problems_of(ns))
        assert ns.ckpt == f"{dev}/smollm2" and ns.step == 0
        if name.startswith("native_"):  # the parent's own rope in its own 8192 positions
            assert ns.arm == "r4x_native" and ns.config == "experiments/recipe_4x/long_only.yaml"
            assert cfg.rope.yarn is None and cfg.data.window == 8192 and not ns.rope_override
            assert _rope_against_checkpoint(ns, cfg) == {}
        else:
            beyond = name.startswith("yarn_untrained_beyond_")
            assert ns.config == "experiments/recipe_4x/yarn_untrained.yaml" and ns.rope_override
            assert ns.arm == ("r4x_yarn_untrained_beyond" if beyond else "r4x_yarn_untrained")
            assert cfg.rope.yarn.factor == 4.0 and cfg.data.window == 32768
            assert cfg.rope.yarn.apply == ("beyond_original" if beyond else "always")
            assert "rope_override" in _rope_against_checkpoint(ns, cfg)
    names = _tar_names(tmp_path / "out_b" / "results_controls.tar.gz")
    assert "eval/native_suite_8192/step_0.json" in names
    assert "eval/yarn_untrained_beyond_needle_32744/step_0.json" in names


@pytest.mark.parametrize(
    "knobs, says",
    [
        (dict(STEP="train", ARM="recipes", K="0"), ["ARM=recipes", "long_only", "recipe_evallike", "native"]),
        (dict(STEP="eval", ARM="recipe", K="3"), ["K=3", "0, 1, 2"]),
        (dict(STEP="train", ARM="recipe"), ["K is not set", "K=0, 1 or 2"]),
        (dict(STEP="evaluate", ARM="recipe", K="0"), ["STEP=evaluate", "prep parent train eval controls"]),
        (dict(STEP="train", ARM="native"), ["STEP=train", "ARM=native", "long_only"]),
        (dict(STEP="eval", ARM="recipe", K="0", LENGTHS="32640"), ["LENGTHS holds 32640", "32768"]),
        (dict(STEP="train", ARM="recipe", K="0", TRAIN_MARGIN_S="half"), ["TRAIN_MARGIN_S=half", "(plan: 30)"]),
    ],
)
def test_a_wrong_knob_exits_2_naming_it_before_anything_runs(tmp_path, pieces, knobs, says):
    prefix, _ = pieces
    r = _run(tmp_path, prefix, "x", **knobs)
    assert r.returncode == 2 and all(s in r.stderr for s in says), r.stderr
    assert not (tmp_path / "cmds_x.log").exists() and not (tmp_path / "dev").exists()


def test_prep_of_another_training_on_the_same_machine_replaces_its_synthetic_set(tmp_path, pieces):
    """The synthetic set is the training's (--seed K): a set of another seed is rebuilt (megablu replaces it
    once the new one is complete), the corpus is not unpacked again, the same seed is not rebuilt."""
    prefix, _ = pieces
    dev = tmp_path / "dev"
    cmds = _call(tmp_path, prefix, "a", STEP="prep", ARM="recipe_evallike", K="0")
    (synth,) = [parse_command(c)[1] for c in cmds if c[3:5] == ["data", "synth"]]
    assert (synth.profile, synth.seed, synth.overwrite) == ("kv", 0, False) and synth.out == f"{dev}/synth_evallike"
    (dev / "synth_evallike").mkdir()
    (dev / "synth_evallike" / "manifest.json").write_text("{}")  # what the build left
    assert not any(
        c[3:5] == ["data", "synth"] for c in _call(tmp_path, prefix, "b", STEP="prep", ARM="recipe_evallike", K="0")
    )
    cmds = _call(tmp_path, prefix, "c", STEP="prep", ARM="recipe_evallike", K="2")
    (synth,) = [parse_command(c)[1] for c in cmds if c[3:5] == ["data", "synth"]]
    assert (synth.seed, synth.overwrite) == (2, True) and not any("unpack" in c for c in cmds)
