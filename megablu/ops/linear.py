"""Several linear projections of one input as one GEMM (q/k/v, gate/up), with its reference.

    y = packed_linear(x, (w_q, w_k, w_v), (b_q, b_k, b_v))   # (..., Nq + Nk + Nv) = [x W_q^T | x W_k^T | x W_v^T]
    q, k, v = y.split((Nq, Nk, Nv), dim=-1)

The weights stay separate parameters (their names, shapes and checkpoints unchanged); they are
concatenated at call time, (N, d) with N = sum N_i: for blu-0.5b's q/k/v 1536 x 1024 and gate/up
5632 x 1024, 3 and 11.5 MB in bf16, against 64 MB for one (T, d) activation at T = 32k. What one GEMM saves
against three (or two): x is read once in the forward and once in the weight-gradient GEMM, the small k/v
GEMMs (N = 256) no longer run on their own, and dx comes out of one GEMM instead of autograd summing the
separate linears' input gradients (an activation-size add per extra consumer, forward of the input norm's
output; experiments/speed/LOG.md attributes them). The price: the (…, N) output gradient must be one tensor,
so splitting the output costs a (T, N) concatenation of the pieces' gradients in the backward (torch.split's
backward), unless the consumer takes the packed tensor whole (ops.swiglu_packed returns the packed gradient).

Why an autograd Function and not `F.linear(x, torch.cat(ws))` under autograd: that saves the concatenated
weight for the backward, a tensor no parameter owns, so the activation offload would copy it to host every
step (memory/offload.py moves what is not a parameter's storage) and ZeRO-3 would keep each layer's gathered
copy alive until its backward. Here the parameters themselves are saved, and the concatenation is redone in the
backward (a few MB).

ZeRO-3 gathers a parameter around its own module's call; a fused projection reads the weights of q_proj/k_proj/
v_proj without calling them, so megablu/memory/apply.py registers them as external parameters of the module
that reads them (deepspeed.zero.register_external_parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F


def packed_linear_reference(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Optional[Sequence[Optional[torch.Tensor]]] = None
) -> torch.Tensor:
    """The separate linears, their outputs concatenated on the last dim."""
    bs = biases if biases is not None else [None] * len(weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, bs, strict=True)], dim=-1)


class _PackedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, *tensors):
        # tensors: n weights (N_i, d), then n biases (N_i,) or none
        weights, biases = tensors[:n], tensors[n:]
        w = torch.cat(weights, dim=0)
        b = torch.cat(biases, dim=0) if biases else None
        ctx.n, ctx.has_bias = n, bool(biases)
        ctx.sizes = [t.shape[0] for t in weights]
        ctx.save_for_backward(x, *weights)  # parameters: saved by reference, never copied
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        n, need = ctx.n, ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])  # (rows, N)
        dx = None
        if need[0]:
            # one GEMM against the concatenated weight: (rows, N) @ (N, d)
            dx = (dy2 @ torch.cat(weights, dim=0)).view(x.shape)
        dws = [None] * n
        if any(need[2 : 2 + n]):
            # one weight-gradient GEMM, split by rows: (N, rows) @ (rows, d)
            dw = dy2.t() @ x.reshape(-1, x.shape[-1])
            dws = [g if need[2 + i] else None for i, g in enumerate(dw.split(ctx.sizes, dim=0))]
        dbs = []
        if ctx.has_bias:
            db = dy2.sum(0)
            dbs = [g if need[2 + n + i] else None for i, g in enumerate(db.split(ctx.sizes, dim=0))]
        return (dx, None, *dws, *dbs)


def packed_linear(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Optional[Sequence[Optional[torch.Tensor]]] = None
) -> torch.Tensor:
    """x (..., d) through each weight (N_i, d) (+ bias (N_i,)) as one GEMM -> (..., sum N_i).

    biases: one per weight, all tensors or all None (None: no bias)."""
    bs = list(biases) if biases is not None else []
    if any(b is None for b in bs):
        if not all(b is None for b in bs):
            raise ValueError("packed_linear: biases must be all tensors or all None")
        bs = []
    if bs and len(bs) != len(weights):
        raise ValueError(f"packed_linear: {len(weights)} weights but {len(bs)} biases")
    d = x.shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != d:
            hint = (
                " (a ZeRO-3 partition not gathered: the module that reads it must register it as an external "
                "parameter, as megablu.memory.apply_memory does)"
                if w.numel() == 0
                else ""
            )
            raise ValueError(f"packed_linear: weight {tuple(w.shape)} for an input of last dim {d}{hint}")
    return _PackedLinearFn.apply(x, len(weights), *weights, *bs)
