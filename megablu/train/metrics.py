"""Per-step metrics: runs/<id>/metrics.csv (appended, resume-safe), TensorBoard events and the
optional experiment tracker (train.tracker, train/tracker.py)."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Optional

from .tracker import Tracker

log = logging.getLogger(__name__)

# mfu: model flops (plan.flops_per_token: 6N + causal attention) per GPU per second over the GPU's dense
# bf16 peak (utils/device.PEAK_BF16_TFLOPS); empty on CPU or a GPU not in that table
COLUMNS = ["step", "loss", "lr", "tokens_seen", "step_time_s", "tokens_per_s", "max_mem_gb", "grad_norm", "mfu"]


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int = 0, tracker: Optional[Tracker] = None):
        self.path = Path(run_dir) / "metrics.csv"
        rows = []
        if self.path.exists():
            # on resume keep only rows before the resumed step, so the CSV has one row per step
            with open(self.path) as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1)
        except Exception as e:  # tensorboard is optional; the CSV is the record
            log.warning("TensorBoard disabled: %s", e)
        self.tracker = tracker

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow({k: row.get(k, "") for k in COLUMNS})
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])
        if self.tracker is not None:
            self.tracker.log(row, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.close()


def read_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.csv"
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def run_summary(run_dir: Path, session: dict, gate: Optional[str] = None, stopped: Optional[str] = None) -> dict:
    """summary.json of the whole run, written atomically and returned.

    From metrics.csv (one row per step over every session), not from the last session's
    memory; `sessions` lists each invocation ({from_step, to_step, world}), carried over from
    the previous summary.json. mean_tokens_per_s leaves out the first step of every session
    (it pays warm-up and compilation)."""
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    try:
        prev = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        prev = {}
    sessions = [
        s for s in prev.get("sessions", []) if isinstance(s, dict) and s.get("to_step", 0) <= session["from_step"]
    ] + [session]
    rows = read_rows(run_dir)
    firsts = {int(s["from_step"]) + 1 for s in sessions}
    tps = [float(r["tokens_per_s"]) for r in rows if int(r["step"]) not in firsts] or [
        float(r["tokens_per_s"]) for r in rows
    ]
    last = rows[-1] if rows else {}
    summary = {
        "run_dir": str(run_dir),
        "steps": int(last.get("step", session["to_step"])),
        "tokens_seen": int(last.get("tokens_seen", 0)),
        "first_loss": float(rows[0]["loss"]) if rows else None,
        "last_loss": float(last["loss"]) if rows else None,
        "mean_tokens_per_s": sum(tps) / len(tps) if tps else 0.0,
        "world": session.get("world"),
        "sessions": sessions,
    }
    if stopped:  # this session ended on its time budget (train.stop_after_s)
        summary["stopped"] = stopped
    if gate:
        summary["gate"] = gate
    tmp = path.with_name(".summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)
    return summary
