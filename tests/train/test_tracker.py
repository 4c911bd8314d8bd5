"""train.tracker (megablu/train/tracker.py): optional, local-first experiment trackers beside
metrics.csv and TensorBoard. Offline: a stand-in module records what megablu hands the tracker;
the real packages are exercised where they are installed (they are extras, not requirements)."""

from __future__ import annotations

import csv
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megablu.config import config_hash, load_config
from megablu.train import tracker as T
from megablu.train.metrics import MetricsWriter
from megablu.train.preflight import CHECKS, Context
from megablu.train.resume import resume_problems

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny_cpu.yaml"

# A stand-in for wandb / trackio: init(**kw) -> a run whose log calls, and finish(), land in RECORD (a JSON
# lines file when MEGABLU_TRACKER_RECORD names one, so a subprocess's calls can be read back).
STAND_IN = """
import json, os
RECORD = []
def _rec(*e):
    RECORD.append(e)
    if os.environ.get("MEGABLU_TRACKER_RECORD"):
        with open(os.environ["MEGABLU_TRACKER_RECORD"], "a") as f:
            f.write(json.dumps(e) + "\\n")
class _Run:
    def log(self, metrics, step=None):
        _rec("log", metrics, step)
def finish():
    _rec("finish")
def init(**kw):
    _rec("init", {k: v for k, v in kw.items() if k != "config"}, sorted(kw.get("config") or {}))
    return _Run()
"""


def stand_in(name: str, monkeypatch) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    exec(STAND_IN, mod.__dict__)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def tracker_check(cfg):
    return dict(CHECKS)["tracker"](Context(cfg))


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_tracker_that_is_not_installed_is_refused_naming_the_extra(name, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # find_spec and import of it fail, as when absent
    (p,) = tracker_check(load_config(TINY, [f"train.tracker={name}"]))
    assert p.startswith(f"train.tracker={name}: the {name} package is not installed")
    assert f"pip install 'megablu[{name}]'" in p and "train.tracker=none" in p
    assert tracker_check(load_config(TINY, [])) == []  # the default, none, needs nothing
    with pytest.raises(RuntimeError, match=rf"megablu\[{name}\]"):
        T.open_tracker(name, Path("runs/x"), {})


def test_an_unknown_tracker_is_a_config_error():
    from megablu.config import ConfigError

    with pytest.raises(ConfigError, match="train.tracker"):
        load_config(TINY, ["train.tracker=mlflow"])


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_every_logged_step_reaches_the_tracker_beside_the_csv(name, tmp_path, monkeypatch):
    mod = stand_in(name, monkeypatch)
    run = tmp_path / "tiny_cpu-0001"
    run.mkdir()
    w = MetricsWriter(run, 0, T.open_tracker(name, run, {"train": {"max_steps": 2}}))
    w.write({"step": 1, "loss": 5.5, "lr": 1e-3, "tokens_seen": 512, "mfu": None})
    w.write({"step": 2, "loss": 5.0, "lr": 1e-3, "tokens_seen": 1024, "mfu": None})
    w.close()
    init, *logs, fin = mod.RECORD
    assert init[0] == "init" and init[1]["project"] == "megablu" and init[1]["name"] == run.name
    assert init[1]["resume"] == "allow" and init[2] == ["train"]
    if name == "wandb":  # offline, its files under the run dir
        assert init[1]["mode"] == "offline" and init[1]["dir"] == str(run) and init[1]["id"] == run.name
    assert logs == [
        ("log", {"train/loss": 5.5, "train/lr": 1e-3, "train/tokens_seen": 512}, 1),
        ("log", {"train/loss": 5.0, "train/lr": 1e-3, "train/tokens_seen": 1024}, 2),
    ]
    assert fin == ("finish",)
    with open(run / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1", "2"]


def test_the_tracker_is_a_session_field():
    """Not hashed (the runs from before it keep their hash) and a resume may turn it on or off."""
    off, on = load_config(TINY, []), load_config(TINY, ["train.tracker=wandb"])
    assert config_hash(off) == config_hash(on)
    assert resume_problems(off.model_dump(mode="json"), on, step=1) == []


@pytest.mark.e2e
def test_a_training_run_logs_to_the_tracker(tmp_path, stdlib_data):
    """The entry on one CPU rank, train.tracker=wandb with the stand-in on PYTHONPATH: rank 0 opens
    one tracker run named after the run dir, logs each step, finishes it."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "wandb.py").write_text(STAND_IN)
    record = tmp_path / "record.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        DS_ACCELERATOR="cpu",
        MEGABLU_TRACKER_RECORD=str(record),
        PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    sets = [
        f"runs_dir={tmp_path}/runs",
        f"data.path={stdlib_data}",
        "train.max_steps=2",
        "schedule.warmup_steps=1",
        "checkpoint.every_steps=0",
        "train.probe_steps=0",
        "train.tracker=wandb",
    ]
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "ext32k.py"),
            "--config",
            str(TINY),
            *sum((["--set", s] for s in sets), []),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = (tmp_path / "runs").glob("tiny_cpu-*")
    calls = [json.loads(ln) for ln in record.read_text().splitlines()]
    assert calls[0][0] == "init" and calls[0][1]["name"] == run.name and calls[0][1]["dir"] == str(run)
    assert [c[2] for c in calls[1:-1]] == [1, 2] and all("train/loss" in c[1] for c in calls[1:-1])
    assert calls[-1] == ["finish"]


def test_trackio_offline_for_real(tmp_path, monkeypatch, capsys):
    """Where trackio is installed: a run logged to its local store (TRACKIO_DIR) and read back;
    nothing it prints reaches stdout."""
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    trackio = pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    run = tmp_path / "tiny_cpu-0001"
    run.mkdir()
    t = T.open_tracker("trackio", run, {"train": {"max_steps": 2}})
    t.log({"step": 1, "loss": 5.5}, 1)
    t.log({"step": 2, "loss": 5.0}, 2)
    t.close()
    assert capsys.readouterr().out == ""
    logs = SQLiteStorage.get_logs(T.PROJECT, run.name)
    assert [(r["step"], r["train/loss"]) for r in logs] == [(1, 5.5), (2, 5.0)], (trackio.__version__, logs)
