"""Numbers the activation offload (offload.py) and the planner (megablu/plan/) share. No torch
here: the planner imports this without loading torch."""

MIN_BYTES = 1 << 20          # storages below this stay on the device
MAX_INFLIGHT = 2             # blocks whose device-to-host copies may still be running
KEEP_LAST = 1                # final blocks left on the device: the backward needs them first
