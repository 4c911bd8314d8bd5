from .decoder import BluModel, KVCache, LocalAttention, RMSNorm
from .rope import RotaryEmbedding, yarn_inv_freq

__all__ = ["BluModel", "KVCache", "LocalAttention", "RMSNorm", "RotaryEmbedding", "yarn_inv_freq"]
