"""Per-step metrics: runs/<id>/metrics.csv (appended, resume-safe) and TensorBoard events."""
from __future__ import annotations

import csv
import logging
from pathlib import Path

log = logging.getLogger(__name__)

COLUMNS = ["step", "loss", "lr", "tokens_seen", "step_time_s", "tokens_per_s", "max_mem_gb", "grad_norm"]


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int = 0):
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

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow({k: row.get(k, "") for k in COLUMNS})
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
