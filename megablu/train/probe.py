"""The probe: the first steps of a run measured for memory and speed, with a clean OOM abort.

    result = run_probe(step_fn, steps=3, tokens_per_rank=T // sp, device="cuda",
                       tokens_per_step=tokens this rank processes per step_fn call,
                       flops_per_token=plan.flops_per_token(model, T), setup=setup_dict(cfg, world),
                       out=run_dir / "probe.json")

step_fn(i) runs step i (a whole optimizer step of the run); it may return the seconds it spent
on work that is not the step (a checkpoint save or an eval that fell on it), which are not
timed. Measured: memory allocated before the first step (static: weights, optimizer states), the peak of
torch.cuda.max_memory_allocated over the steps, per-token MB = (peak - static) / tokens
per rank (activations + grads + loss working set, per token of one micro-batch), step time
(median of the steps after the first, which pays cuDNN autotuning and allocator growth),
tokens/s per rank and MFU = model flops (6N + causal attention 6 L T H D per token, no
recompute) / step time / the GPU's dense bf16 peak (utils/device.PEAK_BF16_TFLOPS).

On torch.cuda.OutOfMemoryError the probe raises ProbeOOM, carrying what was measured so
far and the planner's suggestion for the same setup, and writes probe.json with oom=true.
On CPU there is no memory accounting: memory fields are None, timings are real.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..utils.device import mfu, peak_bf16_tflops

log = logging.getLogger(__name__)

GB = 1e9


class ProbeOOM(RuntimeError):
    """Out of memory during the probe; `measured` holds the numbers, `suggestion` the planner's fix."""

    def __init__(self, measured: dict, suggestion: Optional[str], cause: str):
        self.measured, self.suggestion = measured, suggestion
        m = measured
        lines = [
            f"probe: CUDA out of memory in step {m['steps_done'] + 1} of {m['steps']} "
            f"({m['tokens_per_rank']:,} tokens per rank)",
            f"  static before the first step: {_gb(m.get('static_gb'))}; "
            f"peak reached before the failure: {_gb(m.get('peak_gb'))}"
            + (f" of {m['gpu_total_gb']:.1f} GB" if m.get("gpu_total_gb") else ""),
            f"  planner predicted: {_gb(m.get('planned_gb'))}",
            f"  cause: {cause}",
        ]
        lines.append(
            f"  suggestion: {suggestion}"
            if suggestion
            else "  suggestion: none from the planner (no setup switch fits); use more GPUs"
        )
        super().__init__("\n".join(lines))


def _gb(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f} GB"


def setup_dict(cfg, world_size: int, ops_used: Optional[str] = None, loss_used: Optional[str] = None) -> dict:
    """The planner's Setup for this run as plain JSON (probe.json 'setup'; Setup.from_json reads it),
    plus the configured memory.ops, memory.loss and memory.attention (`ops` and `attention` are what ran:
    "auto" resolves at the first step; `loss` is the implementation the model's head runs, `loss_used`:
    apply_memory resolved auto)."""
    from ..plan import Setup

    setup = Setup.from_config(cfg, gpus=world_size, sp=cfg.parallel.sp, ops=ops_used, loss=loss_used)
    return {
        **setup.to_json(),
        "ops_config": cfg.memory.ops,
        "loss_config": cfg.memory.loss,
        "attention_config": cfg.memory.attention,
    }


def _ops_used(device: str) -> str:
    """Which elementwise ops the model ran: the CUDA extension is loaded once it was used."""
    if device != "cuda":
        return "torch"
    from ..ops import builder

    return "cuda" if getattr(builder, "_loaded", None) is not None else "torch"


def _host_gb_per_gpu() -> Optional[float]:
    """Pinned host memory a suggestion may ask of this node per local GPU: 80% of its RAM
    shared by the GPUs here (None when unknown)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return 0.8 * ram / 1e9 / max(1, n)


def _planner(setup: Optional[dict], gpu_total_gb: Optional[float]) -> tuple[Optional[float], Optional[str]]:
    """(predicted GB allocated, cheapest fitting change) for the probe's setup, if known."""
    if not setup:
        return None, None
    try:
        from .. import plan

        s = plan.Setup.from_json(setup)
        est = plan.estimate(s)
        return est.allocated_gb, plan.suggest(s, gpu_total_gb or 141.0, host_gb=_host_gb_per_gpu())
    except Exception as e:  # noqa: BLE001 - a planner bug must not hide the OOM report
        log.warning("probe: planner failed on this setup: %s", e)
        return None, None


