"""Learning-rate schedules as pure functions of the optimizer step.

The LR at step s depends on s and the config only, so a resumed run continues the same
curve: there is one warmup, anchored at step 0, never re-anchored on resume (a sawtooth of
re-anchored warmups cannot happen).
"""

from __future__ import annotations

import math

from ..config.schema import ScheduleConfig


def lr_at(step: int, sched: ScheduleConfig, max_steps: int) -> float:
    """LR for 0-based optimizer step `step`."""
    lr, lo, wu = sched.lr, sched.min_lr, sched.warmup_steps
    if step < wu:
        return lr * (step + 1) / wu
    if sched.kind == "wsd":
        start = sched.decay_start
        assert start is not None, "schedule.decay_start is required for kind=wsd (the schema checks it)"
        if step < start:
            return lr
        # decay over [start, max_steps - 1], reaching min_lr at the last step
        frac = (step - start + 1) / (max_steps - start)
    else:
        frac = (step - wu + 1) / max(1, max_steps - wu)
    frac = min(max(frac, 0.0), 1.0)
    if sched.decay_shape == "linear" and sched.kind == "wsd":
        return lo + (lr - lo) * (1 - frac)
    return lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * frac))
