"""The bench the bad-input cases run on: a real dataset, the tiny config, parents and runs
made by hand (a manifest with real sha256s, no training), and runners that call the CLI and
the training entry in-process, capturing exit code, stdout, stderr and any exception.

`Lab(root)` builds everything lazily under root; tests/test_bad_input.py holds the cases,
tests/bad_input_table.py prints the RELIABILITY table from them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "tiny_cpu.yaml"


@dataclass
class Result:
    rc: Optional[int]
    out: str
    err: str
    exc: Optional[BaseException] = None


@dataclass
class Case:
    area: str  # configs | data | checkpoints | eval/hub | resume | concurrency | commands
    name: str
    run: Callable[[Lab], Result]
    expect: tuple = ()  # substrings the message must contain
    rc: int = 2  # 0: a correct result (the expected substrings in what it printed) is the answer
    watch: Optional[Callable[[Lab], Path]] = None  # a dir that a refusal must leave unchanged


@dataclass
class Outcome:
    kind: str  # refused | traceback | accepted | unclear
    detail: str = ""


def _tree(p: Optional[Path]) -> dict:
    if p is None or not p.exists():
        return {}
    # lstat: a link is an entry of its own (a symlink loop a case made cannot be followed)
    return {str(f.relative_to(p)): (f.lstat().st_size, f.lstat().st_mtime_ns) for f in sorted(p.rglob("*"))}


def classify(case: Case, res: Result, before: dict, after: dict) -> Outcome:
    text = res.err + res.out
    if res.exc is not None or "Traceback (most recent call last)" in text:
        return Outcome("traceback", repr(res.exc) if res.exc else text[-800:])
    if res.rc == 0 and case.rc != 0:
        return Outcome("accepted", text[-800:])
    missing = [s for s in case.expect if s not in res.err]
    if res.rc != case.rc or missing:
        return Outcome("unclear", f"rc {res.rc} (want {case.rc}); missing {missing}; stderr: {res.err[-1500:]}")
    if before != after:
        changed = sorted(set(before.items()) ^ set(after.items()))
        return Outcome("unclear", f"refused but wrote into the watched dir: {changed[:6]}")
    return Outcome("refused")


def run_case(case: Case, lab: Lab) -> tuple[Outcome, Result]:
    try:
        watched = case.watch(lab) if case.watch else None
        before = _tree(watched)
        res = case.run(lab)
    except Exception as e:  # noqa: BLE001 - the case could not even be set up or run: counted, not hidden
        res = Result(None, "", "", e)
        return Outcome("traceback", f"{type(e).__name__}: {e}"), res
    return classify(case, res, before, _tree(watched)), res


def _capture(fn) -> Result:
    out, err = io.StringIO(), io.StringIO()
    rc, exc = None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn()
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException as e:  # noqa: BLE001 - a traceback is what is being counted
            exc = e
    return Result(rc, out.getvalue(), err.getvalue(), exc)


_ENTRY = None


def entry_module():
    global _ENTRY
    if _ENTRY is None:
        spec = importlib.util.spec_from_file_location("megablu_entry", ROOT / "launch" / "ext32k.py")
        _ENTRY = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_ENTRY)
    return _ENTRY


class Lab:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self._cache: dict = {}

    # ------------------------------------------------------------------ basics
    def fresh(self, what: str = "d") -> Path:
        self._n += 1
        p = self.root / f"{what}{self._n:04d}"
        p.mkdir(parents=True)
        return p

    @property
    def data(self) -> Path:
        if "data" not in self._cache:
            from megablu.cli import main

            out = self.root / "data"
            std = sysconfig.get_paths()["stdlib"]
            r = _capture(
                lambda: main(
                    [
                        "data",
                        "build",
                        "--input",
                        f"{std}/json",
                        "--input",
                        f"{std}/email",
                        "--include",
                        "*.py",
                        "--tokenizer",
                        "tiktoken_file:megablu:stdlib4k",
                        "--out",
                        str(out),
                        "--no-progress",
                        "--workers",
                        "1",
                    ]
                )
            )
            assert r.rc == 0, r.err
            self._cache["data"] = out
        return self._cache["data"]

    def data_copy(self) -> Path:
        d = self.fresh("data") / "ds"
        shutil.copytree(self.data, d, ignore=shutil.ignore_patterns(".verified.json"))
        return d

    @property
    def cfg_file(self) -> Path:
        """tiny_cpu with this lab's dataset, 4 steps: the config every case starts from."""
        if "cfg" not in self._cache:
            p = self.root / "tiny.yaml"
            p.write_text(
                yaml.safe_dump(
                    {
                        "inherit": str(TINY),
                        "data": {"path": str(self.data), "max_epochs": 100.0},
                        "train": {"max_steps": 4},
                        "schedule": {"warmup_steps": 1},
                        "runs_dir": str(self.root / "runs"),
                    }
                )
            )
            self._cache["cfg"] = p
        return self._cache["cfg"]

    def config(self, sets=()):
        from megablu.config import load_config

        return load_config(self.cfg_file, list(sets))

    def write(self, name: str, text, binary: bool = False) -> Path:
        p = self.fresh("f") / name
        (p.write_bytes if binary else p.write_text)(text)
        return p

    @property
    def tokenizer(self):
        if "tok" not in self._cache:
            from megablu.data.tokenizer import load_tokenizer

            self._cache["tok"] = load_tokenizer(self.config().tokenizer)
        return self._cache["tok"]

    # ------------------------------------------------------------------ runners
    def cli(self, *argv) -> Result:
        from megablu.cli import main

        return _capture(lambda: main([str(a) for a in argv]))

    def check(self, sets=(), *extra, file=None) -> Result:
        """`megablu config check` as a user runs it on this machine (files checked)."""
        return self.cli(
            "config",
            "check",
            file or self.cfg_file,
            "--world-size",
            "1",
            "--device",
            "cpu",
            *sum((["--set", s] for s in sets), []),
            *extra,
        )

    def entry(self, sets=(), resume=None, world: int = 1, file=None, extra=()) -> Result:
        """launch/ext32k.py in this process, as rank 0 of `world` (the preflight refuses before any rank works)."""
        argv = ["--config", str(file or self.cfg_file), *sum((["--set", s] for s in sets), []), *map(str, extra)]
        if resume:
            argv += ["--resume", str(resume)]
        saved = dict(os.environ)
        for k in ("RANK", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)
        os.environ["WORLD_SIZE"] = str(world)
        if world > 1:
            os.environ.update(RANK="0", LOCAL_RANK="0")
        try:
            return _capture(lambda: entry_module().main(argv))
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def both(self, sets=(), file=None) -> Result:
        """config check and the entry: both must refuse, listing the same problems (one preflight)."""
        runs = self.fresh("runs")
        sets = [f"runs_dir={runs}", *sets]
        a, b = self.check(sets, file=file), self.entry(sets, file=file)
        if a.rc != b.rc:
            return Result(
                a.rc if a.rc != 2 else b.rc,
                a.out + b.out,
                f"config check rc {a.rc} but the entry rc {b.rc}:\n{a.err}\n---\n{b.err}",
                a.exc or b.exc,
            )
        problems = [sorted(ln for ln in r.err.splitlines() if ln.startswith("  - ")) for r in (a, b)]
        if problems[0] != problems[1]:  # the case's message found in one of them only is not "alike"
            return Result(
                98,
                a.out + b.out,
                f"config check and the entry list other problems:\n{a.err}\n---\n{b.err}",
                a.exc or b.exc,
            )
        if any(runs.iterdir()):
            return Result(99, "", f"the refusal left {list(runs.iterdir())} in runs_dir", None)
        return Result(b.rc, a.out + b.out, b.err + a.err, a.exc or b.exc)

    # ------------------------------------------------------------------ checkpoints and runs by hand
    def step(
        self,
        run_dir: Path,
        step: int,
        cfg,
        *,
        run_id=None,
        tokenizer=None,
        weights=None,
        extra_files: Optional[dict] = None,
    ) -> Path:
        """A published step dir whose manifest lists real files with their sha256 (no DeepSpeed)."""
        from megablu.checkpoint import CKPT_DIR, save_weights, step_name
        from megablu.checkpoint.layout import _manifest_digest
        from megablu.config import config_hash
        from megablu.utils.files import sha256_file

        d = Path(run_dir) / CKPT_DIR / step_name(step)
        (d / "ds").mkdir(parents=True)
        (d / "client_state").mkdir()
        if weights is not None:
            save_weights(weights, d / "model.safetensors", {"step": step, "run_id": run_id or Path(run_dir).name})
        (d / "ds" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(64))
        (d / "client_state" / "rank_00000.pt").write_bytes(os.urandom(32))
        for rel, blob in (extra_files or {}).items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(blob)
        files = {
            f.relative_to(d).as_posix(): {"size": f.stat().st_size, "sha256": sha256_file(f)}
            for f in sorted(d.rglob("*"))
            if f.is_file()
        }
        m = {
            "format": 1,
            "run_id": run_id or Path(run_dir).name,
            "step": step,
            "created_unix": time.time(),
            "world_size": 1,
            "dp": 1,
            "sp": cfg.parallel.sp,
            "zero_stage": cfg.parallel.zero_stage,
            "zero_partitions": 0,
            "config_hash": config_hash(cfg),
            "tokenizer": tokenizer or self.tokenizer.identity,
            "meta": {
                "model": cfg.model.model_dump(mode="json"),
                "rope": cfg.rope.model_dump(mode="json"),
                "window": cfg.data.window,
                "sp": cfg.parallel.sp,
                "config": cfg.model_dump(mode="json"),
            },
            "pinned": False,
            "client_state": {"step": step, "tokens_seen": step * cfg.train.tokens_per_step},
            "files": files,
        }
        m["manifest_sha256"] = _manifest_digest(m)
        (d / "manifest.json").write_text(json.dumps(m, indent=1))
        return d

    def run_without_window(self) -> Path:
        """A real run's step 2 whose manifest records no training window (re-signed) and whose run has no
        config.resolved.yaml: nothing says at which length the weights were trained."""
        from megablu.checkpoint.layout import _manifest_digest

        _, run = self.run(steps=(2,), with_weights=True)
        step = run / "checkpoints" / "step_0000002"
        m = json.loads((step / "manifest.json").read_text())
        del m["meta"]["window"]
        m["manifest_sha256"] = _manifest_digest(m)
        (step / "manifest.json").write_text(json.dumps(m))
        (run / "config.resolved.yaml").unlink()
        return step

    def weights(self, cfg):
        import torch

        from megablu.model.decoder import BluModel

        torch.manual_seed(0)
        return BluModel(cfg.model, cfg.rope).state_dict()

    def run(self, sets=(), steps=(2,), name="tiny_cpu", with_weights=False) -> tuple[Path, Path]:
        """(runs_dir, run dir) of a run with checkpoints at `steps`, made by hand like the trainer lays it out."""
        from megablu.config import to_yaml

        runs = self.fresh("runs")
        cfg = self.config([f"runs_dir={runs}", *sets])
        run = runs / f"{name}-0001"
        (runs / ".ids").mkdir(parents=True)
        (runs / ".ids" / run.name).write_text("{}\n")
        run.mkdir()
        (run / "run.json").write_text(json.dumps({"run_id": run.name, "name": name}))
        (run / "config.resolved.yaml").write_text(to_yaml(cfg))
        for s in steps:
            self.step(run, s, cfg, weights=self.weights(cfg) if with_weights else None)
        return runs, run

    def parent(self, sets=(), tokenizer=None) -> Path:
        """A parent run dir (one step, real weights of the config's shape)."""
        from megablu.config import to_yaml

        runs = self.fresh("parent")
        cfg = self.config(sets)
        run = runs / "p-0001"
        run.mkdir()
        (run / "config.resolved.yaml").write_text(to_yaml(cfg))
        self.step(run, 4, cfg, tokenizer=tokenizer, weights=self.weights(cfg))
        return run

    def lock(self, run: Path, *, host=None, pid=None, age_s: float = 0.0, proc_start=None) -> Path:
        """A run.lock as another job would have written it."""
        from megablu.train.runs import LOCK

        now = time.time() - age_s
        info = {
            "host": host or socket.gethostname(),
            "pid": pid or os.getpid(),
            "started_unix": now,
            "heartbeat_unix": now,
            "token": "t" * 32,
            "command": "deepspeed ... launch/ext32k.py",
        }
        if proc_start is not None:
            info["proc_start"] = proc_start
        (run / LOCK).write_text(json.dumps(info))
        return run / LOCK