def _write(out: Optional[Union[str, Path]], result: dict) -> None:
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def run_probe(
    step_fn: Callable[[int], object],
    *,
    steps: int,
    tokens_per_rank: int,
    device: str,
    tokens_per_step: Optional[int] = None,
    flops_per_token: Optional[float] = None,
    peak_tflops: Optional[float] = None,
    setup: Optional[dict] = None,
    out: Optional[Union[str, Path]] = None,
    world_size: int = 1,
) -> dict:
    """Run step_fn(0..steps-1), measure, write `out` (probe.json) and return the result dict.

    tokens_per_rank: tokens of one micro-batch on this rank (micro_batch * T / sp), the unit
    whose activations are alive at the peak; tokens_per_step: tokens this rank processes per
    step_fn call (default tokens_per_rank); tokens_per_s is per rank, x world_size for all.
    """
    if steps <= 0:
        raise ValueError(f"probe: steps must be > 0, got {steps}")
    cuda = device == "cuda" and torch.cuda.is_available()
    tokens_per_step = tokens_per_step or tokens_per_rank
    if peak_tflops is None and cuda:
        peak_tflops = peak_bf16_tflops()  # this GPU's dense bf16 peak; None (no MFU) when not in the table
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    static = torch.cuda.memory_allocated() if cuda else None
    gpu_total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB if cuda else None
    planned, _ = _planner(setup, gpu_total)
    times: list[float] = []
    result: dict[str, Any] = {
        "steps": steps,
        "steps_done": 0,
        "device": device,
        "tokens_per_rank": tokens_per_rank,
        "tokens_per_step": tokens_per_step,
        "world_size": world_size,
        "static_gb": static / GB if static is not None else None,
        "gpu_total_gb": gpu_total,
        "planned_gb": planned,
        "setup": setup,
        "oom": False,
    }

    def summarise():
        # the running max since the reset: every finished step and, after an OOM, the failed one
        peak = torch.cuda.max_memory_allocated() if cuda else None
        result.update(steps_done=len(times), step_times_s=times, peak_gb=peak / GB if peak is not None else None)
        if peak is not None and static is not None:
            result["per_token_mb"] = (peak - static) / tokens_per_rank / 1e6
        if times:
            dt = statistics.median(times[1:] or times)
            result.update(
                step_time_s=dt,
                tokens_per_s=tokens_per_step / dt,
                tokens_per_s_all_ranks=tokens_per_step * world_size / dt,
            )
            u = mfu(flops_per_token, tokens_per_step, dt, peak_tflops) if flops_per_token else None
            if u is not None:
                result["mfu"] = u

    for i in range(steps):
        t0 = time.perf_counter()
        try:
            aside = step_fn(i)
            if cuda:
                torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError as e:
            summarise()
            result["oom"] = True
            result["error"] = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
            _, suggestion = _planner(setup, gpu_total)
            result["suggestion"] = suggestion
            _write(out, result)
            raise ProbeOOM(result, suggestion, result["error"]) from None
        # a step_fn may return the seconds it spent outside the step itself (checkpoint, eval)
        times.append(time.perf_counter() - t0 - (aside if isinstance(aside, (int, float)) else 0.0))
        if i == 0 and setup is not None and setup.get("ops_config") == "auto":
            setup["ops"] = _ops_used(device)  # auto falls back to torch when the build fails
        if i == 0 and setup is not None and setup.get("attention_config") == "auto":
            from ..ops.attention import AUTO_CHOICE

            setup["attention"] = AUTO_CHOICE.get("kernel", setup.get("attention"))  # what the first step ran
    summarise()
    _write(out, result)
    log.info(
        "probe: peak %s (static %s, %s MB/token/rank), %.3f s/step, %.0f tokens/s%s",
        _gb(result["peak_gb"]),
        _gb(result["static_gb"]),
        f"{result['per_token_mb']:.3f}" if "per_token_mb" in result else "n/a",
        result["step_time_s"],
        result["tokens_per_s"],
        f", MFU {result['mfu']:.0%}" if "mfu" in result else "",
    )
    return result
