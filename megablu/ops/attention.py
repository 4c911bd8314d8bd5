"""Causal GQA attention on (B, T, H, D) q and (B, T, Hkv, D) k/v: the kernel LocalAttention runs
when q and k have the same length (training, and a prefill), chosen by memory.attention.

Kernels (`KERNELS`; LocalAttention.kernel holds memory.attention, megablu.memory.apply_memory sets it;
"auto", the default, picks one per call with `auto_kernel`: fa4 where it can take the tensors and
flash_attn.cute imports, else sdpa, logged once with the reason; `AUTO_CHOICE` keeps the last pick):
  sdpa  torch's scaled_dot_product_attention(is_causal=True, enable_gqa=...) on (B, H, T, D)
        views: cuDNN's fused kernel on the H200, any device; the reference the other is
        tested against (tests/ops/test_attention.py, fwd and every grad).
  fa4   FlashAttention-4 (PyPI flash-attn-4, CuTe DSL, kernels compiled at the first call of a
        shape class): `flash_attn.cute.flash_attn_func(q, k, v, causal=True)` on the (B, T, H, D)
        layout as is; GQA when H is a multiple of Hkv (no repeated kv heads); softmax scale
        1/sqrt(D) by default, as SDPA's; returns (out, lse), out (B, T, H, D). Its backward is
        FA4's own autograd Function (dq in an fp32 accumulator; with GQA, dk/dv in fp32
        accumulators at the kv head count). Read from flash_attn/cute/interface.py of
        flash-attn-4 4.0.0b40.
        Limits (FA4 asserts them; here they are errors that name memory.attention): CUDA on SM90
        (Hopper: H100/H200; its SM100 kernels are not used here), bf16 or fp16, head_dim
        8..256 and a multiple of 8, Hq % Hkv == 0. Nothing else is supported here: no mask, no
        window, no KV-cache decode step (LocalAttention keeps SDPA for tq != tk), no
        document masking (data.doc_mask keeps its FlexAttention path; the config refuses fa4
        with it).
The library is imported at the first fa4 call, never at import of megablu: liger-kernel and
flash-attn-4 are optional (not in requirements.txt); `import_problem()` says why fa4 cannot
be imported (the preflight reports it before any rank starts: train/preflight.py kernel_problems).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..config.schema import FA4_HEAD_DIM  # (min, max, multiple) on SM90; the config checks it too

KERNELS = ("sdpa", "fa4")
MODES = ("auto",) + KERNELS
AUTO_CHOICE: dict = {}  # {"kernel": ..., "why": ...}: what memory.attention=auto ran last (probe.json)
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_FIX = "set memory.attention=sdpa"


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: causal SDPA, GQA without materialised repeats. (B, T, H, D) in and out."""
    # (B, T, H, D) -> (B, H, T, D)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


@functools.cache
def _fa4_func():
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


def import_problem() -> Optional[str]:
    """Why FlashAttention-4 cannot be imported here, or None."""
    try:
        _fa4_func()
    except Exception as e:  # noqa: BLE001 - a missing dependency (cutlass DSL, tvm-ffi ...) of any kind
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"flash_attn.cute is not importable ({type(e).__name__}: {first[:200]})"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fa4_unsupported(
    capability: tuple[int, int],
    dtype: torch.dtype,
    k_dtype: torch.dtype,
    head_dim: int,
    k_head_dim: int,
    heads: int,
    kv_heads: int,
) -> Optional[str]:
    """Why FA4 cannot take inputs of this kind on a GPU of this capability, or None: the
    conditions its interface asserts, checked first so that the error names the field and the fix."""
    major, minor = capability
    if major != 9:
        return f"this GPU is sm_{major}{minor}; FlashAttention-4 is used here on SM90 (H100/H200) only"
    if dtype not in FA4_DTYPES or k_dtype != dtype:
        return f"dtype {dtype}/{k_dtype}: FlashAttention-4 takes bf16 or fp16 (train.dtype=bf16)"
    lo, hi, mult = FA4_HEAD_DIM
    if not (lo <= head_dim <= hi and head_dim % mult == 0) or k_head_dim != head_dim:
        return f"head_dim {head_dim}: FlashAttention-4 takes {lo}..{hi}, a multiple of {mult}, on SM90"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} kv heads"
    return None


