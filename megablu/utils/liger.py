"""Liger's chunk sizing, written out without torch: the loss (ops/cross_entropy.py) passes Liger the
chunk_mem_const for memory.loss_chunk, and the planner (plan/memory.py) counts the same chunk's logits."""

import functools


def liger_chunk_tokens(tokens: int, d: int, vocab: int, mem_const: int = 1) -> int:
    """Liger's tokens per chunk of its fused linear cross-entropy for `chunk_mem_const` (liger-kernel
    0.8.5, ops/fused_linear_cross_entropy.py): next_pow2(ceil(T / ceil(V / (c * d)))), at most T."""
    inc = -(-vocab // (mem_const * d))
    return min(tokens, 1 << max(0, (-(-tokens // inc) - 1).bit_length()))


@functools.lru_cache(maxsize=256)
def liger_mem_const(tokens: int, d: int, vocab: int, chunk: int) -> int:
    """The chunk_mem_const for which Liger's chunk is the largest it can make of at most `chunk` tokens
    (memory.loss_chunk): fewer chunks, so fewer read-modify-writes of the fp32 (V, d) weight-gradient
    sum, for more bf16 logits alive. 1 (Liger's own sizing, ~T*d/V tokens) where `chunk` <= 0 or where
    even that chunk is larger than `chunk`. Liger's chunk only grows with the constant."""
    best = 1
    if chunk <= 0:
        return best
    for c in range(2, -(-vocab // d) + 1):  # from ceil(V/d) on, one chunk holds all the tokens
        if liger_chunk_tokens(tokens, d, vocab, c) > chunk:
            break
        best = c
    return best
