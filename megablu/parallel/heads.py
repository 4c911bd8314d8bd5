"""How Ulysses splits attention heads over sp ranks (one rule for ulysses.py and the planner).

No torch here: the planner reads it without loading torch.
"""

from __future__ import annotations

import math


def head_plan(n_heads: int, n_kv_heads: int, sp: int) -> tuple[int, int]:
    """(kv replication factor, padded head count) that makes the head split even across sp."""
    if n_heads % sp == 0:
        for r in range(1, n_heads // n_kv_heads + 1):
            kv = n_kv_heads * r
            if kv % sp == 0 and n_heads % kv == 0:
                return r, n_heads
    # uneven query heads: full MHA, zero-padded to a multiple of sp
    return n_heads // n_kv_heads, math.ceil(n_heads / sp) * sp