def fa4_problem(q: torch.Tensor, k: torch.Tensor) -> Optional[str]:
    """Why FA4 cannot take these (B, T, H, D) q and (B, T, Hkv, D) k, or None."""
    if q.device.type != "cuda":
        return f"the tensors are on {q.device.type}, FlashAttention-4 runs on CUDA (SM90) only"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return fa4_unsupported(_capability(index), q.dtype, k.dtype, q.shape[-1], k.shape[-1], q.shape[2], k.shape[2])


def fa4_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal FlashAttention-4 on (B, T, H, D) q and (B, T, Hkv, D) k/v -> (B, T, H, D)."""
    why = fa4_problem(q, k)
    if why is None:
        why = import_problem()
    if why is not None:
        raise RuntimeError(f"memory.attention=fa4: {why}; {FA4_FIX}")
    res = _fa4_func()(q, k, v, causal=True)
    # 4.0.0b40 returns (out, lse); an `out`-only return is accepted too
    return res[0] if isinstance(res, tuple) else res


@functools.cache
def _import_problem_once() -> Optional[str]:
    return import_problem()  # auto asks at every call: a failed import is tried once per process


def auto_kernel(q: torch.Tensor, k: torch.Tensor) -> tuple[str, str]:
    """(kernel, why) memory.attention=auto runs for these q and k: fa4 when FlashAttention-4 can take
    them (CUDA SM90, bf16/fp16, its head sizes) and flash_attn.cute imports, else sdpa. tests/ops/test_attention.py
    and tests/model/test_kernel_choices.py check fa4 against sdpa; experiments/speed/LOG.md compares their speed."""
    why = fa4_problem(q, k) or _import_problem_once()
    if why is not None:
        return "sdpa", why
    return "fa4", "CUDA SM90, bf16/fp16, a head size FlashAttention-4 takes, and flash_attn.cute imports"


def auto_for_config(cfg, device: str = "cuda") -> tuple[str, str]:
    """(kernel, why) memory.attention=auto is expected to run for a Config on `device`, before any
    tensor exists (the planner, `megablu plan`): fa4 when the config allows it (config/schema/checks.py
    kernel_invariants: head_dim, no doc_mask, bf16) on CUDA and flash_attn.cute imports here; the
    GPU's architecture is only known at the first call (auto_kernel)."""
    from ..config.schema import kernel_invariants

    if device != "cuda":
        return "sdpa", f"a {device} run: FlashAttention-4 runs on SM90 GPUs only"
    errs = kernel_invariants(
        cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"attention": "fa4"})}), device
    )
    why = errs[0].split(": ", 1)[-1] if errs else _import_problem_once()
    return ("sdpa", why) if why else ("fa4", "a CUDA run, the config allows it and flash_attn.cute imports")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "sdpa") -> torch.Tensor:
    """Causal attention with `kernel` (MODES); q (B, T, H, D), k/v (B, T, Hkv, D) -> (B, T, H, D)."""
    if kernel == "auto":
        kernel, why = auto_kernel(q, k)
        if AUTO_CHOICE.get("kernel") != kernel:
            from .dispatch import _log_once

            _log_once("attention", f"memory.attention=auto: {kernel} ({why})")
            AUTO_CHOICE.update(kernel=kernel, why=why)
    if kernel == "sdpa":
        return sdpa_causal(q, k, v)
    if kernel == "fa4":
        return fa4_causal(q, k, v)
    raise ValueError(f"memory.attention must be one of {MODES}, got {kernel!r}")
