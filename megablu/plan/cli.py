"""`megablu plan`: the fit table per (GPUs, window) from the analytical memory model.

Results go to stdout, logs to stderr. Exit 0 ok, 2 invalid config.

  megablu plan --config configs/ext32k.yaml --gpus 1,2,4,8 --windows 16k,32k,64k,128k,1M
  megablu plan --config configs/l2.yaml --calibration runs/_probe/.../probe.json --json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

log = logging.getLogger(__name__)


def _load(args):
    from ..config import load_for_command

    return load_for_command(args.config, args.set)


def _plan(args) -> int:
    from .. import plan

    cfg = _load(args)
    if cfg is None:
        return 2
    gpus = args.gpus or [cfg.parallel.sp]
    windows = args.windows or [cfg.data.window]
    try:
        calib = plan.load_calibration(args.calibration) if args.calibration else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:  # a garbage file: said, no traceback
        print(
            f"megablu plan: --calibration {args.calibration}: not a calibration or probe JSON ({type(e).__name__}: "
            f"{e}); give the probe.json a `megablu probe` wrote, or a calibration json",
            file=sys.stderr,
        )
        return 2
    if calib is not None:
        log.info("calibration: activations x%.3f, static %+.2f GB", calib.act_scale, calib.static_offset_gb)
    sp = cfg.parallel.sp if args.sp == "config" else None
    rows = plan.fit_table(cfg, gpus, windows, args.gpu_gb, calib, ops=args.ops, sp=sp, host_gb=args.host_gb)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        picked = plan.Setup.from_config(cfg)  # memory.loss/attention=auto: what they pick for a GPU run here
        shown = picked.loss if cfg.memory.loss == picked.loss else f"{cfg.memory.loss}->{picked.loss}"
        att = cfg.memory.attention
        att = picked.attention if att == picked.attention else f"{att}->{picked.attention}"
        print(
            f"{cfg.name}: {cfg.model.n_params() / 1e9:.3f}B params; zero={cfg.parallel.zero_stage} "
            f"recompute={cfg.memory.recompute} loss={shown} attention={att} loss_chunk={cfg.memory.loss_chunk} "
            f"micro_batch={cfg.train.micro_batch}; sp = {'GPUs' if sp is None else sp}; verdict: <= 80% "
            f"comfortable, <= 100% tight (probe first), else impossible"
        )
        print(plan.format_table(rows, args.gpu_gb, args.host_gb))
    return 0


def _gpu_list(text: str) -> list[int]:
    """argparse type of --gpus: '1,2,4,8' -> [1, 2, 4, 8], each an integer >= 1."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        try:
            n = int(part)
        except ValueError:
            n = None
        if n is None or n < 1:
            raise argparse.ArgumentTypeError(
                f"{part or repr(text)}: not a GPU count (an integer >= 1; a comma list like 1,2,4,8)"
            )
        out.append(n)
    return out


def _window_list(text: str) -> list[int]:
    """argparse type of --windows: '16k,32k,1M' -> token counts, each >= 1."""
    from .table import parse_tokens

    try:
        ws = parse_tokens(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token counts like 16k,32k,1M") from None
    bad = [w for w in ws if w < 1]
    if bad or not ws:
        raise argparse.ArgumentTypeError(
            f"{bad[0] if bad else repr(text)}: a window is a positive number of tokens (e.g. 16k,32k,1M)"
        )
    return ws


def _gb(text: str) -> float:
    """argparse type of --gpu-gb / --host-gb: a finite number of GB > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(
            f"{v:g} GB: memory must be a number > 0 (in GB of 1e9 B; an H200 has 141, an H100 80)"
        )
    return v


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory fit table per (GPUs, window) from the analytical model")
    p.add_argument("--config", required=True, help="configs/<arm>.yaml: model, memory switches, ZeRO, window")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override (repeatable)")
    p.add_argument(
        "--gpus", type=_gpu_list, default=None, help="comma list, e.g. 1,2,4,8 (sp = GPUs); default: parallel.sp"
    )
    p.add_argument(
        "--windows", type=_window_list, default=None, help="comma list, e.g. 16k,32k,64k,1M; default: data.window"
    )
    p.add_argument("--gpu-gb", type=_gb, default=141.0, help="GPU memory in GB (1e9 B); H200: 141")
    p.add_argument(
        "--host-gb",
        type=_gb,
        default=None,
        help="pinned host memory per GPU for offloaded activations (e.g. 110 on a 128 GB 1-GPU host); "
        "a row needing more is impossible, and suggestions stay within it",
    )
    p.add_argument("--calibration", default=None, help="probe.json or a calibration json")
    p.add_argument(
        "--ops",
        choices=["cuda", "torch"],
        default=None,
        help="model the fused CUDA ops (default unless memory.ops=torch) or the torch reference",
    )
    p.add_argument(
        "--sp",
        choices=["gpus", "config"],
        default="gpus",
        help="sp = the GPU count (default) or the config's parallel.sp (dp = GPUs / sp)",
    )
    p.add_argument("--json", action="store_true", help="rows as JSON instead of the table")
    p.set_defaults(func=_plan)
