"""megablu ops: fused CUDA kernels (csrc/, built by builder.py) with pure-torch references.

from megablu.ops import apply_rotary, add_rms_norm, rms_norm, swiglu
y = packed_linear(x, (w_q, w_k, w_v))     # several projections of x as one GEMM (linear.py)
y = rms_norm(x, weight, eps, impl=impl)   # impl: None/"auto" | "torch" | "cuda" (dispatch.py)
"""

from .linear import packed_linear
from .rmsnorm import add_rms_norm, rms_norm
from .rope import apply_rotary
from .swiglu import swiglu, swiglu_packed

__all__ = ["apply_rotary", "add_rms_norm", "packed_linear", "rms_norm", "swiglu", "swiglu_packed"]
