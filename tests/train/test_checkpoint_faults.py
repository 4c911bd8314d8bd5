"""Fault injection against real DeepSpeed engines on CPU ranks (gloo).

Each scenario runs in one driver subprocess (`python test_checkpoint_faults.py SCENARIO`)
that imports torch/deepspeed once and then forks the ranks of every trial, so a trial
costs ~1 s instead of a fresh interpreter. Ranks train a tiny BluModel whose batches
depend on the torch, python and numpy RNGs (so exact resume needs all three restored),
save every 2 steps with keep=2, and can be told to kill -9 themselves at a save phase,
to fail a write (ENOSPC, or a silent short write), or to load a given checkpoint.

After every trial the driver checks the filesystem invariants and resumes:
  - every published step dir verifies (size + sha256 of every file): zero corrupted loads
  - the newest step whose save returned on rank 0 is still there and verified: zero lost
  - a resume continues from the newest verified step and its losses equal, bit for bit,
    those of an uninterrupted run.
The default pytest run does every save phase on each rank plus a few random-time kills;
MEGABLU_SLOW=1 (or -m slow) runs the long random sweep (count in docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
STEPS, EVERY, KEEP = 6, 2, 2
MODEL = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=97)


# =========================================================================== rank side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, spec: dict, tdir: Path) -> int:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist

    from megablu.checkpoint import CheckpointError, CheckpointManager, get_rng_state, set_rng_state
    from megablu.config.schema import ModelConfig, RopeConfig
    from megablu.model.decoder import BluModel

    torch.set_num_threads(1)
    cur = {"step": 0}
    plog = open(tdir / f"phase_{rank}.log", "a", buffering=1)
    kill = spec.get("kill")  # [phase, step, rank]

    def hook(name: str) -> None:
        plog.write(f"{cur['step']} {name}\n")
        if kill and kill[0] == name and kill[1] == cur["step"] and kill[2] == rank:
            os.kill(os.getpid(), signal.SIGKILL)

    fault = spec.get("fault")  # {"kind": "enospc"|"short", "rank": r, "step": s}
    if fault and fault["rank"] == rank:
        real_save = torch.save

        def bad_save(obj, f, *a, **k):
            if isinstance(f, str) and f.endswith("optim_states.pt") and cur["step"] == fault["step"]:
                real_save(obj, f, *a, **k)
                data = Path(f).read_bytes()
                Path(f).write_bytes(data[: len(data) // 2])
                if fault["kind"] == "enospc":
                    raise OSError(28, "No space left on device", f)
                return None  # silent short write: no error from the filesystem
            return real_save(obj, f, *a, **k)

        torch.save = bad_save

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    torch.manual_seed(0)
    model = BluModel(ModelConfig(**MODEL), RopeConfig(theta=10000))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stage = spec.get("stage", 2)
    eng, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        },
    )
    meta = {
        "config_hash": spec.get("config_hash", "cfg0"),
        "tokenizer": spec.get("tokenizer", "bytes-97"),
        "dp": world,
        "sp": 1,
        "world_size": world,
        "zero_stage": stage,
        "model": MODEL,
        "rope": {"theta": 10000.0},
        "window": 64,
    }
    mgr = CheckpointManager(
        spec["run_dir"], keep=spec.get("keep", KEEP), meta=meta, on_phase=hook, keep_every=spec.get("keep_every", 0)
    )
    torch.manual_seed(1000 + rank)
    random.seed(rank)
    np.random.seed(rank)
    (tdir / f"ready_{rank}").write_text("1")

    def bcast(x):
        box = [x]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def full_state() -> dict:
        """Full fp32 master weights and Adam moments per parameter (collective under ZeRO)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        st = {
            n: [
                safe_get_full_fp32_param(p),
                safe_get_full_optimizer_state(p, "exp_avg"),
                safe_get_full_optimizer_state(p, "exp_avg_sq"),
            ]
            for n, p in eng.module.named_parameters()
        }
        # Adam's step count (bias correction) per flat/partitioned group
        steps = {float(v["step"]) for v in eng.optimizer.optimizer.state.values() if "step" in v}
        st["__adam_steps__"] = [torch.tensor(sorted(steps))]
        return st

    start = 0
    try:
        if spec.get("load"):
            cs = mgr.load(eng, spec["load"])
            start = cs["step"]
            set_rng_state(cs["rng"])
        elif spec.get("resume"):
            p = bcast(str(mgr.resume_point() or "") if rank == 0 else None) or None  # as Trainer._load_resume
            if p:
                cs = mgr.load(eng, p)
                set_rng_state(cs["rng"])
                start = cs["step"]
        if rank == 0:
            (tdir / "start").write_text(str(start))
        if spec.get("expect_state"):  # resharded resume: state equals the saving run's, exactly
            st = full_state()
            if rank == 0:
                want = torch.load(spec["expect_state"], weights_only=False)
                bad = [n for n in want if not all(torch.equal(a, b) for a, b in zip(want[n], st[n]))]
                (tdir / "state_match.json").write_text(json.dumps({"n": len(want), "mismatch": bad}))
        losses = open(tdir / f"losses_{rank}.txt", "a", buffering=1)
        tokens = 0 if start == 0 else cs["tokens_seen"]
        for step in range(start + 1, spec.get("steps", STEPS) + 1):
            cur["step"] = step
            hook("train")
            # the batch depends on all three RNGs: exact resume needs each restored
            T = 12 + random.randint(0, 3) + int(np.random.randint(0, 3))
            x = torch.randint(0, 97, (1, T))
            s, n = eng(x, labels=x)
            loss = s / n
            eng.backward(loss)
            eng.step()
            tokens += T * world
            losses.write(f"{step} {loss.item()!r}\n")
            if step % spec.get("every", EVERY) == 0 or step == spec.get("steps", STEPS):
                cs = {
                    "step": step,
                    "tokens_seen": tokens,
                    "loader": {"index": step},
                    "schedule": {"step": step},
                    "rng": get_rng_state(),
                }
                mgr.save(eng, step, cs, pin=step in spec.get("pin", []))
                hook("saved")
        if spec.get("dump_state"):
            st = full_state()
            if rank == 0:
                torch.save(st, spec["dump_state"])
    except CheckpointError as e:
        (tdir / f"ckpt_error_{rank}.txt").write_text(str(e))
        return 3
    dist.barrier()
    return 0


