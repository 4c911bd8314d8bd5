"""megablu ops: fused CUDA kernels (csrc/, built by builder.py) with pure-torch references.

    from megablu.ops import set_impl, apply_rotary, add_rms_norm, rms_norm, swiglu
    set_impl(cfg.memory.ops)          # "auto" | "torch" | "cuda", once per process

Each op also takes `impl=` per call; `use_impl(...)` forces one in a block (tests).
"""
from .dispatch import get_impl, set_impl, use_impl
from .rmsnorm import add_rms_norm, rms_norm
from .rope import apply_rotary
from .swiglu import swiglu, swiglu_packed

__all__ = ["get_impl", "set_impl", "use_impl", "apply_rotary", "add_rms_norm", "rms_norm", "swiglu",
           "swiglu_packed"]
