"""Numbers the activation offload (offload.py), the loss (ops/cross_entropy.py) and the planner
(megablu/plan/) share. No torch here: the planner imports this without loading torch."""

MIN_BYTES = 1 << 20          # storages below this stay on the device
MAX_INFLIGHT = 2             # blocks whose device-to-host copies may still be running
KEEP_LAST = 1                # final blocks left on the device: the backward needs them first


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
    config's check, config/schema.py, uses this closed form)."""
    return int(max(0, n - keep_last) * fraction + 1e-9)


def liger_chunk_tokens(tokens: int, d: int, vocab: int, mem_const: int = 1) -> int:
    """Liger's tokens per chunk of its fused linear cross-entropy for `chunk_mem_const` (liger-kernel
    0.8.5, ops/fused_linear_cross_entropy.py): next_pow2(ceil(T / ceil(V / (c * d)))), at most T."""
    inc = -(-vocab // (mem_const * d))
    return min(tokens, 1 << max(0, (-(-tokens // inc) - 1).bit_length()))


def liger_mem_const(tokens: int, d: int, vocab: int, chunk: int) -> int:
    """The chunk_mem_const for which Liger's chunk is the largest it can make of at most `chunk` tokens
    (memory.loss_chunk): fewer chunks, so fewer read-modify-writes of the fp32 (V, d) weight-gradient
    sum, for more bf16 logits alive. 1 (Liger's own sizing, ~T*d/V tokens) where `chunk` <= 0 or where
    even that chunk is larger than `chunk`. Liger's chunk only grows with the constant."""
    best = 1
    if chunk <= 0:
        return best
    for c in range(2, -(-vocab // d) + 1):    # from ceil(V/d) on, one chunk holds all the tokens
        if liger_chunk_tokens(tokens, d, vocab, c) > chunk:
            break
        best = c
    return best
