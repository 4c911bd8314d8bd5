"""Sequence sharding of a batch (with its document layout) and the SP/DP-correct loss normalisation.

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

from ..model.packing import document_lengths, document_positions, row_lengths
from ..ops.cross_entropy import IGNORE_INDEX
from ..ops.doc_attention import check_doc_ids
from .groups import Groups


def shard_batch(
    batch: dict, groups: Groups, pad_id: int = 0, *, doc_mask: bool = False, doc_positions: str = "restart"
) -> dict:
    """Full sequences (B, T) -> this rank's slice (B, ceil(T/sp)) with global position ids.

    T not divisible by sp is padded at the END with pad_id and IGNORE labels: attention is
    causal, so padding after the last real token cannot change any real token's output.

    Always returns `rope_len` (B, T/sp): each token's sequence length (model/packing.py; read
    by rope.yarn.apply=beyond_original only): its document's in-row length with doc_mask,
    else its row's real length. With doc_mask, `batch["doc_ids"]` (B, T) is required and
    the result carries `doc_ids` (B, Tp) for the FULL padded sequence (attention after the
    Ulysses all-to-all sees every token; the pad tokens form one extra document), and position
    ids restart at 0 per document (doc_positions=restart) or run on (continue). Positions and
    lengths are computed on the full row, before the slice.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    B, T = ids.shape
    sp, r = groups.sp, groups.sp_rank
    Tp = math.ceil(T / sp) * sp
    pos = torch.arange(Tp, dtype=torch.long).expand(B, Tp)
    out = {}
    if doc_mask:
        if batch.get("doc_ids") is None:
            raise ValueError(
                "data.doc_mask=true but the batch has no doc_ids (B, T): the loader must emit each "
                "input token's document index within its row"
            )
        doc = batch["doc_ids"]
        if tuple(doc.shape) != (B, T):
            raise ValueError(f"doc_ids {tuple(doc.shape)} must match input_ids {(B, T)}")
        check_doc_ids(doc)
        if doc_positions not in ("restart", "continue"):
            raise ValueError(f"doc_positions must be restart or continue, got {doc_positions!r}")
        rope_len = document_lengths(doc, row_lengths(labels))
        if doc_positions == "restart":
            pos = torch.cat([document_positions(doc), pos[:, T:]], 1)
        if Tp != T:
            # the pad tokens: their own document after the last one (they see only each other)
            doc = torch.cat([doc, (doc[:, -1:] + 1).expand(B, Tp - T)], 1)
        out["doc_ids"] = doc.to(torch.int32).contiguous()
    else:
        rope_len = row_lengths(labels)[:, None].expand(B, T)
    if Tp != T:
        ids = torch.nn.functional.pad(ids, (0, Tp - T), value=pad_id)
        labels = torch.nn.functional.pad(labels, (0, Tp - T), value=IGNORE_INDEX)
        rope_len = torch.nn.functional.pad(rope_len, (0, Tp - T), value=0)
    n = Tp // sp
    sl = slice(r * n, (r + 1) * n)
    return {
        "input_ids": ids[:, sl].contiguous(),
        "labels": labels[:, sl].contiguous(),
        "position_ids": pos[:, sl].contiguous(),
        "rope_len": rope_len[:, sl].contiguous(),
        **out,
    }


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
