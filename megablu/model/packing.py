"""Where each token of a packed row sits: its document's positions and lengths.

A packed row holds several documents; `doc_ids` (B, T) is each token's document index within
its row (non-decreasing from 0; each EOT separator starts the document after it). These
are the global quantities computed once, on the full row, before any sequence sharding.

"The length of a sequence" -- what `rope.yarn.apply: beyond_original` compares with
original_max_position -- is, per token:
  - with doc_mask: the number of tokens of its document in this row (a document cut by
    the window counts only its part in the row: that is all the attention sees; the padding
    at a row's end, which the loader gives the last document's id, is not counted);
  - without: its row's real length, the index of the row's last labelled token + 1
    (padding and an unlabelled closing EOT do not count; a packed row is full: T).
RoPE is relative, so under doc_mask a document's length decides what the attention of its
tokens sees whatever its absolute positions (doc_positions=continue too).
"""

from __future__ import annotations

import torch

from ..ops.cross_entropy import IGNORE_INDEX


def _starts_ends(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first index, last index) of each token's document, both (B, T)."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    # the latest document start at or before t; the earliest document end at or after t
    start = torch.where(first, idx, torch.zeros_like(idx)).cummax(1).values
    end = torch.where(last, idx, torch.full_like(idx, T)).flip(1).cummin(1).values.flip(1)
    return start, end


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions restarting at 0 at every document start (doc_positions=restart)."""
    start, _ = _starts_ends(doc_ids)
    return torch.arange(doc_ids.shape[1], device=doc_ids.device) - start


def document_lengths(doc_ids: torch.Tensor, real_len=None) -> torch.Tensor:
    """(B, T) the in-row length of each token's document.

    real_len (B,): the row's real length (row_lengths): the padding after it is no part of the
    document it trails (a fit row is one document + padding with one id, so that a row of
    one document keeps plain causal attention; its length is still its real tokens)."""
    start, end = _starts_ends(doc_ids)
    if real_len is not None:
        last = (real_len.to(end.device) - 1).clamp(min=0)[:, None]
        end = torch.where(start <= last, torch.minimum(end, last), end)
    return end - start + 1


def row_lengths(labels: torch.Tensor) -> torch.Tensor:
    """(B,) the index of each row's last labelled token + 1 (0 for a row without labels)."""
    idx = torch.arange(1, labels.shape[1] + 1, device=labels.device)
    return (idx * (labels != IGNORE_INDEX)).amax(1)
