"""Sequence-tiled compute of a row-wise function (the SwiGLU MLP): one tile alive at a time.

A row-wise f (each output row depends on its own input row only: RMSNorm, the SwiGLU MLP)
can run over the (B*T, d) rows in tiles. Untiled, the MLP's (T, ffn) intermediates
(gate, up, silu(gate) or the fused product, and their grads) are the largest tensors of a
layer: at T=1M and ffn=2816 each is 5.9 GB in bf16. `tiled(f, x, n, params)` keeps one
(T/n, ffn) tile alive at a time in the forward AND the backward:

    forward:  out[tile] = f(x[tile]) for each tile, without autograd; saves x only
    backward: for each tile: recompute f(x[tile]) with autograd, then
              (dx[tile], dW_tile...) = grad of it against grad_out[tile]; dW += dW_tile

so f's forward runs twice per step (as in selective recompute). This is the scheme of
DeepSpeed ALST's `TiledMLP` (Bekman et al. 2025, arXiv:2506.13996;
deepspeed/runtime/sequence_parallel/ulysses_sp.py), written differently: the weights are
inputs of the autograd Function and their gradients are its return values (summed over
tiles in fp32 for bf16/fp16 weights, rounded once), so autograd accumulates each weight
exactly once per call. DeepSpeed's version accumulates into .grad inside its backward
once per tile and needs `param.ds_grad_is_ready` to stop ZeRO 2/3 reducing a partial sum;
returning the gradients keeps ZeRO's hooks seeing one gradient, and keeps
`torch.autograd.grad` correct. Under ZeRO-3 (partitioned weights) the DeepSpeed scheme is
used instead (`_backward_zero3`).

Which ops f runs (the fused CUDA SwiGLU or the torch reference) is f's business: the
MLP's own forward is tiled (apply.py), so the `memory.ops` dispatch applies inside every tile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def tile_bounds(rows: int, tiles: int) -> list[tuple[int, int]]:
    """[start, end) of `tiles` near-equal row tiles (fewer when rows < tiles; none when rows == 0)."""
    size = -(-rows // max(1, tiles)) if rows else 1
    return [(s, min(s + size, rows)) for s in range(0, rows, size)]


def _run_tiles(fn: Callable, rows: torch.Tensor, tiles: int) -> torch.Tensor:
    """fn over row tiles into one preallocated (N, out) tensor (no list + cat: that is 2x)."""
    out = None
    for s, e in tile_bounds(rows.shape[0], tiles):
        y = fn(rows[s:e])
        if out is None:
            out = y.new_empty((rows.shape[0],) + tuple(y.shape[1:]))
        out[s:e] = y
    if out is None:  # zero rows: f of an empty tile gives the output's shape and dtype
        out = fn(rows)
    return out


class _TiledFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tiles, zero3, x, *params):
        # params: leaves, held by their module anyway. Under ZeRO-3 they are not inputs of
        # this Function (zero3 = the tuple of them): see _backward_zero3
        ctx.fn, ctx.tiles = fn, tiles
        ctx.params, ctx.zero3 = (zero3, True) if zero3 else (params, False)
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])  # (B, T, d) -> (B*T, d)
        out = _run_tiles(fn, rows, tiles)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[3]
        rows = x.detach().reshape(-1, x.shape[-1])
        g_rows = grad_out.reshape(-1, grad_out.shape[-1])
        dx = torch.empty_like(rows) if want_x else None
        bounds = tile_bounds(rows.shape[0], ctx.tiles)
        if ctx.zero3:
            return _backward_zero3(ctx, rows, g_rows, dx, bounds, x.shape)
        want = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[4 + i]]
        # fp32 accumulators for low-precision weights: n tile partial sums, rounded once
        acc = {
            i: torch.zeros_like(ctx.params[i], dtype=torch.promote_types(ctx.params[i].dtype, torch.float32))
            for i in want
        }
        for s, e in bounds:
            xt = rows[s:e].detach().requires_grad_(want_x)
            with torch.enable_grad():
                yt = ctx.fn(xt)  # this tile's (rows, ffn) intermediates live here
            inputs = ([xt] if want_x else []) + [ctx.params[i] for i in want]
            grads = torch.autograd.grad(yt, inputs, g_rows[s:e], allow_unused=True)
            del yt  # the tile's intermediates go before the next tile
            if want_x:
                dx[s:e] = grads[0]
                grads = grads[1:]
            for i, g in zip(want, grads, strict=True):
                if g is not None:
                    acc[i] += g
        dparams = [None] * len(ctx.params)
        for i in want:
            dparams[i] = acc[i].to(ctx.params[i].dtype)
        return (None, None, None, dx.view(x.shape) if want_x else None, *dparams)


def _backward_zero3(ctx, rows, g_rows, dx, bounds, shape):
    """ZeRO-3 (parameters carry `ds_id`, deepspeed.runtime.zero.utils.is_zero_param): a
    partitioned weight has shape [0] between its module's calls, so it can be neither an
    input of this Function nor of autograd.grad (its gradient has the full shape). As
    DeepSpeed's TiledMLP does: each tile's backward gathers the weights (ZeRO-3's module
    hooks) and accumulates into .grad, with `ds_grad_is_ready` False until the last tile so
    ZeRO reduces the full sum once."""
    params = [p for p in ctx.params if p.requires_grad]
    try:
        for n, (s, e) in enumerate(bounds):
            for p in params:
                p.ds_grad_is_ready = n == len(bounds) - 1
            xt = rows[s:e].detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                yt = ctx.fn(xt)
            torch.autograd.backward(yt, g_rows[s:e])
            if dx is not None:
                dx[s:e] = xt.grad
    finally:
        for p in params:
            p.ds_grad_is_ready = True
    return None, None, None, (dx.view(shape) if dx is not None else None)


def tiled(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int, params: Iterable[torch.Tensor]
) -> torch.Tensor:
    """fn(x) computed over `tiles` row tiles of x (..., d); fn must be row-wise.

    `params` are the tensors fn reads that need gradients (its module's parameters): their
    gradients are computed tile by tile and returned to autograd once. Without autograd
    (no_grad, inference, inside a reentrant checkpoint's forward) the tiles just run.
    """
    params = tuple(params)
    if tiles <= 1:
        return fn(x)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        rows = x.reshape(-1, x.shape[-1])
        out = _run_tiles(fn, rows, tiles)
        return out.view(*x.shape[:-1], out.shape[-1])
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 (deepspeed.runtime.zero.utils.is_zero_param)
        if not x.requires_grad:
            # the Function's only input is x: it would not be recorded and the weights would get no gradient
            raise ValueError("tiled: under ZeRO-3 the tiled input must require grad (it is the Function's only input)")
        return _TiledFn.apply(fn, tiles, params, x)
    return _TiledFn.apply(fn, tiles, None, x, *params)
