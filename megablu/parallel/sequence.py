"""Sequence sharding of a batch and the SP/DP-correct loss normalisation.

Each optimizer step normalises by the number of labelled tokens in the WHOLE global batch
(all micro-batches, all dp replicas), counted once before the first backward. A rank's
micro-batch loss is therefore local_sum / global_count, rescaled so that DeepSpeed's own
reductions cancel:
  - engine.backward divides by gradient_accumulation_steps          -> x grad_accum
  - gradients are summed over dp*sp ranks and divided by dp          -> x dp
  - ZeRO-3 with reduce_scatter divides by dp*sp instead of dp       -> x sp more
(deepspeed 0.19.8: engine._reduce_non_expert_gradients divides by seq_dp/sp;
stage3.__avg_scatter_grads averages over the whole partition group). The result equals the
gradient of the token-mean loss of a one-rank run over the same sequences; the tests
check it against that reference with gradient clipping off.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..ops.cross_entropy import IGNORE_INDEX
from .groups import Groups


def shard_batch(batch: dict, groups: Groups, pad_id: int = 0) -> dict:
    """Full sequences (B, T) -> this rank's slice (B, ceil(T/sp)) with global position ids.

    T not divisible by sp is padded at the END with pad_id and IGNORE labels: attention is
    causal, so padding after the last real token cannot change any real token's output.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    B, T = ids.shape
    sp, r = groups.sp, groups.sp_rank
    Tp = math.ceil(T / sp) * sp
    if Tp != T:
        ids = torch.nn.functional.pad(ids, (0, Tp - T), value=pad_id)
        labels = torch.nn.functional.pad(labels, (0, Tp - T), value=IGNORE_INDEX)
    n = Tp // sp
    sl = slice(r * n, (r + 1) * n)
    pos = torch.arange(r * n, (r + 1) * n, dtype=torch.long).expand(B, n)
    return {"input_ids": ids[:, sl].contiguous(), "labels": labels[:, sl].contiguous(), "position_ids": pos}


def global_token_count(local_counts: list[int], groups: Groups, device) -> int:
    """Labelled tokens in the whole global batch (sum over micro-batches and all ranks)."""
    t = torch.tensor([float(sum(local_counts))], dtype=torch.float64, device=device)
    if groups.world_size > 1:
        dist.all_reduce(t, group=groups.world_group)
    return int(t.item())


def loss_scale(groups: Groups, grad_accum: int, zero_stage: int, reduce_scatter: bool) -> float:
    """Factor on local_sum/global_count that cancels DeepSpeed's averaging (module docstring)."""
    s = float(grad_accum * groups.dp)
    if zero_stage == 3 and reduce_scatter:
        s *= groups.sp
    return s
