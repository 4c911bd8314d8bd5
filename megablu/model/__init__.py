from .decoder import BluModel, KVCache, LocalAttention, RMSNorm
from .rope import RotaryEmbedding, apply_rotary, yarn_inv_freq

__all__ = ["BluModel", "KVCache", "LocalAttention", "RMSNorm", "RotaryEmbedding", "apply_rotary", "yarn_inv_freq"]
