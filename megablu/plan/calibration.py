"""Calibration of the memory model by probes: activations x act_scale, static + offset."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Union

from .memory import GB, Calibration, Setup, estimate

log = logging.getLogger(__name__)


def load_calibration(path: Union[str, Path]) -> Calibration:
    """A calibration JSON, or a probe.json (calibrated on the spot)."""
    data = json.loads(Path(path).read_text())
    if "act_scale" in data:
        return Calibration(**data)
    return calibrate(data)


def calibrate(probes: Union[dict, Iterable[dict]]) -> Calibration:
    """Fit act_scale and static_offset_gb to measured probes (probe.json dicts).

    Each probe gives the static memory before the first step and the peak. The static
    offset is the mean (measured - predicted) static; the activation scale is the least-
    squares ratio of measured to predicted (peak - static) over all probes.
    """
    probes = [probes] if isinstance(probes, dict) else list(probes)
    offs, num, den, src = [], 0.0, 0.0, []
    for p in probes:
        if p.get("oom") or p.get("peak_gb") is None:
            continue
        if not p.get("setup"):
            raise ValueError("probe json has no 'setup' section; it was not written by megablu's probe")
        s = Setup.from_json(p["setup"])
        e = estimate(s)
        static_pred = e.static
        if p.get("static_gb") is not None:
            offs.append(p["static_gb"] * GB - static_pred)
        dyn_pred = e.allocated - static_pred
        dyn_meas = p["peak_gb"] * GB - (p["static_gb"] * GB if p.get("static_gb") is not None else static_pred)
        num += dyn_pred * dyn_meas
        den += dyn_pred * dyn_pred
        src.append({"window": s.window, "recompute": s.recompute, "peak_gb": p["peak_gb"]})
    if den == 0:
        raise ValueError("calibrate: no probe with a measured peak (all OOM or empty)")
    scale = num / den
    if not 0.5 <= scale <= 2.0:
        log.warning("calibration: activation scale %.2f is far from 1; check the probe's setup", scale)
    off = sum(offs) / len(offs) / GB if offs else 0.0
    return Calibration(act_scale=scale, static_offset_gb=off, source=src)
