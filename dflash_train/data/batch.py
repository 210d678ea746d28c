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
    ``row_lengths`` / ``audio_positions`` are host copies of where the placeholders are, and
    ``audio_frames`` / ``supervised_tokens`` / ``max_documents`` host copies of sizes the step
    needs; the data loader fills them (:meth:`with_placements`) so that a training step never
    reads them back from the GPU (each read would stall the host until the device catches up).
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
    audio_frames: Optional[list[int]] = None  # per audio: its perception frames (the exact estimate)
    supervised_tokens: Optional[int] = None  # == loss_mask.sum()
    max_documents: Optional[int] = None  # most documents in one row (1 unpacked)
    anchor_runway: Optional[int] = None  # see with_placements

    def with_placements(
        self, placeholder_id: int, audio_frames: Optional[list[int]] = None, anchor_runway: Optional[int] = None
    ) -> "SpeechBatch":
        """The batch with its host copies filled: placements (see :func:`audio_placements`), the supervised
        token count, the most documents in a row and, when given, each audio's perception frame count and
        the anchor runway: the most text tokens that follow a supervised token (not its document's first)
        inside its document, audio placeholders not counted. Splicing only adds positions, so a variant
        whose anchors need at most that many following tokens has one in this batch (no device read)."""
        row_lengths, positions = audio_placements(self.input_ids, self.lengths, placeholder_id)
        documents = 1
        if self.document_ids is not None and self.document_ids.numel():
            documents = max(1, int(self.document_ids.max()) + 1)
        return replace(
            self,
            row_lengths=row_lengths,
            audio_positions=positions,
            audio_frames=audio_frames,
            anchor_runway=anchor_runway,
            supervised_tokens=int(self.loss_mask.sum()),
            max_documents=documents,
        )

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
        """The same batch with every tensor on ``device`` (what Lightning does to a training batch).

        Tensors in page-locked memory (``pin_memory``) are copied without blocking the host: the copy is
        queued on the device's stream ahead of the step's kernels, which wait for it there.
        """
        return self._map_tensors(lambda tensor: tensor.to(device, non_blocking=tensor.is_pinned()))
