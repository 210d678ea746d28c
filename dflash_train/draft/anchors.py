"""Where a training step's blocks start: the anchor draw per row or per packed document, and its coverage.

Every variant trains on blocks (DFlash, DFlash2) or chains (MTP) that start at anchors drawn
uniformly among a row's valid positions, up to ``dflash.num_anchors`` of them. With packed rows
that budget is per row (the runbook's rule and nemo_automodel's draw): a row of many short
documents spreads the same number of anchors over all of them, so each document is covered less
than it would be alone. ``dflash.anchor_budget: per_document`` gives every document of a packed
row the budget a row of its own would get (up to ``num_anchors`` anchors, uniformly among that
document's valid positions); on unpacked rows the two rules are the same.

The coverage of a step says how much of the supervision the draw reached: for every document
with supervised positions, the fraction of them that some kept anchor's span predicts (positions
``a + 1 .. a + span``), averaged over documents, and the number of documents no block reached.
"""

from __future__ import annotations

import torch

def documents_of(doc_remaining: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` document index per position (``-1`` on padding), from the real tokens left in each
    position's document: a document ends where none is left."""
    ends = doc_remaining == 0
    return torch.where(doc_remaining >= 0, ends.long().cumsum(dim=1) - ends.long(), -1)


def draw_anchors(valid: torch.Tensor, budget: int, documents: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``budget`` positions drawn uniformly among the ``valid [B, P]`` ones of each row, or of each
    document (``documents [B, P]``, the document index per position) when given; sorted per row.

    Returns ``(anchors [B, A], keep [B, A])``, ``A`` the largest count drawn in a row (at least 1), unused
    slots at position 0 with ``keep`` false. The draw reads the global generator (the caller seeds it):
    one uniform score per position, the lowest ``budget`` scores of each group win.
    """
    rows, width = valid.shape
    device = valid.device
    scores = torch.rand(valid.shape, device=device)
    group = torch.zeros_like(valid, dtype=torch.long) if documents is None else documents.clamp(min=0)
    # sort by (group, score) with invalid positions last: a key whose integer part is the group
    key = torch.where(valid, group.double() + scores.double(), float(width + 1))
    order = key.argsort(dim=1)
    sorted_group = group.gather(1, order)
    sorted_valid = valid.gather(1, order)
    index = torch.arange(width, device=device).expand(rows, width)
    starts = torch.ones_like(sorted_valid)
    starts[:, 1:] = sorted_group[:, 1:] != sorted_group[:, :-1]
    first_of_group = torch.where(starts, index, 0).cummax(dim=1).values
    chosen = sorted_valid & (index - first_of_group < budget)
    counts = chosen.sum(dim=1)
    drawn = max(1, int(counts.max()))
    anchors = torch.where(chosen, order, width).sort(dim=1).values[:, :drawn]  # unused slots sort last
    keep = torch.arange(drawn, device=device)[None] < counts[:, None]
    return anchors.masked_fill(~keep, 0), keep


def anchor_coverage(anchors: torch.Tensor, keep: torch.Tensor, span: int, supervised: torch.Tensor,
                    documents: torch.Tensor) -> torch.Tensor:
    """``[Σ coverage, documents, documents not reached]`` of one step (a float64 device tensor, no host read).

    ``supervised [B, S]`` marks supervised positions, ``documents [B, S]`` the document index (``-1``:
    padding). A position is covered when a kept anchor ``a`` of its row has ``a < p <= a + span``; a
    document's coverage is the fraction of its supervised positions covered; documents without a
    supervised position are not counted.
    """
    rows, width = supervised.shape
    predicted = anchors[..., None] + torch.arange(1, span + 1, device=anchors.device)  # [B, A, span]
    hit = torch.zeros(rows, width + 1, dtype=torch.bool, device=anchors.device)  # column width: nowhere
    reach = torch.where(keep[..., None] & (predicted < width), predicted, width)
    hit.scatter_(1, reach.reshape(rows, -1), True)
    covered = hit[:, :width] & supervised
    flat = torch.arange(rows, device=anchors.device)[:, None] * width + documents.clamp(min=0)  # < width documents
    real = supervised & (documents >= 0)
    total = torch.zeros(rows * width, dtype=torch.float64, device=anchors.device)
    total.index_add_(0, flat.reshape(-1), real.reshape(-1).double())  # weights, not a mask: no host read
    reached = torch.zeros_like(total).index_add_(0, flat.reshape(-1), (covered & real).reshape(-1).double())
    counted = total > 0
    fraction = torch.where(counted, reached / total.clamp(min=1), 0.0)
    return torch.stack([fraction.sum(), counted.sum().double(), (counted & (reached == 0)).sum().double()])
