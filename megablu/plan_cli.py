"""`megablu plan` (the fit table) and `megablu probe` (measure the first steps of a run).

Results go to stdout, logs to stderr. Exit 0 ok, 2 invalid config, 1 probe failure (OOM).

  megablu plan --config yaml_configs/ext32k.yaml --gpus 1,2,4,8 --windows 16k,32k,64k,128k,1M
  megablu plan --config yaml_configs/l2.yaml --calibration runs/_probe/.../probe.json --json
  megablu probe --config yaml_configs/l2.yaml --gpus 1 [--steps 3] [--set k=v ...] [--dry-run]

`probe` launches the normal entry (deepspeed launch/ext32k.py) with the probe overrides, so
the probe measures exactly what a run does (same world size, ZeRO engine, data, kernels):
train.max_steps = train.probe_steps = --steps, a cosine schedule without warmup (a WSD
tail cannot fit 3 steps), no eval, no checkpoint, runs_dir = a fresh folder under
<runs_dir>/_probe/. It never imports torch or deepspeed itself (DeepSpeed prints on stdout).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _load(args):
    from .config import ConfigError, load_config

    try:
        return load_config(args.config, args.set)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return None


def _plan(args) -> int:
    from . import plan

    cfg = _load(args)
    if cfg is None:
        return 2
    try:
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else [cfg.parallel.sp]
        windows = plan.parse_tokens(args.windows) if args.windows else [cfg.data.window]
    except ValueError as e:
        print(f"invalid --gpus/--windows: {e}", file=sys.stderr)
        return 2
    calib = plan.load_calibration(args.calibration) if args.calibration else None
    if calib is not None:
        log.info("calibration: activations x%.3f, static %+.2f GB", calib.act_scale, calib.static_offset_gb)
    sp = cfg.parallel.sp if args.sp == "config" else None
    rows = plan.fit_table(cfg, gpus, windows, args.gpu_gb, calib, ops=args.ops, sp=sp, host_gb=args.host_gb)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{cfg.name}: {cfg.model.n_params() / 1e9:.3f}B params; zero={cfg.parallel.zero_stage} "
              f"recompute={cfg.memory.recompute} loss_chunk={cfg.memory.loss_chunk} "
              f"micro_batch={cfg.train.micro_batch}; sp = {'GPUs' if sp is None else sp}; verdict: <= 80% comfortable, <= 100% "
              f"tight (probe first), else impossible")
        print(plan.format_table(rows, args.gpu_gb, args.host_gb))
    return 0


PROBE_SETS = ["train.max_steps={n}", "train.probe_steps={n}", "train.stop_after=null", "schedule.kind=cosine",
              "schedule.decay_start=null", "schedule.warmup_steps=0", "eval.at_steps=[]", "eval.final=false",
              "eval.gate.parent=null", "checkpoint.every_steps=0", "checkpoint.save_final=false"]


def probe_command(args, cfg, runs_dir: str) -> list[str]:
    n = args.steps
    sets = [s.format(n=n) for s in PROBE_SETS] + [f"runs_dir={runs_dir}", f"name={cfg.name}_probe"]
    gpus = args.gpus or cfg.parallel.sp
    cmd = ["deepspeed", "--num_gpus", str(gpus), "--master_port", str(args.master_port), "launch/ext32k.py",
           "--config", args.config]
    for s in list(args.set) + sets:   # probe overrides last: they win
        cmd += ["--set", s]
    return cmd


def _probe(args) -> int:
    from . import plan

    cfg = _load(args)
    if cfg is None:
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    runs_dir = str(Path(cfg.runs_dir, "_probe", stamp))
    cmd = probe_command(args, cfg, runs_dir)
    # the probe's config must be valid for its world size before anything is launched
    from .config import ConfigError, load_config

    sets = cmd[cmd.index("--config") + 2:][1::2]
    try:
        load_config(args.config, sets, world_size=args.gpus or cfg.parallel.sp)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    log.info("probe: %s", " ".join(cmd))
    # child stdout carries DeepSpeed's prints and the summary line; logs go to our stderr
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    sys.stderr.write(proc.stdout)
    # rank 0 writes probe.json; a rank that ran out of memory writes probe.rank<r>.json
    found = sorted(Path(runs_dir).glob("*/probe*.json"))
    if not found:
        print(f"probe: the run exited {proc.returncode} without writing probe.json under {runs_dir}",
              file=sys.stderr)
        return 1
    probes = [(json.loads(f.read_text()), f) for f in found]
    probe, path = next(((p, f) for p, f in probes if p.get("oom")), probes[0])
    found = [path]
    if probe.get("setup"):
        setup = plan._setup_from_probe(probe)   # what the run actually was (world, sp, ops used)
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
    p = sub.add_parser("plan", help="memory fit table per (GPUs, window) from the analytical model")
    p.add_argument("--config", required=True, help="yaml_configs/<arm>.yaml: model, memory switches, ZeRO, window")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override (repeatable)")
    p.add_argument("--gpus", default=None, help="comma list, e.g. 1,2,4,8 (sp = GPUs); default: parallel.sp")
    p.add_argument("--windows", default=None, help="comma list, e.g. 16k,32k,64k,1M; default: data.window")
    p.add_argument("--gpu-gb", type=float, default=141.0, help="GPU memory in GB (1e9 B); H200: 141")
    p.add_argument("--host-gb", type=float, default=None,
                   help="pinned host memory per GPU for offloaded activations (e.g. 110 on a 128 GB 1-GPU host); "
                        "a row needing more is impossible, and suggestions stay within it")
    p.add_argument("--calibration", default=None, help="probe.json or a calibration json")
    p.add_argument("--ops", choices=["cuda", "torch"], default=None,
                   help="model the fused CUDA ops (default unless memory.ops=torch) or the torch reference")
    p.add_argument("--sp", choices=["gpus", "config"], default="gpus",
                   help="sp = the GPU count (default) or the config's parallel.sp (dp = GPUs / sp)")
    p.add_argument("--json", action="store_true", help="rows as JSON instead of the table")
    p.set_defaults(func=_plan)

    q = sub.add_parser("probe", help="run a config's first steps through the normal entry and report memory/speed")
    q.add_argument("--config", required=True, help="yaml_configs/<arm>.yaml to measure")
    q.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override (repeatable)")
    q.add_argument("--gpus", type=int, default=None, help="processes to launch; default parallel.sp")
    q.add_argument("--steps", type=int, default=3, help="real training steps to measure (the first pays warm-up)")
    q.add_argument("--master-port", type=int, default=29611, help="rendezvous port of the launch (change it when "
                   "two probes run at once)")
    q.add_argument("--dry-run", action="store_true", help="print the launch command and exit")
    q.set_defaults(func=_probe)
