"""Label sources (docs/training.md, Choose the labels): ground truth, or the frozen target's greedy next token."""

from __future__ import annotations

import torch
from torch import nn

LABEL_CHUNK_ROWS = 1024


@torch.no_grad()
def target_argmax_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    last_hidden: torch.Tensor,
    lm_head: nn.Module,
    chunk_rows: int = LABEL_CHUNK_ROWS,
) -> torch.Tensor:
    """``input_ids`` with every supervised position *p* replaced by ``argmax(lm_head(h[p-1]))``.

    The target's logits at *p − 1* label position *p* (teacher-forced context). Only the
    supervised positions' predecessors go through the LM head, ``chunk_rows`` at a time, so
    full ``[S, V]`` logits are never held. Position 0 has no predecessor and keeps its id.
    """
    labels = input_ids.clone()
    where = loss_mask.bool().clone()
    where[:, 0] = False
    rows, cols = where.nonzero(as_tuple=True)
    for start in range(0, rows.numel(), chunk_rows):
        r, c = rows[start : start + chunk_rows], cols[start : start + chunk_rows]
        labels[r, c] = lm_head(last_hidden[r, c - 1]).argmax(dim=-1)
    return labels
