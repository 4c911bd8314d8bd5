"""Which implementation an op runs: the CUDA extension or the pure-torch reference.

Every call names it (`impl=`): the model's modules carry the `memory.ops` config field
(megablu.memory.apply_memory sets it), tests and benchmarks pass either path explicitly (the
nanochat `flash_attention._override_impl` pattern, without a process-wide mode). None or
"auto" picks CUDA when the tensors are on a GPU and the extension builds, else torch; each
decision is logged once with its reason. "cuda" never falls back silently: it raises with
the reason.

NVIDIA apex is not consulted (yet): its only counterpart here is a plain FusedRMSNorm, which
would replace the final norm alone (every block norm is megablu's one-kernel residual add +
RMSNorm) and rounds in another order than HF (scale in fp32 before the cast). apex stays
optional and is never required.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

IMPLS = ("auto", "torch", "cuda")
# dtypes the kernels are built for (fp16 is not: megablu trains in bf16; it runs the reference)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_logged: set[tuple[str, str]] = set()


def ext():
    """The built extension module (imported lazily: `python -m megablu.ops.builder` must be
    able to run as __main__ without the package having imported it first)."""
    from . import builder

    return builder.load()


def _log_once(key: str, msg: str) -> None:
    if (key, msg) not in _logged:
        _logged.add((key, msg))
        log.info(msg)


def resolve(op: str, tensors: tuple, unsupported: Optional[str] = None, impl: Optional[str] = None) -> str:
    """ "cuda" or "torch" for this call of `op`.

    `unsupported` is the op's reason why the CUDA kernel cannot take these inputs (shape,
    dtype, grad of a table ...) or None when it can.
    """
    mode = impl or "auto"
    if mode not in IMPLS:
        raise ValueError(f"megablu ops: impl must be one of {IMPLS}, got {mode!r}")
    if mode == "torch":
        return "torch"
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices != {"cuda"}:
        if mode == "cuda":
            raise ValueError(f"megablu {op}: impl='cuda' needs CUDA tensors, got devices {sorted(devices)}")
        _log_once("torch", f"megablu ops: using the torch reference ops (tensors on {sorted(devices)})")
        return "torch"
    from . import builder

    try:
        builder.load()
    except Exception as e:  # noqa: BLE001 - build failures of any kind mean "no kernels"
        if mode == "cuda":
            raise RuntimeError(f"megablu {op}: impl='cuda' but the extension did not build: {e}") from e
        _log_once(
            "torch",
            f"megablu ops: using the torch reference ops (extension build failed: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
        )
        return "torch"
    if unsupported is not None:
        if mode == "cuda":
            raise ValueError(f"megablu {op}: impl='cuda' cannot run these inputs: {unsupported}")
        _log_once(op, f"megablu {op}: torch reference for inputs the kernel does not take ({unsupported})")
        return "torch"
    if ("cuda", "") not in _logged:
        _logged.add(("cuda", ""))
        log.info(
            "megablu ops: using CUDA kernels (extension %s_%s, tensors on cuda)",
            builder.EXT_PREFIX,
            builder.source_hash(),
        )
    return "cuda"
