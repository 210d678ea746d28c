"""Document layout of (packed) rows: per-document positions, lengths and tokens remaining."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class DocumentLayout(NamedTuple):
    """What anchor sampling and the draft's RoPE need to keep every block inside one document.

    Shapes match nemo_automodel's ``DFlashTrainerModule.forward`` packing arguments.
    """

    position_ids: torch.Tensor  # [B, S] position within the token's document (0 on padding)
    seq_lens: torch.Tensor  # [B, max_docs] document lengths in row order, zero-padded
    doc_remaining: torch.Tensor  # [B, S] tokens of the same document after this one (-1 on padding)


def document_layout(document_ids: torch.Tensor, max_documents: Optional[int] = None) -> DocumentLayout:
    """Layout from ``document_ids`` ``[B, S]`` (document index per token, ``-1`` on trailing padding).

    Documents are contiguous and numbered 0, 1, ... within each row; an unpacked row is a
    single document 0. ``max_documents`` (at least the most documents in a row, known on the
    host) spares reading it back from the device.
    """
    batch, width = document_ids.shape
    device = document_ids.device
    valid = document_ids >= 0
    if max_documents is None:
        max_documents = int(document_ids.max().item()) + 1 if valid.any() else 1
    doc_index = document_ids.clamp(min=0)
    # a comparison, not F.one_hot: that one reads the indices' range back to the host to check it
    one_hot = (doc_index.unsqueeze(-1) == torch.arange(max_documents, device=device)) & valid.unsqueeze(-1)  # [B, S, D]
    seq_lens = one_hot.sum(dim=1)  # [B, D] long
    starts = seq_lens.cumsum(dim=1) - seq_lens  # [B, D]
    start_of_token = torch.gather(starts, 1, doc_index)
    length_of_token = torch.gather(seq_lens, 1, doc_index)
    columns = torch.arange(width, device=device).expand(batch, -1)
    position_ids = torch.where(valid, columns - start_of_token, torch.zeros_like(columns))
    doc_remaining = torch.where(valid, length_of_token - position_ids - 1, torch.full_like(columns, -1))
    return DocumentLayout(position_ids, seq_lens, doc_remaining)
