"""Fused SwiGLU activation `silu(gate) * up` (forward and backward), with its reference.

One kernel reads gate and up and writes the product; the backward reads grad, gate, up and
writes both input grads. Saved for backward: gate and up only (torch's unfused expression
also keeps silu(gate): a third (T, ffn) tensor per layer).

Calls:
    h = swiglu(gate, up)            # gate, up (..., F)
    h = swiglu_packed(gate_up)      # gate_up (..., 2F) from one fused projection: [gate | up]
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import KERNEL_DTYPES, ext, resolve


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_backward_reference(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """The closed form the CUDA backward implements, in fp32 torch: (d_gate, d_up).

    s = sigmoid(g): d_up = grad * g*s,  d_gate = grad * up * s * (1 + g*(1 - s)).
    """
    acc = torch.promote_types(gate.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    g, u, go = gate.to(acc), up.to(acc), grad.to(acc)
    s = torch.sigmoid(g)
    return (go * u * s * (1 + g * (1 - s))).to(gate.dtype), (go * g * s).to(up.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., C) -> (rows, C) with unit column stride, a view whenever the layout allows."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g2, u2 = _rows(gate), _rows(up)
        out = ext().swiglu_fwd(g2, u2)
        ctx.save_for_backward(g2, u2)
        ctx.shapes = (gate.shape, up.shape)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        g2, u2 = ctx.saved_tensors
        dg, du = ext().swiglu_bwd(_rows(grad), g2, u2, False)
        return dg.view(ctx.shapes[0]), du.view(ctx.shapes[1])


class _SwigluPackedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        f = gate_up.shape[-1] // 2
        gu2 = _rows(gate_up)
        out = ext().swiglu_fwd(gu2[:, :f], gu2[:, f:])
        ctx.save_for_backward(gu2)
        ctx.shape = gate_up.shape
        return out.view(*gate_up.shape[:-1], f)

    @staticmethod
    def backward(ctx, grad):
        (gu2,) = ctx.saved_tensors
        f = gu2.shape[1] // 2
        (dgu,) = ext().swiglu_bwd(_rows(grad), gu2[:, :f], gu2[:, f:], True)
        return dgu.view(ctx.shape)


def _unsupported(gate: torch.Tensor, up: torch.Tensor) -> Optional[str]:
    if gate.dtype not in KERNEL_DTYPES or up.dtype != gate.dtype:
        return f"dtypes gate={gate.dtype} up={up.dtype}"
    if gate.shape != up.shape:
        return f"shapes gate={tuple(gate.shape)} up={tuple(up.shape)}"
    return None


def swiglu(gate: torch.Tensor, up: torch.Tensor, impl: Optional[str] = None) -> torch.Tensor:
    """silu(gate) * up; gate, up (..., F) of one dtype."""
    if resolve("swiglu", (gate, up), _unsupported(gate, up), impl) == "torch":
        return swiglu_reference(gate, up)
    return _SwigluFn.apply(gate, up)


def swiglu_packed(gate_up: torch.Tensor, impl: Optional[str] = None) -> torch.Tensor:
    """silu(gate_up[..., :F]) * gate_up[..., F:] for a fused (..., 2F) gate/up projection."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: last dim must be even (gate | up), got {tuple(gate_up.shape)}")
    # chunk, not two slices: its backward concatenates the two gradients (a slice's backward would
    # zero-fill a full (..., 2F) gradient per half and sum them)
    gate, up = gate_up.chunk(2, dim=-1)
    if resolve("swiglu", (gate_up,), _unsupported(gate, up), impl) == "torch":
        return swiglu_reference(gate, up)
    return _SwigluPackedFn.apply(gate_up)
