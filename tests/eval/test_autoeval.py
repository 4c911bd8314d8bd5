"""Auto-eval in a tiny real run (2 CPU ranks through the deepspeed launcher, sp=2, ZeRO-2; ~20 s
once DeepSpeed's shm_comm extension is built): the trainer evaluates at eval.at_steps, writes
eval/step_<N>.json from the sp-collective run_eval, pins that checkpoint, resumes training, and
evaluates again at the end (eval.final) on the same prompts."""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path


def test_autoeval_then_resume(tmp_path):
    from tests.train.test_resume import launch, rows

    stdlib = sysconfig.get_paths()["stdlib"]
    data = tmp_path / "stdlib"
    r = subprocess.run([sys.executable, "-m", "megablu.cli", "data", "build", "--input", f"{stdlib}/json",
                        "--input", f"{stdlib}/email", "--include", "*.py", "--tokenizer",
                        "tiktoken_file:megablu:stdlib4k", "--out", str(data), "--no-progress", "--workers", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    common = [f"runs_dir={tmp_path}/runs", f"data.path={data}", "train.max_steps=4", "schedule.warmup_steps=1",
              "schedule.decay_start=2", "checkpoint.every_steps=0", "checkpoint.keep=1", "data.max_epochs=100",
              "eval.lengths=[232,488]", "eval.n=2", "eval.at_steps=[2]", "eval.final=true"]
    out = launch(2, common)
    run = Path(out["run_dir"])
    res = json.loads((run / "eval" / "step_2.json").read_text())
    assert res["step"] == 2 and res["sp"] == 2
    assert [(c["length"], c["n"]) for c in res["cells"]] == [(232, 2), (488, 2)]
    assert [r[0] for r in rows(run)] == [1, 2, 3, 4]                    # training resumed after the eval
    pinned = sorted(p.parent.name for p in (run / "checkpoints").glob("*/pinned"))
    assert pinned == ["step_0000002", "step_0000004"]                  # evaluated checkpoints are kept
    final = json.loads((run / "eval" / "step_4.json").read_text())      # eval.final at the last step
    assert final["step"] == 4 and [c["digest"] for c in final["cells"]] == [c["digest"] for c in res["cells"]]
