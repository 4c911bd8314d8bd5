"""DeepSpeed ZeRO-1/2's gradient checks in a few multi-tensor kernels instead of ~14 kernels per tensor.

Before each optimizer step, `DeepSpeedZeroOptimizer.step` asks two questions of every gradient tensor of
the rank's partition, one tensor at a time:
- `has_overflow_partitioned_grads_serial`: is any element NaN or infinite? (amax, amin, two `isfinite`,
  and, not, add: about ten kernels per tensor);
- `get_grad_norm_direct`: the L2 norm, each tensor copied to float64 first (three kernels).
At blu-0.5b's 327 gradient tensors that is ~5,000 launches (4,900 kernels in the trace, and memsets). A
profile of a 32k step shows the engine's step mostly host time: the host launching those kernels, the GPU
idle (experiments/speed/LOG.md).

`install` replaces the two methods on one optimizer instance with the same answers from `torch._foreach_norm`
over all the tensors at once (one pass for the overflow check, one per parameter group for the norm; on a GPU
each is a few multi-tensor launches, on the CPU a per-tensor loop inside torch):
- overflow: the per-tensor max-abs (ord inf, which NaN propagates through) is finite for every tensor
  exactly when every element is finite: the same answer as DeepSpeed's;
- norm: per-tensor L2 norms accumulated in float32 (DeepSpeed: float64), squared and summed in float64, then
  DeepSpeed's own reductions, root and NaN masking. It differs from DeepSpeed's by float32 rounding (relative
  ~1e-6) in the clip coefficient and the logged grad_norm; a tensor whose values are all below ~1e-23 counts
  0 where DeepSpeed counts ~1e-46 (float32 underflow), which no clip can see.
Everything else in the step (the clip, the reductions over ranks, the skip of a step with a bad gradient,
the loss scaler) stays DeepSpeed's. `train.fused_grad_check: false` keeps DeepSpeed's methods as they are.

Only `DeepSpeedZeroOptimizer` (ZeRO stages 1 and 2) without CPU offload is changed: ZeRO-0 (bf16), ZeRO-3
and the offload paths check their gradients elsewhere. The replacements follow DeepSpeed 0.19.8's methods
(requirements.txt pins it): with another version, or where the class or a helper is not as expected, nothing
is replaced and the reason is returned.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Optional

import torch


def _ds_helpers() -> Optional[dict]:
    """The stage-1/2 module's names the replacements call, or None if one is missing."""
    try:
        from deepspeed.runtime.zero import stage_1_and_2 as s12
    except Exception:  # pragma: no cover - deepspeed is a dependency
        return None
    names = (
        "dist",
        "get_accelerator",
        "is_model_parallel_parameter",
        "PIPE_REPLICATED",
        "mask_nan_or_inf_with_val_inplace",
        "DeepSpeedZeroOptimizer",
    )
    if not all(hasattr(s12, n) for n in names):
        return None
    return {n: getattr(s12, n) for n in names}


TESTED_DEEPSPEED = ("0.19.8",)


def _by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors split by (device, dtype): torch's multi-tensor kernels take one kind per list (a mixed list
    falls back to a per-tensor loop)."""
    kinds: dict = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    return list(kinds.values())


def nonfinite_any(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """A bool tensor of shape [1] on `device`: whether any element of any tensor is NaN or infinite."""
    tensors = [t for t in tensors if t.numel()]  # an empty tensor holds no bad value (and has no max)
    if not tensors:
        return torch.zeros([1], dtype=torch.bool, device=device)
    # the max-abs is one of the tensor's own values: exact in its dtype (no float32 copy on the CPU's path)
    amax = torch.cat(
        [torch.stack(torch._foreach_norm(ts, float("inf"))).double().to(device) for ts in _by_kind(tensors)]
    )
    return (~torch.isfinite(amax).all()).reshape(1)


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum ||t||_2^2 over the tensors as a float32 scalar (per-tensor norms in float32, or float64 for float64
    tensors; the sum in float64)."""
    norms = [
        torch.stack(torch._foreach_norm(ts, 2.0, dtype=None if ts[0].dtype == torch.float64 else torch.float32))
        .double()
        .to(tensors[0].device)
        for ts in _by_kind(tensors)
    ]
    return torch.cat(norms).pow(2).sum().float()


def install(optimizer) -> Optional[str]:
    """Replace the overflow check and the L2 norm of a ZeRO-1/2 optimizer; None, or why it was left alone."""
    import deepspeed

    if deepspeed.__version__ not in TESTED_DEEPSPEED:
        return (
            f"DeepSpeed {deepspeed.__version__}: the fused check follows {', '.join(TESTED_DEEPSPEED)}'s methods "
            f"(requirements.txt); pin it, or set train.fused_grad_check=false to silence this"
        )
    h = _ds_helpers()
    if h is None:
        return "this DeepSpeed's stage_1_and_2 lacks a helper the fused check calls"
    if not isinstance(optimizer, h["DeepSpeedZeroOptimizer"]):
        return f"the optimizer is {type(optimizer).__name__}, not ZeRO-1/2's DeepSpeedZeroOptimizer"
    missing = [
        a
        for a in (
            "has_overflow_partitioned_grads_serial",
            "get_grad_norm_direct",
            "averaged_gradients",
            "bit16_groups",
            "model_parallel_rank",
            "dp_process_group",
            "_model_parallel_all_reduce",
            "cpu_offload",
            "device",
        )
        if not hasattr(optimizer, a)
    ]
    if missing:
        return f"DeepSpeedZeroOptimizer lacks {', '.join(missing)}"
    if optimizer.cpu_offload:
        return "offload_optimizer: DeepSpeed checks the gradients as they reach the CPU"
    stock_norm: Callable = optimizer.get_grad_norm_direct

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
        return nonfinite_any(grads, h["get_accelerator"]().current_device_name())

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return stock_norm(gradients, params, norm_type)
        picked = []
        # the tensors DeepSpeed counts: no zero padding, no pipeline replicas, model-parallel rank 0's share
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params, strict=False):
            if hasattr(p, h["PIPE_REPLICATED"]) and p.ds_pipe_replicated:
                continue
            if h["is_model_parallel_parameter"](p) or self.model_parallel_rank == 0:
                picked.append(g.data.detach())
        if picked:
            total = sum_of_squares(picked).to(h["get_accelerator"]().current_device_name())
        else:
            total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        h["dist"].all_reduce(total, op=h["dist"].ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total, op=h["dist"].ReduceOp.SUM)
        total = total.pow(0.5)
        h["mask_nan_or_inf_with_val_inplace"](total, device=self.device)
        return total

    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(has_overflow_partitioned_grads_serial, optimizer)
    optimizer.get_grad_norm_direct = types.MethodType(get_grad_norm_direct, optimizer)
    optimizer._megablu_fused_grad_check = True
    return None
