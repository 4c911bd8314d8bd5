"""Auto-eval in a tiny real run (2 CPU ranks through the deepspeed launcher, sp=2, ZeRO-2; ~12 s on
2 cores): the trainer evaluates at eval.at_steps, writes eval/step_<N>.json from the sp-collective
run_eval, pins that checkpoint, resumes training, and evaluates again at the end (eval.final) on
the same prompts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_autoeval_then_resume(tmp_path, stdlib_data):
    from tests.train.test_resume import launch, rows

    data = stdlib_data
    common = [
        f"runs_dir={tmp_path}/runs",
        f"data.path={data}",
        "train.max_steps=4",
        "schedule.warmup_steps=1",
        "schedule.decay_start=2",
        "checkpoint.every_steps=0",
        "checkpoint.keep=1",
        "data.max_epochs=100",
        "eval.lengths=[232,488]",
        "eval.n=2",
        "eval.at_steps=[2]",
        "eval.final=true",
    ]
    out = launch(2, common)
    run = Path(out["run_dir"])
    res = json.loads((run / "eval" / "step_2.json").read_text())
    assert res["step"] == 2 and res["sp"] == 2
    assert [(c["length"], c["n"]) for c in res["cells"]] == [(232, 2), (488, 2)]
    assert [r[0] for r in rows(run)] == [1, 2, 3, 4]  # training resumed after the eval
    pinned = sorted(p.parent.name for p in (run / "checkpoints").glob("*/pinned"))
    assert pinned == ["step_0000002", "step_0000004"]  # evaluated checkpoints are kept
    final = json.loads((run / "eval" / "step_4.json").read_text())  # eval.final at the last step
    assert final["step"] == 4 and [c["digest"] for c in final["cells"]] == [c["digest"] for c in res["cells"]]


def test_final_gate_failure_fails_the_run_after_saving(tmp_path, stdlib_data):
    """A parent that scored 100% at the short length and an arm that did not: the run trains,
    publishes its checkpoint and eval, then exits 1 naming the gate (the seed's cache bug would
    have been caught here)."""
    import os

    from tests.dist_utils import free_port
    from tests.train.test_resume import ROOT, SCRATCH, TINY

    data = stdlib_data
    n = 3
    parent = {
        "schema": "megablu.eval/1",
        "arm": "parent",
        "step": 40,
        "window": 512,
        "tokenizer": "x",
        "sp": 1,
        "samples": [],
        "cells": [{"task": "passkey", "length": 232, "n": n, "correct": n, "acc_pp": 100.0}],
    }
    (tmp_path / "parent.json").write_text(json.dumps(parent))
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        str(ROOT / "launch" / "ext32k.py"),
        "--config",
        str(TINY),
    ]
    for s in [
        SCRATCH,
        f"runs_dir={tmp_path}/runs",
        f"data.path={data}",
        "parallel.sp=1",
        "train.micro_batch=1",
        "train.tokens_per_step=512",
        "train.max_steps=2",
        "schedule.kind=cosine",
        "schedule.decay_start=null",
        "schedule.warmup_steps=0",
        "checkpoint.every_steps=0",
        "data.max_epochs=100",
        "eval.lengths=[232]",
        f"eval.n={n}",
        "eval.final=true",
        f"eval.gate.parent={tmp_path / 'parent.json'}",
        "eval.gate.short_lengths=[232]",
    ]:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=ROOT)
    assert "SHORT-CONTEXT GATE FAILED" in r.stderr, r.stderr[-3000:]
    runs = list((tmp_path / "runs").glob("tiny_cpu_ext-*"))
    assert len(runs) == 1
    final = json.loads((runs[0] / "eval" / "step_2.json").read_text())
    assert final["cells"][0]["acc_pp"] < 95.0  # the premise: a 2-step model cannot find the key
    assert final["gate"]["passed"] is False
    assert r.returncode == 1, r.stderr[-3000:]
    assert "SHORT-CONTEXT GATE FAILED" in r.stderr
    assert (runs[0] / "checkpoints" / "step_0000002" / "manifest.json").is_file()  # saved before failing
    summary = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
    assert summary["steps"] == 2 and "GATE FAILED" in summary["gate"]
    probe = json.loads((runs[0] / "probe.json").read_text())  # every run measures its first steps
    assert probe["steps_done"] == 2 and probe["tokens_per_s"] > 0 and probe["setup"]["window"] == 512


def test_eval_step_killed_before_its_result_is_evaluated_on_resume(tmp_path, stdlib_data):
    """A stop between an eval step's checkpoint and its result (simulated: the result deleted)
    is evaluated on resume before training goes on; a run whose result exists is not re-evaluated.
    One rank, the entry started as a plain process (what happens on resume is the trainer's, not the
    launcher's: the deepspeed launcher runs the tests above)."""
    from tests.train.test_resume import SCRATCH, TINY
    from tests.train.test_run_lifecycle import entry, summary

    def run(sets, resume=None):
        return summary(entry([SCRATCH, *sets], resume=resume, config=TINY))

    data = stdlib_data
    common = [
        f"runs_dir={tmp_path}/runs",
        f"data.path={data}",
        "parallel.sp=1",
        "train.micro_batch=1",
        "train.tokens_per_step=512",
        "train.max_steps=4",
        "schedule.warmup_steps=1",
        "schedule.decay_start=2",
        "checkpoint.every_steps=0",
        "data.max_epochs=100",
        "eval.lengths=[232]",
        "eval.n=2",
        "eval.at_steps=[2]",
        "eval.final=false",
        "train.probe_steps=0",
    ]
    first = run(common + ["train.stop_after=2"])
    run_dir = Path(first["run_dir"])
    result = run_dir / "eval" / "step_2.json"
    assert result.is_file()
    result.unlink()  # as if killed before the eval finished
    for f in (run_dir / "eval").glob("step_2.*"):
        f.unlink()
    resumed = run(common, resume=str(run_dir))
    assert resumed["steps"] == 4
    again = json.loads(result.read_text())
    assert again["step"] == 2 and again["cells"][0]["n"] == 2
