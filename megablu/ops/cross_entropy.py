"""Linear + cross-entropy that never materialises the fp32 [T, V] logits: megablu's chunked
loss, or Liger-Kernel's fused linear cross-entropy (memory.loss: auto | chunked | liger).

At T=32k and V=100k one fp32 logits tensor is 13 GB, and log_softmax's backward keeps
three of them alive: 94% of HF's memory per token with checkpointing. Here the sequence
is cut into chunks of `chunk` tokens; for each chunk the logits are formed, the loss and
the gradients w.r.t. the hidden states and the head weight are computed at once, and
the logits are dropped (Liger-Kernel's fused linear cross-entropy does the same). The
forward therefore holds grad_hidden (N, d) and grad_weight (V, d, fp32) until backward,
which only scales them by the incoming gradient.

Both return the *sum* of token losses and the count of labelled tokens (IGNORE_INDEX
excluded), so the caller can normalise by a count reduced across sequence-parallel ranks
(parallel/sequence.py); the head weight's grad flows back to whatever it is (the embedding's
weight when tied).

Implementations (`LOSSES`; LMHead.loss holds the choice, megablu.memory.apply_memory sets it; memory.loss=auto
resolves to one of them once per model, resolve_loss below):
  chunked  _ChunkedLinearCE below (`chunk` <= 0: the unchunked reference,
           linear_cross_entropy_reference, which tests compare both against);
  liger    liger_kernel's fused linear cross-entropy (optional package liger-kernel; Triton, CUDA):
           reduction="sum", ignore_index=IGNORE_INDEX, accum_dtype=fp32. It computes dh and dW
           in the forward and scales them in the backward, as _ChunkedLinearCE does. Its chunk
           (bf16 logits) is the largest power of two of at most `chunk` tokens it can make (or all T)
           (chunk_mem_const: utils/liger.py liger_mem_const); `chunk` <= 0 leaves Liger's own
           sizing, ~T*d/V tokens (512 at 32k for blu-0.5b). Each chunk reads and writes the fp32
           (V, d) dW sum once (0.8 GB for blu-0.5b): fewer, larger chunks take less time
           (experiments/speed/LOG.md). accum_dtype=fp32 sums dW over
           the chunks in fp32, as megablu's chunked loss does: Liger's bf16 default sums them in
           bf16, whose error grows with the number of chunks (experiments/speed/LOG.md has both errors
           against an fp32 reference and the time the fp32 sum costs).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..utils.liger import liger_mem_const

IGNORE_INDEX = -100
LOSSES = ("chunked", "liger")  # the implementations (LMHead.loss)
LOSS_MODES = ("auto", *LOSSES)  # memory.loss: auto picks one of LOSSES per run (resolve_loss)
LIGER_ACCUM_DTYPE = torch.float32


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
            hc, yc = h[s : s + chunk], labels[s : s + chunk]
            logits = (hc @ weight.t()).float()  # (c, V) fp32
            valid = yc != IGNORE_INDEX
            safe_y = torch.where(valid, yc, torch.zeros_like(yc))
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            picked = logits.gather(1, safe_y[:, None]).squeeze(1)
            loss += ((lse - picked) * valid).sum()
            if need_grad:
                # d(sum CE)/d logits = softmax - onehot, zero on ignored rows
                g = torch.exp(logits.sub_(lse[:, None]))
                g.scatter_add_(1, safe_y[:, None], torch.full_like(picked[:, None], -1.0))
                g.mul_(valid[:, None])
                g = g.to(h.dtype)
                grad_h[s : s + chunk] = g @ weight
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


@functools.cache
def _liger_func():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


@functools.cache
def _liger_takes_chunk_mem_const() -> bool:
    """Whether Liger's functional takes chunk_mem_const and passes it on (0.8.5 passes it only where its autograd
    Function sets supports_inner_impl_dispatch, as the CUDA one does; the backends LIGER_KERNEL_IMPL selects
    otherwise drop it)."""
    import inspect

    import liger_kernel.transformers.functional as functional

    if "chunk_mem_const" not in inspect.signature(_liger_func()).parameters:
        return False
    fn = getattr(functional, "LigerFusedLinearCrossEntropyFunction", None)
    return bool(getattr(fn, "supports_inner_impl_dispatch", False))


def liger_import_problem() -> Optional[str]:
    """Why Liger's fused linear cross-entropy cannot be imported here, or None."""
    try:
        _liger_func()
    except Exception as e:  # noqa: BLE001 - a missing dependency (triton ...) of any kind
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"liger_kernel is not importable ({type(e).__name__}: {first[:200]})"
    return None


