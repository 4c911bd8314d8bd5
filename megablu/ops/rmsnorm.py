"""Fused residual add + RMSNorm (fp32 statistics, bf16/fp16/fp32 I/O), with its reference.

Math (HF LlamaRMSNorm, the block's residual add folded in):
    r = x + residual                                  (in x's dtype: the new residual stream)
    y = weight * (r.float() * rsqrt(mean(r.float()^2) + eps)).to(r.dtype)
Backward (fp32, xhat = r * rstd, gw = weight * grad_y):
    dr = rstd * (gw - xhat * mean(gw * xhat)) + grad_r       (= d x = d residual)
    dw = sum over rows of grad_y * xhat
Saved for backward: r (the residual stream, which the model keeps anyway), the weight and
rstd (4 bytes per row), so the norm adds almost nothing to activation memory.

Calls:
    y    = rms_norm(x, weight, eps)                   # plain norm
    y, r = add_rms_norm(x, residual, weight, eps)     # r = x + residual, y = norm(r)
x/residual (..., d); weight (d,) of x's dtype for the kernel (else the torch path runs).
"""

from __future__ import annotations

from typing import Optional

import torch

from .dispatch import KERNEL_DTYPES, ext, resolve

# kernel limits (csrc/rmsnorm/rmsnorm.cpp): d a multiple of 16 bytes, at most 32*8 vectors
_MAX_VECS = 256


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): the model's RMSNorm (decoder.RMSNorm) of r = x + residual (r = x without one)."""
    r = x if residual is None else x + residual
    r32 = r.float()
    y = weight * (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype)
    return y, r


def rms_norm_backward_reference(
    grad_y: torch.Tensor, grad_r: Optional[torch.Tensor], r: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed form the CUDA backward implements, in fp32 torch: (dr, dw).

    Tested against autograd of rms_norm_reference on CPU; documents the kernel's math.
    """
    acc = torch.promote_types(r.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    r32, gy = r.to(acc), grad_y.to(acc)
    rstd = torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = r32 * rstd
    gw = gy * weight.to(acc)
    dr = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    if grad_r is not None:
        dr = dr + grad_r.to(acc)
    dw = (gy * xhat.to(r.dtype).to(acc)).reshape(-1, r.shape[-1]).sum(0)
    return dr.to(r.dtype), dw.to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.contiguous() if not t.is_contiguous() else t.clone()
    return t


class _AddRmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        shape = x.shape
        x2 = _rows(x)
        res2 = _rows(residual) if residual is not None else None
        # a parameter can be a view into a flat (ZeRO) buffer at any offset: the kernel's
        # 16-byte loads need an aligned copy then (dw is still this weight's gradient)
        w = weight if weight.data_ptr() % 16 == 0 else weight.clone()
        y, r, rstd = ext().rmsnorm_fwd(x2, res2, w, eps)
        ctx.save_for_backward(r, w, rstd)
        ctx.has_res = residual is not None
        ctx.set_materialize_grads(False)
        if ctx.has_res:
            return y.view(shape), r.view(shape)
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad_y, grad_r=None):
        r, weight, rstd = ctx.saved_tensors
        if grad_y is None and grad_r is None:
            return None, None, None, None
        gy = _rows(grad_y) if grad_y is not None else torch.zeros_like(r)
        gr = _rows(grad_r) if grad_r is not None else None
        dr, dw = ext().rmsnorm_bwd(gy, gr, r, weight, rstd)
        shape = grad_y.shape if grad_y is not None else grad_r.shape
        dr = dr.view(shape)
        return dr, (dr if ctx.has_res else None), (dw if ctx.needs_input_grad[2] else None), None


def _unsupported(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor) -> Optional[str]:
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype}"
    if weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} != x dtype {x.dtype}"
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return f"residual {residual.dtype} {tuple(residual.shape)} vs x {x.dtype} {tuple(x.shape)}"
    d = x.shape[-1]
    vec = 16 // x.element_size()
    if weight.shape != (d,):
        return f"weight shape {tuple(weight.shape)} for d={d}"
    if d % vec or d // vec > _MAX_VECS:
        return f"d={d} (needs a multiple of {vec}, at most {_MAX_VECS * vec})"
    return None


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, impl: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r) with r = x + residual (x when residual is None) and y = RMSNorm(r) * weight."""
    if (
        resolve(
            "rmsnorm",
            (x, weight) if residual is None else (x, residual, weight),
            _unsupported(x, residual, weight),
            impl,
        )
        == "torch"
    ):
        return rms_norm_reference(x, weight, eps, residual)
    if residual is None:
        return _AddRmsNormFn.apply(x, None, weight, eps), x
    return _AddRmsNormFn.apply(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Optional[str] = None) -> torch.Tensor:
    """RMSNorm(x) * weight (HF order: normalise in fp32, cast, then scale)."""
    return add_rms_norm(x, None, weight, eps, impl)[0]
