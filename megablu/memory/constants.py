"""Numbers the activation offload (offload.py) and the planner (megablu/plan/) share. No torch
here: the planner imports this without loading torch."""

MIN_BYTES = 1 << 20  # storages below this stay on the device
MAX_INFLIGHT = 2  # blocks whose device-to-host copies may still be running
KEEP_LAST = 1  # final blocks left on the device: the backward needs them first


def offloaded(i: int, n: int, keep_last: int = KEEP_LAST, fraction: float = 1.0) -> bool:
    """Whether block i of n offloads its saved activations: not the last `keep_last`; of the others a
    `fraction` spread evenly (0.75: three of every four, the first block of each four kept), so that
    each copy has kept blocks' compute to run under. floor(fraction * (n - keep_last)) blocks in all."""
    m = n - keep_last
    if i >= m:
        return False
    return int((i + 1) * fraction + 1e-9) > int(i * fraction + 1e-9)


def offloaded_count(n: int, keep_last: int = KEEP_LAST, fraction: float = 1.0) -> int:
    """How many blocks `offloaded` picks: floor(fraction * (n - keep_last)) (its steps telescope; the
    config's check, config/schema/checks.py, uses this closed form)."""
    return int(max(0, n - keep_last) * fraction + 1e-9)
