"""Fused RoPE on q and k (one kernel launch for both), with its pure-torch reference.

Math (HF Llama `apply_rotary_pos_emb`): x' = x*cos + rotate_half(x)*sin with
rotate_half(x) = cat(-x2, x1); cos/sin (B, T, D) come from model.rope.RotaryEmbedding and
already carry the YaRN attention factor. The backward is the transposed rotation
(x = g*cos - rotate_half(g*sin) for a table whose halves are equal), done by the same
kernel, so nothing but the shared cos/sin table is saved for backward.

Call: `q, k = apply_rotary(q, k, cos, sin)`, q (B, T, H, D), k (B, T, Hkv, D); q/k may be
strided views (e.g. slices of a fused qkv projection) as long as D is contiguous. Outputs
are new contiguous tensors of q's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import KERNEL_DTYPES, ext, resolve


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Pure torch, the model's own expression: cos/sin (B, T, D) broadcast over heads."""
    cos, sin = _table(cos).unsqueeze(2), _table(sin).unsqueeze(2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_backward_reference(gq, gk, cos, sin):
    """The closed form the CUDA backward implements (transposed rotation), in torch.

    With halves g1|g2, c1|c2, s1|s2:  d1 = g1*c1 + g2*s2,  d2 = g2*c2 - g1*s1.
    Tested against autograd of rope_reference on CPU; documents the kernel's math.
    """

    def one(g):
        acc = torch.promote_types(g.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        c, s = _table(cos).unsqueeze(2).to(acc), _table(sin).unsqueeze(2).to(acc)
        h = g.shape[-1] // 2
        g1, g2 = g.to(acc)[..., :h], g.to(acc)[..., h:]
        d1 = g1 * c[..., :h] + g2 * s[..., h:]
        d2 = g2 * c[..., h:] - g1 * s[..., :h]
        return torch.cat((d1, d2), dim=-1).to(g.dtype)

    return one(gq), one(gk)


def _table(t: torch.Tensor) -> torch.Tensor:
    """cos/sin as (B|1, T, D): accepts (T, D), (B, T, D) and (B, T, 1, D)."""
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 4 and t.shape[2] == 1:
        return t.squeeze(2)
    if t.dim() != 3:
        raise ValueError(f"rope: cos/sin must be (T, D), (B, T, D) or (B, T, 1, D), got {tuple(t.shape)}")
    return t


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        oq, ok = ext().rope_apply(q, k, cos, sin, False)
        ctx.save_for_backward(cos, sin)
        ctx.heads = (q.shape[2], k.shape[2])
        ctx.set_materialize_grads(False)
        return oq, ok

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        if gq is None and gk is None:
            return None, None, None, None
        # a missing grad (q or k output unused) is zero; the kernel always does both
        ref = gq if gq is not None else gk
        if gq is None:
            gq = ref.new_zeros(ref.shape[:2] + (ctx.heads[0], ref.shape[3]))
        if gk is None:
            gk = ref.new_zeros(ref.shape[:2] + (ctx.heads[1], ref.shape[3]))
        gq = gq if gq.stride(-1) == 1 else gq.contiguous()
        gk = gk if gk.stride(-1) == 1 else gk.contiguous()
        dq, dk = ext().rope_apply(gq, gk, cos, sin, True)
        return dq, dk, None, None


def _unsupported(q, k, cos, sin) -> Optional[str]:
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        return f"dtypes q={q.dtype} k={k.dtype}"
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, torch.float32):
        return f"table dtype {cos.dtype} with q {q.dtype}"
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad"
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return f"q {tuple(q.shape)} / k {tuple(k.shape)} layout"
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return "cos/sin last dim not contiguous"
    return None


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, D), k (B, T, Hkv, D), cos/sin (B|1, T, D) -> rotated (q, k)."""
    cos3, sin3 = _table(cos), _table(sin)
    if resolve("rope", (q, k, cos3, sin3), _unsupported(q, k, cos3, sin3), impl) == "torch":
        return rope_reference(q, k, cos3, sin3)
    return _RopeFn.apply(q, k, cos3, sin3)