# =========================================================================== driver side
def trial(spec: dict, world: int = 2, kill_after: float | None = None, timeout: float = 60.0) -> dict:
    """Fork `world` ranks running spec; optionally SIGKILL all after kill_after s of training."""
    trials = Path(spec["run_dir"]).parent / ".trials"  # beside the runs, removed with them
    trials.mkdir(exist_ok=True)
    tdir = Path(tempfile.mkdtemp(prefix="ckt-", dir=trials))
    port = _free_port()
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                sys.stdout.flush()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)  # DeepSpeed prints to stdout; the driver's stdout is its result
                code = _rank_main(r, world, port, spec, tdir)
            except BaseException:
                (tdir / f"traceback_{r}.txt").write_text(traceback.format_exc())
            finally:
                os._exit(code)
        pids.append(pid)
    if kill_after is not None:
        t0 = time.time()
        while not all((tdir / f"ready_{r}").exists() for r in range(world)) and time.time() - t0 < timeout:
            time.sleep(0.005)
        time.sleep(kill_after)
        for p in pids:
            _kill(p)
    status: dict[int, int] = {}
    t0 = time.time()
    first_fail = None
    t_ready = None
    while len(status) < world:
        for r, p in enumerate(pids):
            if r in status:
                continue
            done, st = os.waitpid(p, os.WNOHANG)
            if done:
                status[r] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
                if status[r] != 0 and first_fail is None:
                    first_fail = time.time()
        # a dead rank takes the job down, like the deepspeed launcher (after a grace period
        # in which the survivors must raise on their own)
        if first_fail is not None and time.time() - first_fail > 15:
            for r, p in enumerate(pids):
                if r not in status:
                    _kill(p)
        if time.time() - t0 > timeout:
            for r, p in enumerate(pids):
                if r not in status:
                    _kill(p)
        if t_ready is None and all((tdir / f"ready_{r}").exists() for r in range(world)):
            t_ready = time.time()
        time.sleep(0.005)
    # how long the ranks ran after all were ready (the span random kills are spread over)
    out = {"rc": [status[r] for r in range(world)], "tdir": str(tdir), "loop_s": time.time() - (t_ready or time.time())}
    for name in ("start",):
        f = tdir / name
        out[name] = int(f.read_text()) if f.exists() else None
    out["errors"] = {
        r: (tdir / f"ckpt_error_{r}.txt").read_text() for r in range(world) if (tdir / f"ckpt_error_{r}.txt").exists()
    }
    out["tracebacks"] = {
        r: (tdir / f"traceback_{r}.txt").read_text() for r in range(world) if (tdir / f"traceback_{r}.txt").exists()
    }
    out["losses"] = _losses(tdir / "losses_0.txt")
    out["state_match"] = (
        json.loads((tdir / "state_match.json").read_text()) if (tdir / "state_match.json").exists() else None
    )
    out["phases"] = (
        [ln.split() for ln in (tdir / "phase_0.log").read_text().splitlines()]
        if (tdir / "phase_0.log").exists()
        else []
    )
    out["phases1"] = (
        [ln.split() for ln in (tdir / "phase_1.log").read_text().splitlines()]
        if (tdir / "phase_1.log").exists()
        else []
    )
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    out = {}
    for ln in path.read_text().splitlines():
        s, v = ln.split()
        out[int(s)] = float(v)
    return out


