"""The planner: GPU memory per rank before renting GPUs, and what to change when it does not fit.

  memory.py       the analytical model: Setup (to_json / from_json) -> Estimate, per-layer bytes
  calibration.py  act_scale and a static offset fitted to probe.json files
  changes.py      the cost of each switch, the cheapest change that fits (`suggest`)
  table.py        the fit table per (GPUs, window)
  cli.py          `megablu plan`

Torch-free: `megablu plan` runs without importing torch or deepspeed.
"""

from .calibration import calibrate, load_calibration
from .changes import ASSUMED_MFU, apply_change, change_cost, step_seconds, suggest, verdict
from .memory import (
    ALLOC_SLACK,
    BF16,
    COMFORTABLE,
    CUDA_CONTEXT_GB,
    FP32,
    GB,
    OFFLOAD_KEPT_LAYERS,
    OFFLOAD_RESIDENT_LAYERS,
    PEAK_TFLOPS_H200,
    ZERO3_PREFETCH_BUCKET,
    ZERO_REDUCE_BUCKET,
    Calibration,
    Estimate,
    Setup,
    estimate,
    flops_per_token,
    host_per_token,
    layer_bytes_per_token,
    layer_working_set,
    loss_bytes,
    outside_layers_per_token,
    saved_per_layer,
    saved_per_token,
    window_copies_per_token,
)
from .table import fit_table, format_table, parse_tokens

__all__ = [
    "ALLOC_SLACK",
    "ASSUMED_MFU",
    "BF16",
    "COMFORTABLE",
    "CUDA_CONTEXT_GB",
    "FP32",
    "GB",
    "OFFLOAD_KEPT_LAYERS",
    "OFFLOAD_RESIDENT_LAYERS",
    "PEAK_TFLOPS_H200",
    "ZERO3_PREFETCH_BUCKET",
    "ZERO_REDUCE_BUCKET",
    "Calibration",
    "Estimate",
    "Setup",
    "apply_change",
    "calibrate",
    "change_cost",
    "estimate",
    "fit_table",
    "flops_per_token",
    "format_table",
    "host_per_token",
    "layer_bytes_per_token",
    "layer_working_set",
    "load_calibration",
    "loss_bytes",
    "outside_layers_per_token",
    "parse_tokens",
    "saved_per_layer",
    "saved_per_token",
    "step_seconds",
    "suggest",
    "verdict",
    "window_copies_per_token",
]
