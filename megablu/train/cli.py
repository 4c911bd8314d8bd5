"""`megablu train` (resolve the launch, check, start the entry module) and `megablu probe` (the
first steps of a run through the same launch, measured).

Results go to stdout, logs to stderr. Exit 0 ok, 2 invalid config or launch, 1 a failed run or
probe (OOM).

  megablu train --config configs/ext32k.yaml --gpus 2 [--set k=v ...] [--resume RUN] [--dry-run]
  megablu train --config configs/ext64k_4gpu.yaml --hostfile my_hosts --master-addr node0
  megablu probe --config configs/l2.yaml --gpus 1 [--steps 3] [--set k=v ...] [--dry-run]

`train` is train/launch.py: the topology, the config checked for that world, the exact launcher
command (`python -m deepspeed.launcher.runner ... --module megablu.train.entry ...`), then the
launcher replaces this process. `probe` launches the same entry with the probe overrides, so
the probe measures exactly what a run does (same world size, ZeRO engine, data, kernels):
train.max_steps = train.probe_steps = --steps, a cosine schedule without warmup (a WSD tail
cannot fit 3 steps), no eval, no checkpoint, runs_dir = a fresh folder under
<runs_dir>/_probe/. Neither imports torch's training stack or deepspeed itself (DeepSpeed
prints on stdout).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _train(args) -> int:
    from .launch import LaunchError, launch

    try:
        return launch(args)
    except (LaunchError, OSError) as e:
        print(f"megablu train: {e}", file=sys.stderr)
        return 2


PROBE_SETS = [
    "train.max_steps={n}",
    "train.probe_steps={n}",
    "train.stop_after=null",
    "schedule.kind=cosine",
    "schedule.decay_start=null",
    "schedule.warmup_steps=0",
    "eval.at_steps=[]",
    "eval.final=false",
    "eval.gate.parent=null",
    "checkpoint.every_steps=0",
    "checkpoint.save_final=false",
]


def probe_command(args, cfg, runs_dir: str) -> tuple[list[str], dict]:
    """The launch `megablu train` makes (launch.build_command: the entry module on one node),
    with the probe's overrides after the user's, so they win."""
    from ..utils.device import resolve_device
    from .launch import build_command

    n = args.steps
    sets = [s.format(n=n) for s in PROBE_SETS] + [f"runs_dir={runs_dir}", f"name={cfg.name}_probe"]
    a = argparse.Namespace(
        config=args.config,
        set=list(args.set) + sets,
        resume=None,
        launcher="deepspeed",
        hostfile=None,
        master_port=args.master_port,
        device=resolve_device(cfg.train.device),
    )
    return build_command(a, [args.gpus or cfg.parallel.sp])


def _probe(args) -> int:
    from .. import plan
    from ..config import load_for_command

    cfg = load_for_command(args.config, args.set)
    if cfg is None:
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    runs_dir = str(Path(cfg.runs_dir, "_probe", stamp))
    cmd, env = probe_command(args, cfg, runs_dir)
    # the probe's config must be valid for its world size before anything is launched
    sets = cmd[cmd.index("--config") + 2 :][1::2]
    if load_for_command(args.config, sets, world_size=args.gpus or cfg.parallel.sp) is None:
        return 2
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    if args.dry_run:
        print(f"{shown + ' ' if shown else ''}{shlex.join(cmd)}")
        return 0
    log.info("probe: %s%s", shown + " " if shown else "", shlex.join(cmd))
    # child stdout carries DeepSpeed's prints and the summary line; logs go to our stderr
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    sys.stderr.write(proc.stdout)
    # rank 0 writes probe.json; a rank that ran out of memory writes probe.rank<r>.json
    found = sorted(Path(runs_dir).glob("*/probe*.json"))
    if not found:
        print(f"probe: the run exited {proc.returncode} without writing probe.json under {runs_dir}", file=sys.stderr)
        return 1
    probes = [(json.loads(f.read_text()), f) for f in found]
    probe, path = next(((p, f) for p, f in probes if p.get("oom")), probes[0])
    found = [path]
    if probe.get("setup"):
        setup = plan.Setup.from_json(probe["setup"])  # what the run actually was (world, sp, ops used)
    else:
        setup = plan.Setup.from_config(cfg, gpus=args.gpus or cfg.parallel.sp, sp=cfg.parallel.sp)
    est = plan.estimate(setup)
    probe["planned_gb"] = est.allocated_gb
    if probe.get("peak_gb"):
        probe["plan_error"] = est.allocated_gb / probe["peak_gb"] - 1
    probe["probe_json"] = str(found[-1])
    print(json.dumps(probe, indent=1))
    return 1 if probe.get("oom") or proc.returncode else 0


def register(sub) -> None:
    t = sub.add_parser(
        "train",
        help="resolve the launch (GPUs, nodes, sp), check the config for it, print the "
        "launcher command and run it (--dry-run: print and check only)",
    )
    from .launch import add_arguments, port, positive_int

    add_arguments(t)
    t.set_defaults(func=_train)

    q = sub.add_parser("probe", help="run a config's first steps through the normal entry and report memory/speed")
    q.add_argument("--config", required=True, help="configs/<arm>.yaml to measure")
    q.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override (repeatable)")
    q.add_argument("--gpus", type=positive_int, default=None, help="processes to launch; default parallel.sp")
    q.add_argument(
        "--steps", type=positive_int, default=3, help="real training steps to measure (the first pays warm-up)"
    )
    q.add_argument(
        "--master-port",
        type=port,
        default=29611,
        help="rendezvous port of the launch (change it when two probes run at once)",
    )
    q.add_argument("--dry-run", action="store_true", help="print the launch command and exit")
    q.set_defaults(func=_probe)