def fs_check(run_dir: Path) -> dict:
    """Invariants that must hold at any instant: published steps verify, pointer sane."""
    from megablu.checkpoint import CKPT_DIR, LATEST, step_of, verify_checkpoint

    ck = run_dir / CKPT_DIR
    steps, corrupted = [], []
    for p in sorted(ck.iterdir()) if ck.is_dir() else []:
        if step_of(p) is not None:
            probs = verify_checkpoint(p)
            (corrupted if probs else steps).append(step_of(p))
            if probs:
                print(f"CORRUPTED {p}: {probs}", file=sys.stderr)
    latest = (ck / LATEST).read_text().strip() if (ck / LATEST).exists() else None
    latest_ok = latest is None or (step_of(latest) in steps)
    return {
        "verified": steps,
        "corrupted": corrupted,
        "latest": latest,
        "latest_ok": latest_ok,
        "tmp": sorted(p.name for p in ck.iterdir() if p.name.startswith(".")) if ck.is_dir() else [],
    }


def new_run(base: Path, name: str = "t") -> Path:
    from megablu.train.runs import allocate_run

    return allocate_run(base, name)


def reference(base: Path, world: int = 2, stage: int = 2) -> dict[int, float]:
    res = trial({"run_dir": str(new_run(base, "ref")), "stage": stage}, world)
    assert res["rc"] == [0] * world, res
    return res["losses"]


def _last_done_step(phases: list) -> int:
    done = [int(s) for s, ph in phases if ph == "done"]
    return max(done, default=0)


def kill_case(base: Path, ref: dict, kill=None, kill_after=None, world=2, stage=2) -> dict:
    """Kill (by phase or after a delay), check invariants, resume, compare with ref."""
    run = new_run(base)
    spec = {"run_dir": str(run), "stage": stage}
    if kill:
        spec["kill"] = kill
    res = trial(spec, world, kill_after=kill_after)
    killed = any(rc < 0 for rc in res["rc"])
    plog = res["phases1"] if kill and kill[2] == 1 else res["phases"]
    last = plog[-1] if plog else ["0", "start"]
    fs = fs_check(run)
    done = _last_done_step(res["phases"])
    # the newest step whose save returned is never pruned (keep >= 1), so it must be there
    lost = done > 0 and done not in fs["verified"]
    res2 = trial({"run_dir": str(run), "stage": stage, "resume": True}, world)
    fs2 = fs_check(run)
    mism = [s for s, v in res2["losses"].items() if ref.get(s) != v]
    ok = (
        res2["rc"] == [0] * world
        and not fs["corrupted"]
        and fs["latest_ok"]
        and not lost
        and not mism
        and not fs2["corrupted"]
        and not fs2["tmp"]
        and res2["start"] >= done
        and sorted(res2["losses"]) == list(range(res2["start"] + 1, STEPS + 1))
    )
    out = {
        "kill": kill,
        "kill_after": kill_after,
        "killed": killed,
        "phase_at_kill": last,
        "rc": res["rc"],
        "verified_after_kill": fs["verified"],
        "corrupted": fs["corrupted"],
        "latest": fs["latest"],
        "leftovers": fs["tmp"],
        "last_done": done,
        "lost": lost,
        "resumed_from": res2["start"],
        "resume_rc": res2["rc"],
        "loss_mismatch": mism,
        "after_resume_leftovers": fs2["tmp"],
        "verified_after_resume": fs2["verified"],
        "ok": ok,
    }
    if not ok:
        out["debug"] = {"tb": res["tracebacks"], "tb2": res2["tracebacks"], "err2": res2["errors"]}
    shutil.rmtree(res["tdir"], ignore_errors=True)
    shutil.rmtree(res2["tdir"], ignore_errors=True)
    return out


# save phases reached by each rank (rank 1 never runs rank 0's manifest..prune)
PHASES_BOTH = ["train", "prepare", "gather_weights", "ds_save", "ds_write", "client_state", "weights", "status"]
PHASES_R0 = ["manifest", "publish", "latest", "prune", "done", "saved"]


def scenario_kills(base: Path, n_random: int, seed: int = 0, ref=None, full: bool = False) -> dict:
    """kill -9 at every save phase (rank 0: all; rank 1: the phases it runs), in the first and
    last save too, then n_random kills at uniformly random times of the training loop."""
    ref = ref or reference(base)
    cases = []
    rank1 = PHASES_BOTH if full else ["train", "ds_write", "client_state", "status"]
    for ph in PHASES_BOTH + PHASES_R0:
        for r in [0, 1] if ph in rank1 else [0]:
            cases.append(kill_case(base, ref, kill=[ph, 4, r]))
    # the first save (nothing older to fall back to) and the last one
    for ph, st in (
        [("ds_write", 2), ("publish", 2), ("latest", 2), ("ds_write", 6), ("publish", 6), ("latest", 6), ("trashed", 6)]
        if full
        else [("publish", 2), ("latest", 6), ("trashed", 6)]
    ):
        cases.append(kill_case(base, ref, kill=[ph, st, 0]))
    rng = random.Random(seed)
    loop = trial({"run_dir": str(new_run(base)), "stage": 2}, 2)["loop_s"]
    for _ in range(n_random):
        cases.append(kill_case(base, ref, kill_after=rng.uniform(0, loop)))
    return {"ref": ref, "loop_s": loop, "cases": cases}


