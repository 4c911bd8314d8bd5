"""Chunked linear + cross-entropy that never materialises the fp32 [T, V] logits.

At T=32k and V=100k one fp32 logits tensor is 13 GB, and log_softmax's backward keeps
three of them alive: 94% of HF's memory per token with checkpointing. Here the sequence
is cut into chunks of `chunk` tokens; for each chunk the logits are formed, the loss and
the gradients w.r.t. the hidden states and the head weight are computed at once, and
the logits are dropped (Liger-Kernel's fused linear cross-entropy does the same). The
forward therefore holds grad_hidden (N, d) and grad_weight (V, d, fp32) until backward,
which only scales them by the incoming gradient.

Returns the *sum* of token losses and the count of labelled tokens, so the caller can
normalise by a count reduced across sequence-parallel ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """Plain path: (N, d) x (V, d) -> fp32 logits -> summed CE. Used by tests and chunk=0."""
    logits = (h @ weight.t()).float()
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        for s in range(0, n, chunk):
            hc, yc = h[s:s + chunk], labels[s:s + chunk]
            logits = (hc @ weight.t()).float()                     # (c, V) fp32
            valid = yc != IGNORE_INDEX
            safe_y = torch.where(valid, yc, torch.zeros_like(yc))
            lse = torch.logsumexp(logits, dim=-1)                  # (c,)
            picked = logits.gather(1, safe_y[:, None]).squeeze(1)
            loss += ((lse - picked) * valid).sum()
            if need_grad:
                # d(sum CE)/d logits = softmax - onehot, zero on ignored rows
                g = torch.exp(logits.sub_(lse[:, None]))
                g.scatter_add_(1, safe_y[:, None], torch.full_like(picked[:, None], -1.0))
                g.mul_(valid[:, None])
                g = g.to(h.dtype)
                grad_h[s:s + chunk] = g @ weight
                # fp32 accumulation across chunks (each chunk's GEMM accumulates in fp32 too)
                grad_w.add_((g.t() @ hc).float())
            del logits
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = weight.dtype
        return loss, valid_count(labels)

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_loss).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


def valid_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 0):
    """(sum of CE over labelled tokens, number of labelled tokens). h (N, d), labels (N,)."""
    if chunk <= 0:
        return linear_cross_entropy_reference(h, weight, labels)
    return _ChunkedLinearCE.apply(h, weight, labels, chunk)
