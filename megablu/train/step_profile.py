"""`train.profile_step: N`: training step N under torch.profiler, its wall time split by phase.

Where a step of the real entry spends its time beyond the model's forward and backward (why the
entry runs slower than the fwd+bwd bench of the same model: experiments/speed/LOG.md): the data,
sharding and the token count, each micro-batch's forward, backward and engine step (the last one
is the optimizer's: DeepSpeed steps the optimizer at the accumulation boundary), the grad norm
and the loss's reduction. Each phase is bracketed by device synchronisations, so its time is
wall time including the GPU work it launched; the syncs themselves cost a few microseconds each,
and the profiled step's time is printed beside the unprofiled steps' median for that reason.

Written to the run dir (rank 0): profile/step_<N>.md (the phase table and torch's top kernels
by self device time) and profile/step_<N>.trace.json.gz (a chrome trace: chrome://tracing or
Perfetto; dropped above train.profile_trace_mib). Every other step runs without any of this.
"""

from __future__ import annotations

import gzip
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import torch

STEP_RANGE = "megablu::step"  # bench/profile_step.py imports it: one name for the step range


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class PhaseTimer:
    """timer("forward") as a context manager: syncs, times and names (record_function) one phase."""

    def __init__(self, device: str):
        self.device = device
        self.spans: list[tuple[str, float]] = []

    @contextmanager
    def __call__(self, name: str):
        from torch.profiler import record_function

        _sync(self.device)
        t = time.perf_counter()
        with record_function(f"megablu::{name}"):
            yield
            _sync(self.device)
        self.spans.append((name, time.perf_counter() - t))

    def totals(self) -> dict[str, tuple[int, float]]:
        """phase -> (calls, seconds), in the order phases first ran."""
        out: dict[str, tuple[int, float]] = {}
        for name, s in self.spans:
            n, tot = out.get(name, (0, 0.0))
            out[name] = (n + 1, tot + s)
        return out


def no_timer(_name: str):
    return nullcontext()


def profiler_table(prof, rows: int = 30) -> str:
    """torch's key_averages table, by self device time where this build has it."""
    for key in (
        "self_device_time_total",
        "self_cuda_time_total",
        "device_time_total",
        "cuda_time_total",
        "self_cpu_time_total",
    ):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90)
        except Exception:  # noqa: BLE001 - the key this torch build does not know
            continue
    return ""


def phase_markdown(step: int, wall_s: float, totals: dict, others_median_s: Optional[float], device: str) -> str:
    """The phase table of one profiled step (ms and % of the step's wall time)."""
    lines = [
        f"# step {step} under the profiler ({device})",
        "",
        f"Step wall time {wall_s * 1e3:.1f} ms (device-synchronised phases)"
        + (f"; the unprofiled steps' median so far {others_median_s * 1e3:.1f} ms" if others_median_s else "")
        + ".",
        "",
        "| phase | calls | ms | % of step |",
        "|---|---|---|---|",
    ]
    attributed = 0.0
    for name, (n, s) in totals.items():
        attributed += s
        lines.append(f"| {name} | {n} | {s * 1e3:.1f} | {100 * s / wall_s:.1f} |")
    rest = wall_s - attributed
    lines.append(f"| (between phases) | - | {rest * 1e3:.1f} | {100 * rest / wall_s:.1f} |")
    lines += [
        "",
        "optimizer_step is the engine step at the accumulation boundary (DeepSpeed's optimizer step, "
        "gradient clipping and, under ZeRO, the reduction and the parameter update); engine_step the ones "
        "before it (bookkeeping only).",
    ]
    return "\n".join(lines) + "\n"


def cupti_teardown(device: str) -> None:
    """Ask Kineto to finalize CUPTI when the profiler stops (TEARDOWN_CUPTI=1), unless the user set it.

    Without it CUPTI stays attached after the profiled step and every later kernel launch pays for it: every step
    after the profiled one runs a few percent slower, for the rest of the run (pytorch/pytorch#144455). The
    teardown's known crash needs CUDA graphs, which megablu does not use."""
    if device == "cuda":
        os.environ.setdefault("TEARDOWN_CUPTI", "1")


def run_profiled(
    fn, *, device: str, step: int, run_dir: Path, others_median_s: Optional[float], trace_max_mib: float, write: bool
):
    """fn(timer) under torch.profiler inside STEP_RANGE; writes profile/step_<step>.{md,trace.json.gz} when
    `write` (rank 0). Returns fn's result."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    cupti_teardown(device)
    timer = PhaseTimer(device)
    with profile(activities=acts) as prof:
        _sync(device)
        t = time.perf_counter()
        with record_function(STEP_RANGE):
            result = fn(timer)
            _sync(device)
        wall = time.perf_counter() - t
    if write:
        out = Path(run_dir) / "profile"
        out.mkdir(exist_ok=True)
        md = phase_markdown(step, wall, timer.totals(), others_median_s, device)
        trace = out / f"step_{step}.trace.json.gz"
        md += "\n" + export_trace(prof, trace, int(trace_max_mib * 2**20)) + " (train.profile_trace_mib)\n"
        md += (
            "\n## top ops (torch.profiler key_averages, by self device time; on CPU by self CPU time)\n\n```\n"
            + profiler_table(prof)
            + "\n```\n"
        )
        (out / f"step_{step}.md").write_text(md)
    return result


def export_trace(prof, path: Path, max_bytes: int) -> str:
    """gzip'd chrome trace of the profiled step, dropped when over max_bytes."""
    tmp = path.with_suffix("")  # .json
    prof.export_chrome_trace(str(tmp))
    with open(tmp, "rb") as f, gzip.open(path, "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)
    tmp.unlink()
    size = path.stat().st_size
    if size > max_bytes:
        path.unlink()
        return f"trace {size / 2**20:.1f} MiB gzip'd > {max_bytes / 2**20:.0f} MiB: not kept"
    return f"trace kept: {path.name} ({size / 2**20:.1f} MiB)"