def scenario_faults(base: Path, ref=None) -> dict:
    """Failing writes on one rank, damaged shards, and resume after each."""
    from megablu.checkpoint import CKPT_DIR, MANIFEST, step_name

    ref = ref or reference(base)
    out = {}
    for kind in ("enospc", "short"):
        run = new_run(base)
        res = trial({"run_dir": str(run), "fault": {"kind": kind, "rank": 1, "step": 4}})
        fs = fs_check(run)
        res2 = trial({"run_dir": str(run), "resume": True})
        out[f"write_{kind}_rank1"] = {
            "rc": res["rc"],
            "errors": res["errors"],
            "verified": fs["verified"],
            "latest": fs["latest"],
            "leftovers": fs["tmp"],
            "resumed_from": res2["start"],
            "resume_rc": res2["rc"],
            "loss_mismatch": [s for s, v in res2["losses"].items() if ref.get(s) != v],
            "tb": res["tracebacks"],
        }
    # a complete run, then damage its newest step in three ways
    good = new_run(base, "good")
    assert trial({"run_dir": str(good)})["rc"] == [0, 0]
    for dmg in ("delete", "truncate", "flip", "manifest_edit", "extra_shard"):
        run = new_run(base, f"dmg_{dmg}")
        shutil.rmtree(run)
        shutil.copytree(good, run)
        step6 = run / CKPT_DIR / step_name(6)
        shard = step6 / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        if dmg == "delete":
            shard.unlink()
        elif dmg == "truncate":
            shard.write_bytes(shard.read_bytes()[:-100])
        elif dmg == "flip":
            b = bytearray(shard.read_bytes())
            b[len(b) // 2] ^= 0x01
            shard.write_bytes(bytes(b))
        elif dmg == "manifest_edit":
            m = json.loads((step6 / MANIFEST).read_text())
            del m["files"]["ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # "3 of 4" by editing
            (step6 / MANIFEST).write_text(json.dumps(m))
        elif dmg == "extra_shard":
            shutil.copy(shard, step6 / "ds" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
        # the run dir was copied: manifests name run "good"; rename so they belong to this run
        _rebrand(run, good.name)
        explicit = trial({"run_dir": str(run), "load": str(step6)})
        res2 = trial({"run_dir": str(run), "resume": True})
        out[f"damage_{dmg}"] = {
            "explicit_rc": explicit["rc"],
            "explicit_errors": explicit["errors"],
            "resumed_from": res2["start"],
            "resume_rc": res2["rc"],
            "loss_mismatch": [s for s, v in res2["losses"].items() if ref.get(s) != v],
            "tb": explicit["tracebacks"] or res2["tracebacks"],
        }
    # re-saving an existing step (resume from 4 by hand, run to 6 again), killed between
    # moving the old step 6 aside and publishing the new one: the old one comes back
    run = new_run(base, "resave")
    shutil.rmtree(run)
    shutil.copytree(good, run)
    _rebrand(run, good.name)
    r = trial({"run_dir": str(run), "load": str(run / CKPT_DIR / step_name(4)), "kill": ["replace", 6, 0]})
    fs = fs_check(run)
    r2 = trial({"run_dir": str(run), "resume": True})
    fs2 = fs_check(run)
    out["resave_kill"] = {
        "rc": r["rc"],
        "after_kill": fs,
        "resume_rc": r2["rc"],
        "resumed_from": r2["start"],
        "after_resume": fs2,
        "loss_mismatch": [s for s, v in {**r["losses"], **r2["losses"]}.items() if ref.get(s) != v],
    }
    # resuming with another tokenizer or config is refused before anything is loaded
    for key, val in (("tokenizer", "tiktoken-cl100k"), ("config_hash", "cfg-other")):
        r = trial({"run_dir": str(good), "resume": True, key: val})
        out[f"mismatch_{key}"] = {"rc": r["rc"], "errors": r["errors"]}
    return out


def _rebrand(run: Path, old_id: str) -> None:
    """Re-sign manifests of a copied run with the new run id (as the run itself would have)."""
    from megablu.checkpoint.layout import CKPT_DIR, MANIFEST, _manifest_digest, step_of

    for p in (run / CKPT_DIR).iterdir():
        if step_of(p) is None or not (p / MANIFEST).exists():
            continue
        m = json.loads((p / MANIFEST).read_text())
        if m.get("manifest_sha256") != _manifest_digest(m):
            continue  # deliberately damaged manifest stays damaged
        m["run_id"] = run.name
        m["manifest_sha256"] = _manifest_digest(m)
        (p / MANIFEST).write_text(json.dumps(m, indent=1))


def scenario_keep(base: Path) -> dict:
    """Two runs of the same name in one runs dir, keep=1, pinned step, a foreign step dir; a third run
    saving every step with keep=1, keep_every=3 for 10 steps, then resumed to 12."""
    from megablu.checkpoint import CKPT_DIR, step_name

    a, b = new_run(base, "same"), new_run(base, "same")
    ra = trial({"run_dir": str(a), "keep": 1, "steps": 4})
    # plant a copy of run A's step 2 inside run B (the seed's prefix collision)
    (b / CKPT_DIR).mkdir(parents=True, exist_ok=True)
    shutil.copytree(a / CKPT_DIR / step_name(4), b / CKPT_DIR / step_name(1))
    rb = trial({"run_dir": str(b), "keep": 1, "pin": [2], "steps": 8})
    fa, fb = fs_check(a), fs_check(b)
    c = new_run(base, "every")
    rc = trial({"run_dir": str(c), "keep": 1, "keep_every": 3, "every": 1, "steps": 10})
    fc = fs_check(c)
    rc2 = trial({"run_dir": str(c), "keep": 1, "keep_every": 3, "every": 1, "steps": 12, "resume": True})
    return {
        "ids": [a.name, b.name],
        "rc": [ra["rc"], rb["rc"]],
        "a": fa,
        "b": fb,
        "tb": [ra["tracebacks"], rb["tracebacks"], rc["tracebacks"], rc2["tracebacks"]],
        "every": {
            "id": c.name,
            "rc": [rc["rc"], rc2["rc"]],
            "after_10": fc,
            "resumed_from": rc2["start"],
            "after_12": fs_check(c),
        },
    }


def scenario_topology(base: Path) -> dict:
    """Resume on another world size: stage 0 directly, ZeRO 1-3 resharded (universal ckpt)."""
    out = {}
    for stage, w_save, w_resume in ((0, 2, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (3, 2, 1)):
        run = new_run(base, f"topo{stage}")
        dump = base / f"state_{stage}_{w_save}.pt"
        r1 = trial(
            {"run_dir": str(run), "stage": stage, "steps": 4, **({"dump_state": str(dump)} if stage else {})},
            world=w_save,
        )
        r2 = trial(
            {
                "run_dir": str(run),
                "stage": stage,
                "resume": True,
                "steps": 6,
                **({"expect_state": str(dump)} if stage else {}),
            },
            world=w_resume,
        )
        out[f"stage{stage}_w{w_save}to{w_resume}"] = {
            "save_rc": r1["rc"],
            "resume_rc": r2["rc"],
            "start": r2["start"],
            "errors": r2["errors"],
            "state_match": r2["state_match"],
            "resumed_steps": sorted(r2["losses"]),
            "leftovers": fs_check(run)["tmp"],
            "tb": r1["tracebacks"] or r2["tracebacks"],
        }
    # exact resume under ZeRO-3 (same world)
    ref = reference(base, stage=3)
    out["stage3_kill"] = kill_case(base, ref, kill=["publish", 4, 0], stage=3)
    return out


def scenario_all(base: Path, n_random: int) -> dict:
    ref = reference(base)
    out = {}
    for name, fn in [
        ("kills", lambda: scenario_kills(base, n_random, ref=ref)),
        ("faults", lambda: scenario_faults(base, ref=ref)),
        ("keep", lambda: scenario_keep(base)),
        ("topology", lambda: scenario_topology(base)),
    ]:
        t0 = time.time()
        out[name] = fn()
        out[name]["seconds"] = round(time.time() - t0, 1)
    return out


SCENARIOS = {
    "kills": scenario_kills,
    "faults": scenario_faults,
    "keep": scenario_keep,
    "topology": scenario_topology,
    "all": scenario_all,
}


def _driver_main(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ["DS_ACCELERATOR"] = "cpu"
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # import everything heavy once, before forking ranks (no torch op runs in the parent)
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (pulls torch._dynamo: ~6 s)

    # a rank killed while DeepSpeed JIT-builds its inference-only shm op would leave a stale lock
    # in the shared torch_extensions cache (another session's build flags change its version)
    from megablu.utils.dist import skip_cpu_shm_op

    skip_cpu_shm_op()
    import megablu.checkpoint  # noqa: F401

    name = argv[0]
    base = Path(argv[1])
    kw = json.loads(argv[2]) if len(argv) > 2 else {}
    t0 = time.time()
    res = SCENARIOS[name](base, **kw)
    res["seconds"] = round(time.time() - t0, 1)
    sys.stdout.write(json.dumps(res) + "\n")


def run_scenario(name: str, base: Path, timeout: int = 900, **kw) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, str(HERE), name, str(base), json.dumps(kw)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# =========================================================================== tests
SLOW = os.environ.get("MEGABLU_SLOW") == "1"
N_RANDOM_DEFAULT, N_RANDOM_SLOW = 3, 60


@pytest.fixture(scope="module")
def results():
    """One driver run for the whole module (imports torch/deepspeed once).

    Its own temp dir, not pytest's basetemp: concurrent pytest sessions on a shared
    machine prune each other's old basetemps, which removed the runs mid-module once.
    """
    base = Path(tempfile.mkdtemp(prefix="megablu-ckfaults-"))
    try:
        res = run_scenario("all", base, n_random=N_RANDOM_DEFAULT)
        res["_base"] = base
        yield res
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _assert_cases(cases):
    bad = [c for c in cases if not c["ok"]]
    assert not bad, json.dumps(bad, indent=1)[:6000]
    assert sum(len(c["corrupted"]) for c in cases) == 0
    assert not any(c["lost"] for c in cases)


def _check_kills(res):
    cases = res["cases"]
    _assert_cases(cases)
    for c in cases:  # every deterministic kill really killed the job
        if c["kill"]:
            assert c["killed"], c
        if c["kill"] and c["kill"][0] == "trashed":  # a step keep-N had pruned never comes back
            assert c["verified_after_resume"] == [4, 6], c
    hit = {c["phase_at_kill"][1] for c in cases if c["killed"]}
    assert set(PHASES_BOTH + PHASES_R0) <= hit, hit
    # some resumes came from a checkpoint, some started over (kill in the first save)
    assert any(c["resumed_from"] > 0 for c in cases) and any(c["resumed_from"] == 0 for c in cases)


def test_kill9_every_save_phase_then_exact_resume(results):
    _check_kills(results["kills"])


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="long random kill sweep: MEGABLU_SLOW=1")
def test_kill9_random_sweep():
    base = Path(tempfile.mkdtemp(prefix="megablu-cksweep-"))
    try:
        res = run_scenario("kills", base, timeout=3600, n_random=N_RANDOM_SLOW, seed=1, full=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _check_kills(res)
    from collections import Counter

    print(
        json.dumps(
            {
                "cases": len(res["cases"]),
                "seconds": res["seconds"],
                "phase_at_kill": Counter(c["phase_at_kill"][1] for c in res["cases"] if c["killed"]),
            }
        )
    )


def test_failing_write_on_one_rank_is_fatal_everywhere(results):
    out = results["faults"]
    for kind in ("enospc", "short"):
        c = out[f"write_{kind}_rank1"]
        # both ranks raise, the job exits non-zero, nothing from the failed step is published
        assert c["rc"] == [3, 3], c
        assert set(c["errors"]) == {"0", "1"}, c
        for msg in c["errors"].values():
            assert "step_0000004 failed; nothing published" in msg and "rank 1" in msg, msg
            assert ("No space left" in msg) if kind == "enospc" else ("short write" in msg), msg
        assert c["verified"] == [2] and c["latest"] == "step_0000002" and c["leftovers"] == [], c
        assert c["resumed_from"] == 2 and c["resume_rc"] == [0, 0] and c["loss_mismatch"] == [], c


def test_damaged_shard_refused_by_name_and_resume_falls_back(results):
    out = results["faults"]
    expect = {
        "delete": "missing ds/zero_pp_rank_1",
        "truncate": "size ds/zero_pp_rank_1",
        "flip": "checksum ds/zero_pp_rank_1",
        "manifest_edit": "manifest checksum mismatch",
        "extra_shard": "unlisted file ds/zero_pp_rank_2",
    }
    for dmg, needle in expect.items():
        c = out[f"damage_{dmg}"]
        assert c["explicit_rc"] == [3, 3], c  # explicit load refused on every rank
        for msg in c["explicit_errors"].values():
            assert "refusing to load" in msg and needle in msg, (dmg, msg)
        # resume skips the damaged newest step and continues exactly from the previous one
        assert c["resumed_from"] == 4 and c["resume_rc"] == [0, 0] and c["loss_mismatch"] == [], c


def test_kill_while_replacing_a_step_loses_nothing(results):
    c = results["faults"]["resave_kill"]
    assert c["rc"][0] == -9, c
    assert c["after_kill"]["verified"] == [4] and c["after_kill"]["corrupted"] == [], c
    assert any(n.startswith(".trash-step_0000006") for n in c["after_kill"]["tmp"]), c
    # the resume puts the old step 6 back before choosing where to start (resume_point), so
    # it starts from 6 and redoes nothing; nothing left over
    assert c["resume_rc"] == [0, 0] and c["resumed_from"] == 6, c
    assert c["after_resume"]["verified"] == [4, 6] and c["after_resume"]["tmp"] == [], c
    assert c["loss_mismatch"] == [], c


def test_resume_refuses_other_tokenizer_or_config(results):
    for key, val in (("tokenizer", "tiktoken-cl100k"), ("config_hash", "cfg-other")):
        c = results["faults"][f"mismatch_{key}"]
        assert c["rc"] == [3, 3], c
        assert f"{key}=" in c["errors"]["0"] and val in c["errors"]["0"], c


def test_keep_n_two_runs_pinned_and_foreign(results):
    out = results["keep"]
    assert out["ids"] == ["same-0001", "same-0002"]
    assert out["rc"] == [[0, 0], [0, 0]], out
    # run A (keep=1) kept its newest; run B's pruning never touched A
    assert out["a"]["verified"] == [4] and out["a"]["corrupted"] == []
    # run B: newest (8) kept, pinned 2 kept, foreign step_1 (manifest names run A) left alone
    assert out["b"]["verified"] == [1, 2, 8], out["b"]


def test_keep_every_outlives_keep_n_and_the_newest_stays_newest(results, capsys):
    """keep=1, keep_every=3, a save every step: steps 3, 6, 9 survive keep-N beside the newest; a resume
    continues from the newest (10), and keep counts only the steps keep_every does not keep: at 12
    (kept by keep_every) the newest other step, 11, stays. The run tools still name the newest."""
    c = results["keep"]["every"]
    assert c["rc"] == [[0, 0], [0, 0]], results["keep"]["tb"]
    assert c["after_10"]["verified"] == [3, 6, 9, 10] and c["after_10"]["corrupted"] == [], c
    assert c["after_10"]["latest"] == "step_0000010" and c["after_10"]["tmp"] == [], c
    assert c["resumed_from"] == 10, c
    assert c["after_12"]["verified"] == [3, 6, 9, 11, 12] and c["after_12"]["latest"] == "step_0000012", c
    run = results["_base"] / c["id"]
    rc, out, _ = _cli(["ckpt", "list", str(run), "--json"], capsys)
    rows = json.loads(out)
    assert rc == 0 and [r["step"] for r in rows] == ["3", "6", "9", "11", "12"], rows
    assert [r["flags"] for r in rows] == ["", "", "", "", "latest"] and {r["status"] for r in rows} == {"ok"}
    rc, out, _ = _cli(["runs", str(results["_base"]), "--json"], capsys)
    assert rc == 0 and {r["run"]: r["checkpoint"] for r in json.loads(out)}[c["id"]] == "step_0000012"


def test_resume_on_other_world_size(results):
    """World size change on resume: stage 0 loads directly; ZeRO 1-3 are resharded through a
    universal checkpoint and every parameter's fp32 master, exp_avg, exp_avg_sq and Adam's
    step count equal the saving run's, bit for bit; training then continues."""
    out = results["topology"]
    for key in ("stage0_w2to1", "stage1_w2to1", "stage2_w2to1", "stage2_w1to2", "stage3_w2to1"):
        c = out[key]
        n_resume = int(key[-1])
        assert c["save_rc"] == [0] * int(key.split("_w")[1][0]) and c["resume_rc"] == [0] * n_resume, c
        assert c["start"] == 4 and c["resumed_steps"] == [5, 6] and c["leftovers"] == [], c
        if not key.startswith("stage0"):
            assert c["state_match"] == {"n": 22, "mismatch": []}, c
    assert out["stage3_kill"]["ok"], out["stage3_kill"]


def test_consolidated_weights_equal_fp32_master(results):
    """model.safetensors of a ZeRO-1/2/3 step == the full fp32 master weights at that step
    (so init_from and export are topology-free and exact)."""
    import torch

    from megablu.checkpoint import read_weights

    base = results["_base"]
    for stage in (1, 2, 3):
        want = torch.load(base / f"state_{stage}_2.pt", weights_only=False)
        got = read_weights(base / f"topo{stage}-0001" / "checkpoints" / "step_0000004")
        assert sorted(got) == sorted(k for k in want if k != "__adam_steps__")
        for k, v in got.items():
            assert torch.equal(v, want[k][0]), (stage, k)


def _cli(argv, capsys):
    from megablu.cli import main

    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_verify_list_export_roundtrip(results, tmp_path, capsys):
    """`ckpt verify|list|export` on the engine-made run; the export loads in transformers."""
    import torch
    import transformers

    from megablu.checkpoint import load_weights
    from megablu.config.schema import ModelConfig, RopeConfig
    from megablu.model.decoder import BluModel
    from megablu.model.hf import from_hf, to_hf

    good = results["_base"] / "good-0001"
    rc, out, _ = _cli(["ckpt", "verify", str(good)], capsys)
    assert rc == 0 and out.split() == [
        "OK",
        str(good / "checkpoints/step_0000004"),
        "OK",
        str(good / "checkpoints/step_0000006"),
    ]
    rc, out, _ = _cli(["ckpt", "list", str(results["_base"]), "--json"], capsys)
    rows = {r["path"]: r for r in json.loads(out)}
    # the fault runs beside it hold damaged and foreign steps: a BAD row is exit 2, like verify
    assert rc == 2 and rows[str(good / "checkpoints/step_0000006")]["status"] == "ok"
    assert {r["status"] for r in rows.values()} == {"ok", "BAD"}
    assert rows[str(good / "checkpoints/step_0000006")]["flags"] == "latest"
    assert rows[str(good / "checkpoints/step_0000006")]["topology"] == "w2/dp2/sp1/z2"
    # a flipped byte in a copy of step 6 (in a run dir of the same id, so that it names its own run):
    # list (sizes only by default) vs list --verify and verify (sha256)
    dmg = tmp_path / "dmg" / "good-0001" / "checkpoints" / "step_0000006"
    shutil.copytree(good / "checkpoints/step_0000006", dmg)
    shard = dmg / "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    b = bytearray(shard.read_bytes())
    b[len(b) // 3] ^= 0x10
    shard.write_bytes(bytes(b))
    rc, out, _ = _cli(["ckpt", "list", str(tmp_path / "dmg"), "--json"], capsys)
    assert rc == 0 and json.loads(out)[0]["status"] == "ok"
    rc, out, _ = _cli(["ckpt", "list", str(tmp_path / "dmg"), "--json", "--verify"], capsys)
    assert rc == 2 and json.loads(out)[0]["status"] == "BAD"
    rc, out, _ = _cli(["ckpt", "verify", str(dmg)], capsys)
    assert rc == 2 and "checksum ds/zero_pp_rank_1_mp_rank_00_optim_states.pt" in out

    # export: run dir -> newest verified step -> HF dir
    rc, out, err = _cli(["ckpt", "export", str(good), "--out", str(tmp_path / "hf")], capsys)
    assert rc == 0 and out.strip() == str(tmp_path / "hf"), err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "LlamaForCausalLM"
    blu = BluModel(ModelConfig(**MODEL), RopeConfig(theta=10000))
    load_weights(blu, good / "checkpoints/step_0000006")  # consolidated weights of the step
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        ref = blu(x)
        assert torch.allclose(hf(x).logits, ref, atol=1e-5, rtol=1e-5)
        back = from_hf(hf)  # HF -> BluModel -> HF
        assert torch.equal(back(x), ref)
        assert torch.equal(to_hf(back, max_position=hf.config.max_position_embeddings)(x).logits, hf(x).logits)
    blu2 = BluModel(ModelConfig(**MODEL), RopeConfig(theta=10000))
    load_weights(blu2, tmp_path / "hf")  # init_from an export
    assert all(torch.equal(a, b) for a, b in zip(blu.state_dict().values(), blu2.state_dict().values()))
    # refuses to overwrite; a damaged step is never exported
    rc, _, err = _cli(["ckpt", "export", str(good), "--out", str(tmp_path / "hf")], capsys)
    assert rc == 2 and "already holds a megablu export; pass --force" in err
    rc, _, err = _cli(["ckpt", "export", str(dmg), "--out", str(tmp_path / "hf2")], capsys)
    assert rc == 2 and "checksum" in err and not (tmp_path / "hf2").exists()


def test_hub_upload_with_model_card_to_local_stand_in(results, tmp_path, capsys):
    good = results["_base"] / "good-0001"
    (good / "eval").mkdir(exist_ok=True)
    (good / "eval" / "passkey.json").write_text(
        json.dumps({"rows": [{"length": 1024, "acc": 0.8}, {"length": 4096, "acc": 0.62}]})
    )
    rc, out, err = _cli(["hub", "upload", str(good), "--to-local", str(tmp_path / "repo")], capsys)
    assert rc == 0, err
    assert sorted(out.split()) == ["README.md", "config.json", "megablu_export.json", "model.safetensors"]
    card = (tmp_path / "repo" / "README.md").read_text()
    assert "step 6" in card and "| 4096 | 0.62 |" in card and "bytes-97" in card
    # and it downloads back, verified
    rc, out, err = _cli(
        [
            "hub",
            "download",
            "me/x",
            "--from-local",
            str(tmp_path / "repo"),
            "--include",
            "*.json",
            "--include",
            "model.safetensors",
            "--local-dir",
            str(tmp_path / "dl"),
        ],
        capsys,
    )
    assert rc == 0 and len(out.split()) == 3, err


if __name__ == "__main__":
    _driver_main(sys.argv[1:])