def auto_loss(device: str) -> tuple[str, str]:
    """(implementation, why) memory.loss=auto picks on a run on `device` ("cuda" or "cpu"): liger when
    the run is on CUDA and liger_kernel imports, else chunked. tests/model/test_kernel_choices.py checks
    liger against chunked in the model; experiments/speed/LOG.md compares their speed and memory."""
    if device != "cuda":
        return "chunked", f"a {device} run: Liger's fused linear cross-entropy is a Triton GPU kernel"
    why = liger_import_problem()
    if why is not None:
        return "chunked", f"a CUDA run, but {why}"
    return "liger", "a CUDA run and liger_kernel imports"


def resolve_loss(mode: str, device: str) -> str:
    """The implementation (one of LOSSES) memory.loss=`mode` runs on a run on `device`. An explicit
    chunked or liger is returned as given (liger on a CPU run is a config error: config/schema/checks.py
    kernel_invariants); auto's choice is logged once with its reason (as ops/dispatch.py does)."""
    if mode not in LOSS_MODES:
        raise ValueError(f"memory.loss must be one of {LOSS_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    loss, why = auto_loss(device)
    from .dispatch import _log_once

    _log_once("loss", f"memory.loss=auto: {loss} ({why})")
    return loss


def liger_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 0):
    """(sum of CE over labelled tokens, their count) through Liger's fused linear cross-entropy, in chunks of
    at most `chunk` tokens where Liger can make them (<= 0: Liger's own; module docstring)."""
    # CPU tensors run only in Triton's CPU interpreter (TRITON_INTERPRET=1, the opt-in CPU tests); a
    # config asks for liger on CUDA alone (config/schema/checks.py kernel_invariants refuses it on a CPU run)
    why = liger_import_problem()
    if why is not None:
        raise RuntimeError(
            f"memory.loss=liger: {why}; install liger-kernel (pip install "
            f"liger-kernel==0.8.5, the version tested) or set memory.loss=chunked"
        )
    mem_const = liger_mem_const(h.shape[0], weight.shape[1], weight.shape[0], chunk)
    # the constant is passed only where it widens the chunks: loss_chunk 0 (or below Liger's own chunk) calls
    # Liger exactly as before it existed
    wider = {}
    if mem_const > 1:
        if not _liger_takes_chunk_mem_const():
            raise RuntimeError(
                f"memory.loss=liger with memory.loss_chunk={chunk}: this liger_kernel does not take "
                f"chunk_mem_const or drops it (its LigerFusedLinearCrossEntropyFunction does not set "
                f"supports_inner_impl_dispatch: an older version, or a LIGER_KERNEL_IMPL backend other "
                f"than the default Triton one), so its chunks would silently stay its own; install "
                f"liger-kernel==0.8.5 (the version tested) with its default backend, or set "
                f"memory.loss_chunk=0"
            )
        wider["chunk_mem_const"] = mem_const
    loss = _liger_func()(
        h, weight, labels, ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=LIGER_ACCUM_DTYPE, **wider
    )
    return loss, valid_count(labels)


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 0, impl: str = "chunked"
):
    """(sum of CE over labelled tokens, number of labelled tokens). h (N, d), labels (N,).

    impl: "chunked" (megablu's; chunk <= 0 = the unchunked reference) or "liger" (chunk <= 0: Liger's own); never
    "auto", which resolve_loss turns into one of them before the model runs."""
    if impl == "liger":
        return liger_linear_cross_entropy(h, weight, labels, chunk)
    if impl != "chunked":
        raise ValueError(f"memory.loss must be one of {LOSSES} here (auto resolves before: resolve_loss), got {impl!r}")
    if chunk <= 0:
        return linear_cross_entropy_reference(h, weight, labels)
    return _ChunkedLinearCE.apply(h, weight, labels, chunk)