def dead_pid() -> int:
    """A pid that is not running (a child that has exited and been reaped)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def flip_byte_keep_stat(f: Path, offset: int = 10) -> None:
    """Flip one byte in place, keeping size, inode and mtime (what the cache keys on)."""
    st = f.stat()
    with open(f, "r+b") as h:
        h.seek(offset)
        b = h.read(1)
        h.seek(offset)
        h.write(bytes([b[0] ^ 0xFF]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


@dataclass
class Tally:
    rows: dict = field(default_factory=dict)

    def add(self, area: str, outcome: Outcome) -> None:
        r = self.rows.setdefault(area, {"tried": 0, "refused": 0, "traceback": 0, "accepted": 0, "unclear": 0})
        r["tried"] += 1
        r[outcome.kind] += 1

    def markdown(self) -> str:
        lines = [
            "| category | cases tried | refused cleanly | tracebacks | silently accepted | other |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        tot = {"tried": 0, "refused": 0, "traceback": 0, "accepted": 0, "unclear": 0}
        for area in ("configs", "data", "checkpoints", "eval/hub", "resume", "concurrency", "commands"):
            r = self.rows.get(area)
            if not r:
                continue
            for k in tot:
                tot[k] += r[k]
            lines.append(
                f"| {area} | {r['tried']} | {r['refused']} | {r['traceback']} | {r['accepted']} | {r['unclear']} |"
            )
        lines.append(
            f"| **all** | **{tot['tried']}** | **{tot['refused']}** | **{tot['traceback']}** | "
            f"**{tot['accepted']}** | **{tot['unclear']}** |"
        )
        return "\n".join(lines)
