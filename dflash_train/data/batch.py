"""The batch contract between the data pipeline and the training module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SpeechBatch:
    """Collated speech conversations before audio splicing (what a dataloader yields).

    Text is tokenized with the target's tokenizer; every audio contributes exactly one
    ``audio_locator_tag`` token, which ``FrozenTarget.splice_batch`` expands into that
    audio's perception frames. Rows are right-padded with the tokenizer's pad id.
    """

    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool: supervised assistant tokens (content + end of turn)
    lengths: torch.Tensor  # [B] long: real tokens per row
    audios: torch.Tensor  # [N, samples] float32 at the target's sampling rate, N = sum(audios_per_row)
    audio_lens: torch.Tensor  # [N] long
    audios_per_row: list[int]
    sample_ids: list[str]  # one per row; a packed row joins its documents' ids with "+"
    document_ids: Optional[torch.Tensor] = None  # [B, T] long, packed rows only: document index, -1 on padding
    dataset_name: str = field(default="train")

    def pin_memory(self) -> "SpeechBatch":
        """The same batch in page-locked host memory (``DataLoader(pin_memory=True)`` calls this)."""
        pinned = {
            name: value.pin_memory() if isinstance(value, torch.Tensor) else value
            for name, value in self.__dict__.items()
        }
        return SpeechBatch(**pinned)
