"""Label sources (docs/training.md, Choose the labels): ground truth, or the frozen target's greedy next token."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dflash_train.loss.head import true_indices

LABEL_CHUNK_ROWS = 1024


@torch.no_grad()
def target_argmax_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    last_hidden: torch.Tensor,
    lm_head: nn.Module,
    chunk_rows: int = LABEL_CHUNK_ROWS,
    supervised_bound: Optional[int] = None,
) -> torch.Tensor:
    """``input_ids`` with every supervised position *p* replaced by ``argmax(lm_head(h[p-1]))``.

    The target's logits at *p − 1* label position *p* (teacher-forced context). Only the
    supervised positions' predecessors go through the LM head, ``chunk_rows`` at a time, so
    full ``[S, V]`` logits are never held. Position 0 has no predecessor and keeps its id.

    ``supervised_bound``: at least the number of supervised positions, known on the host (the
    batch's count); the positions are then picked into that many slots with no host read.
    Without it, picking them reads their count back from the device.
    """
    where = loss_mask.bool().clone()
    where[:, 0] = False
    flat_where = where.reshape(-1)
    size = flat_where.numel()
    picked = true_indices(flat_where, supervised_bound)  # leftover slots write the scratch slot past the end
    labels = torch.cat([input_ids.reshape(-1), input_ids.new_zeros(1)])
    hidden = last_hidden.reshape(size, -1)
    for start in range(0, picked.numel(), chunk_rows):
        slots = picked[start : start + chunk_rows]
        labels[slots] = lm_head(hidden[(slots - 1).clamp(max=size - 1)]).argmax(dim=-1)
    return labels[:size].view_as(input_ids)
