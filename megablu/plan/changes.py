"""What to change when a setup does not fit: the cost of each switch and the cheapest fit."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Optional

from .memory import COMFORTABLE, PEAK_TFLOPS_H200, Calibration, Setup, estimate, flops_per_token

_COSTS = {  # rough relative step time, from experiments/speed/LOG.md where measured (32k)
    "recompute=selective": 1.04,  # 1.074 / 1.030 s
    "recompute=full": 1.26,  # 1.294 / 1.030 s
    "loss_chunk=4096": 1.0,
    "zero_stage=2": 1.02,  # estimate
    "zero_stage=3": 1.15,  # estimate
    "offload_optimizer": None,  # a fixed time per step: _cost()
    "offload_params": None,  # a fixed time per step: _cost()
    # tiles add no forward to selective (the tiles ARE its MLP recompute), only smaller GEMMs
    "mlp_tiles=8": 1.02,  # estimate
    # H200, blu-0.5b, selective: 0.959 / 0.939 s at 32k (the last block kept), 11.48 / 11.41 s
    # at 128k: the copies hide behind the layers' compute (experiments/speed/LOG.md)
    "offload_activations": 1.02,
}


# ZeRO-Offload adds a fixed time per step, so its relative cost falls as the window grows.
# Fit to single steps on one GPU against ZeRO-1 (the rows of experiments/zero_offload/README.md;
# tests/plan/test_plan.py checks the model against those rows):
#   optimizer offload, ZeRO-1/2: CPU Adam + PCIe for the rank's partition, 0.58-0.62 s per
#     billion parameters (blu-0.5b at 16k, blu-1.5b at 32k)
#   optimizer offload, ZeRO-3: 0.7-1.65 s for both shapes, i.e. not per parameter but per
#     layer (ZeRO-3's hooks fetch and release each module): 25-57 ms per layer
#   parameter offload, optimizer on the GPU: 3.3-3.5 s per billion parameters (16k)
#   parameter offload on top of optimizer offload: within the single steps' noise of
#     optimizer offload alone (-0.6 to +1.1 s): nothing added
_OFFLOAD_S_PER_BPARAM = {"offload_optimizer": 0.6, "offload_params": 3.4}
_ZERO3_OFFLOAD_S_PER_LAYER = 0.035
ASSUMED_MFU = 0.36  # megablu, selective recompute, H200, 32k and 128k (experiments/speed/LOG.md)


def step_seconds(s: Setup) -> float:
    """The step's compute time per rank at ASSUMED_MFU of an H200 (for ranking changes only)."""
    return flops_per_token(s.model, s.window) * s.tokens_per_rank / (ASSUMED_MFU * PEAK_TFLOPS_H200 * 1e12)


def change_cost(change: str, after: Setup) -> float:
    """Relative step time of one change, `after` being the setup with it applied."""
    cost = _COSTS[change]
    if cost is not None:
        return cost
    if change == "offload_optimizer" and after.zero_stage == 3:
        added = _ZERO3_OFFLOAD_S_PER_LAYER * after.model.n_layers
    elif change == "offload_params" and after.offload_optimizer:
        added = 0.0
    else:
        added = _OFFLOAD_S_PER_BPARAM[change] * after.model.n_params() / after.shards / 1e9
    return 1.0 + added / step_seconds(after)


def verdict(frac: float) -> str:
    if frac <= COMFORTABLE:
        return "comfortable"
    if frac <= 1.0:
        return "tight-probe-first"
    return "impossible"


def apply_change(s: Setup, change: str) -> Optional[Setup]:
    if change.startswith("recompute="):
        order = ["none", "selective", "full"]
        new = change.split("=")[1]
        return replace(s, recompute=new) if order.index(new) > order.index(s.recompute) else None
    if change == "loss_chunk=4096":
        return replace(s, loss_chunk=4096) if s.loss_chunk <= 0 and s.loss == "chunked" else None
    if change.startswith("zero_stage="):
        z = int(change.split("=")[1])
        return replace(s, zero_stage=z) if z > s.zero_stage else None
    if change == "offload_optimizer":
        return replace(s, offload_optimizer=True, zero_stage=max(1, s.zero_stage)) if not s.offload_optimizer else None
    if change == "offload_params":
        return replace(s, offload_params=True, zero_stage=3) if not s.offload_params else None
    if change == "mlp_tiles=8":
        return replace(s, mlp_tiles=8) if s.mlp_tiles < 8 and s.tokens_per_rank >= 8 else None
    if change == "offload_activations":
        # config invariant: not with recompute=none and an untiled MLP
        ok = not s.offload_activations and (s.recompute != "none" or s.mlp_tiles > 1)
        return replace(s, offload_activations=True) if ok else None
    raise ValueError(change)


def suggest(
    s: Setup, gpu_gb: float, calib: Optional[Calibration] = None, max_gpus: int = 64, host_gb: Optional[float] = None
) -> Optional[str]:
    """The cheapest change (product of relative step costs) that makes `s` comfortable,
    or failing that, fit; more GPUs (sp x2, x4 ...) only when no switch on these GPUs does.
    host_gb: pinned host memory per GPU that offloaded activations may take (None: no limit);
    a change that offloads activations says how much it needs."""
    changes = list(_COSTS)
    best: dict[str, tuple] = {}
    gpu_options = [s.gpus * 2**k for k in range(0, 7) if s.gpus * 2**k <= max_gpus]
    for gi, g in enumerate(gpu_options):
        base = replace(s, gpus=g, sp=min(g, s.sp * g // s.gpus))
        for r in range(0, 4):
            for combo in itertools.combinations(changes, r):
                cur, ok, cost = base, True, 1.0
                for c in combo:
                    nxt = apply_change(cur, c)
                    if nxt is None:
                        ok = False
                        break
                    cur = nxt
                    cost *= change_cost(c, cur)
                if not ok or (gi == 0 and not combo):
                    continue
                e = estimate(cur, calib)
                if host_gb is not None and e.host_gb > host_gb:
                    continue
                frac = e.gpu_gb / gpu_gb
                desc = ", ".join(
                    [f"{g} GPUs (sp={cur.sp})"] * (gi > 0)
                    + [
                        f"parallel.{c}"
                        if c in ("offload_optimizer", "offload_params") or c.startswith("zero")
                        else f"memory.{c}"
                        for c in combo
                    ]
                )
                if e.host:
                    desc += f" [{e.host_gb:.0f} GB pinned host per GPU]"
                for kind, lim in (("comfortable", COMFORTABLE), ("fits", 1.0)):
                    if frac <= lim and (kind not in best or (gi, cost) < best[kind][:2]):
                        best[kind] = (gi, cost, desc, frac)
        if "comfortable" in best:
            break
    pick = best.get("comfortable") or best.get("fits")
    if pick is None:
        return None
    text = f"{pick[2]} -> {pick[3]:.0%} ({'comfortable' if pick[3] <= COMFORTABLE else 'tight'})"
    tight = best.get("fits")
    if tight is not None and tight[0] < pick[0]:
        text += f"; on {gpu_options[tight[0]]} GPUs: {tight[2]} -> {tight[3]:.0%} (tight, probe first)"
    return text
