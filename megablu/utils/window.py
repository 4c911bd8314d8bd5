"""Sliding-window blocking, written out without torch: the attention (ops/window_attention.py) splits the
queries into blocks of `block_rows(window)` rows, and the planner (plan/memory.py) counts what those
blocks keep for backward."""

import math

TILE = 128  # a block is a multiple of this (ops/window_attention.py says why)


def block_rows(window: int) -> int:
    """Query rows per block: the window rounded up to a multiple of TILE."""
    return TILE * max(1, math.ceil(window / TILE))


def earlier_chunks(window: int, block: int) -> int:
    """Key chunks of `block` positions before a block's own that its first row reaches: ceil((window - 1) / block)."""
    return math.ceil((window - 1) / block)
