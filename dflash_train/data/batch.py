"""The batch contract between the data pipeline and the training module."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch


def audio_placements(input_ids: torch.Tensor, lengths: torch.Tensor, placeholder_id: int) -> tuple[list[int], list[list[int]]]:
    """Row lengths and, per row, the positions of its audio placeholders, as host lists.

    Two reads of the tensors' device, whatever the batch size: free on CPU (the collator),
    two syncs when the tensors are already on the GPU.
    """
    row_lengths = [int(n) for n in lengths.tolist()]
    positions: list[list[int]] = [[] for _ in row_lengths]
    for row, pos in (input_ids == placeholder_id).nonzero().tolist():
        if pos < row_lengths[row]:
            positions[row].append(pos)
    return row_lengths, positions


@dataclass
class SpeechBatch:
    """Collated speech conversations before audio splicing (what a dataloader yields).

    Text is tokenized with the target's tokenizer; every audio contributes exactly one
    ``audio_locator_tag`` token, which ``FrozenTarget.splice_batch`` expands into that
    audio's perception frames. Rows are right-padded with the tokenizer's pad id.
    ``row_lengths`` / ``audio_positions`` are host copies of where the placeholders are,
    filled by the data loader so splicing never reads them back from the GPU.
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
    row_lengths: Optional[list[int]] = None  # == lengths.tolist()
    audio_positions: Optional[list[list[int]]] = None  # per row: placeholder positions in order

    def with_placements(self, placeholder_id: int) -> "SpeechBatch":
        """The batch with ``row_lengths`` and ``audio_positions`` filled (see :func:`audio_placements`)."""
        row_lengths, positions = audio_placements(self.input_ids, self.lengths, placeholder_id)
        return replace(self, row_lengths=row_lengths, audio_positions=positions)

    def placements(self, placeholder_id: int) -> tuple[list[int], list[list[int]]]:
        """``(row_lengths, audio_positions)``: the host copies, or read from the tensors if absent."""
        if self.row_lengths is not None and self.audio_positions is not None:
            return self.row_lengths, self.audio_positions
        return audio_placements(self.input_ids, self.lengths, placeholder_id)

    def _map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "SpeechBatch":
        return SpeechBatch(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})

    def pin_memory(self) -> "SpeechBatch":
        """The same batch in page-locked host memory (``DataLoader(pin_memory=True)`` calls this)."""
        return self._map_tensors(torch.Tensor.pin_memory)

    def to(self, device: torch.device | str) -> "SpeechBatch":
        """The same batch with every tensor on ``device`` (what Lightning does to a training batch)."""
        return self._map_tensors(lambda tensor: tensor.to(device))
