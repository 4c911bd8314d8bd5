"""The fit table: one row per (GPUs, window), its verdict, limiting term and cheapest change."""

from __future__ import annotations

import logging
from typing import Optional

from ..config.schema import Config
from .changes import suggest, verdict
from .memory import Calibration, Setup, estimate

log = logging.getLogger(__name__)


def parse_tokens(text: str) -> list[int]:
    """'16k,32k,1M' -> [16384, 32768, 1048576]."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = {"k": 1024, "m": 1024**2}.get(p[-1], 1)
        out.append(int(float(p[:-1] if mult > 1 else p) * mult))
    return out


def fit_table(
    cfg: Config,
    gpus: list[int],
    windows: list[int],
    gpu_gb: float,
    calib: Optional[Calibration] = None,
    ops: Optional[str] = None,
    sp: Optional[int] = None,
    host_gb: Optional[float] = None,
) -> list[dict]:
    """One row per (gpus, window); sp = gpus, or a fixed sp (dp = gpus / sp; others skipped).
    host_gb: pinned host memory per GPU the suggestions may use for offloaded activations."""
    rows = []
    for g in gpus:
        if sp is not None and (g % sp or sp > g):
            log.warning("plan: %d GPUs is not a multiple of sp=%d; row skipped", g, sp)
            continue
        for w in windows:
            s = Setup.from_config(cfg, gpus=g, window=w, ops=ops, sp=sp)
            e = estimate(s, calib)
            frac = e.gpu_gb / gpu_gb
            v = verdict(frac)
            limiting = e.limiting
            if host_gb is not None and e.host_gb > host_gb:  # offloaded activations need the host too
                v, limiting = "impossible", f"pinned host memory {e.host_gb:.0f} GB > {host_gb:g} GB per GPU"
            rows.append(
                {
                    "gpus": g,
                    "sp": s.sp,
                    "window": w,
                    "tokens_per_rank": s.tokens_per_rank,
                    "gb_per_gpu": e.gpu_gb,
                    "host_gb_per_gpu": e.host_gb,
                    "frac": frac,
                    "verdict": v,
                    "limiting": limiting,
                    "phase": e.phase,
                    "suggestion": suggest(s, gpu_gb, calib, host_gb=host_gb) if v != "comfortable" else None,
                }
            )
    return rows


def _fmt_tokens(n: int) -> str:
    if n % 1024**2 == 0:
        return f"{n // 1024**2}M"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def format_table(rows: list[dict], gpu_gb: float, host_gb: Optional[float] = None) -> str:
    lines = [
        f"| GPUs | sp | target | tok/rank | GB/GPU | % of {gpu_gb:g} GB | verdict | limiting term |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['gpus']} | {r['sp']} | {_fmt_tokens(r['window'])} | {r['tokens_per_rank']:,} | "
            f"{r['gb_per_gpu']:.1f} | {r['frac']:.1%} | {r['verdict']} | {r['limiting']} |"
        )
    hosts = [r for r in rows if r.get("host_gb_per_gpu")]
    if hosts:
        lines.append("")
        lines.append(
            "Pinned host memory for offloaded activations (memory.offload_activations), per GPU: "
            + ", ".join(f"{r['gpus']} GPUs {_fmt_tokens(r['window'])}: {r['host_gb_per_gpu']:.1f} GB" for r in hosts)
            + (
                ""
                if host_gb is not None
                else " (not checked against any host: pass --host-gb, the pinned memory one GPU's share "
                "of its node can give, to mark rows that need more impossible)"
            )
        )
    sugg = [r for r in rows if r["verdict"] != "comfortable"]
    if sugg:
        lines.append("")
        lines.append("Cheapest change to fit:")
        for r in sugg:
            lines.append(
                f"- {r['gpus']} GPUs, {_fmt_tokens(r['window'])}: "
                f"{r['suggestion'] or 'nothing in reach (more GPUs than 64)'}"
            )
    return "\n".join(lines)
