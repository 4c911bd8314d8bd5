"""One optimizer step over grad_accum micro-batches with SP-correct loss normalisation."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.cross_entropy import IGNORE_INDEX
from ..parallel.groups import Groups
from ..parallel.sequence import global_token_count, loss_scale, shard_batch
from .step_profile import no_timer


def forward_backward(
    engine,
    micro_batches: list[dict],
    groups: Groups,
    zero_stage: int,
    reduce_scatter: bool,
    apply_step: bool = True,
    doc_mask: bool = False,
    doc_positions: str = "restart",
    timer=no_timer,
) -> float:
    """Run fwd+bwd on each FULL micro-batch (sharded here along T); return the token-mean loss.

    All ranks of one sp group must pass the same micro-batches. With apply_step=False the
    gradients are left reduced but unapplied (for parity tests: deepspeed.utils.safe_get_full_grad).
    doc_mask / doc_positions: data.doc_mask / data.doc_positions; the micro-batches then carry
    doc_ids (B, T) and attention stays inside each document (parallel/sequence.py shard_batch).
    timer: train.profile_step's phase timer (step_profile.PhaseTimer); a no-op otherwise.
    """
    dev = engine.device
    with timer("shard_and_count"):
        micro = [shard_batch(m, groups, doc_mask=doc_mask, doc_positions=doc_positions) for m in micro_batches]
        counts = [int((m["labels"] != IGNORE_INDEX).sum()) for m in micro]
        total = max(1, global_token_count(counts, groups, dev))
    scale = loss_scale(groups, len(micro), zero_stage, reduce_scatter)
    loss_acc = torch.zeros((), dtype=torch.float64, device=dev)
    for i, m in enumerate(micro):
        with timer("forward"):
            docs = m["doc_ids"].to(dev) if "doc_ids" in m else None
            loss_sum, _ = engine(
                m["input_ids"].to(dev),
                position_ids=m["position_ids"].to(dev),
                labels=m["labels"].to(dev),
                doc_ids=docs,
                rope_len=m["rope_len"].to(dev),
            )
        with timer("backward"):
            engine.backward(loss_sum / total * scale)
        if apply_step or i < len(micro) - 1:
            with timer("optimizer_step" if i == len(micro) - 1 else "engine_step"):
                engine.step()
        loss_acc += loss_sum.detach().double()
    with timer("loss_reduce"):
        if groups.world_size > 1:
            dist.all_reduce(loss_acc, group=groups.world_group)
        loss = float(loss_acc.item()) / total
    return loss
