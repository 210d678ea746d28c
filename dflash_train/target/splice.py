"""Splice perception frames into the text sequence (docs/target.md, Audio splicing).

Every audio placeholder token expands into that audio's frames. At frame positions the
id becomes ``mask_token_id`` and the loss mask is false. Rows come back right-padded, so
any position before a row's length is real content: a draft context (positions < anchor)
can never contain padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class SplicedBatch:
    """Inputs of the target's LLM after audio splicing, aligned position by position."""

    inputs_embeds: torch.Tensor  # [B, S, H]
    input_ids: torch.Tensor  # [B, S]; mask_token_id at audio frames, pad_id after `lengths`
    loss_mask: torch.Tensor  # [B, S] bool; supervised text positions only
    attention_mask: torch.Tensor  # [B, S] bool; True for the first `lengths[i]` positions
    audio_mask: torch.Tensor  # [B, S] bool; True at audio frames
    lengths: torch.Tensor  # [B]
    document_ids: torch.Tensor | None = None  # [B, S] packed rows: frames inherit their placeholder's document


class PlaceholderMismatchError(ValueError):
    """The number of audio placeholders in the text does not match the number of audios."""


def splice_audio_frames(
    input_ids: torch.Tensor,
    row_lengths: Sequence[int],
    audio_positions: Sequence[Sequence[int]],
    loss_mask: torch.Tensor,
    text_embeds: torch.Tensor,
    audio_embeds: Sequence[torch.Tensor],
    audios_per_row: Sequence[int],
    mask_token_id: int,
    pad_id: int,
    sample_ids: Sequence[str] | None = None,
    document_ids: torch.Tensor | None = None,
) -> SplicedBatch:
    """Replace each placeholder of row *i* by the next of its ``audios_per_row[i]`` audio embeddings.

    ``row_lengths`` and ``audio_positions`` (each row's placeholder positions) are host lists,
    so splicing reads nothing back from the device (``SpeechBatch.placements``).
    ``document_ids`` (packed rows, ``-1`` on padding) are carried through: audio frames take
    the document id of the placeholder they replace.
    """
    batch = input_ids.shape[0]
    if len(audios_per_row) != batch or sum(audios_per_row) != len(audio_embeds):
        raise PlaceholderMismatchError(
            f"audios_per_row={list(audios_per_row)} does not describe {len(audio_embeds)} audios in a batch of {batch}"
        )
    rows = []
    next_audio = 0
    for i in range(batch):
        n = row_lengths[i]
        ids, mask, embs = input_ids[i, :n], loss_mask[i, :n].bool(), text_embeds[i, :n]
        docs = document_ids[i, :n] if document_ids is not None else torch.zeros_like(ids)
        where = list(audio_positions[i])
        if len(where) != audios_per_row[i]:
            name = sample_ids[i] if sample_ids is not None else f"row {i}"
            raise PlaceholderMismatchError(
                f"sample '{name}' has {len(where)} audio placeholder(s) but {audios_per_row[i]} audio(s)"
            )
        seg_ids, seg_mask, seg_embs, seg_audio, seg_docs = [], [], [], [], []
        prev = 0
        for pos in where + [n]:
            seg_ids.append(ids[prev:pos])
            seg_mask.append(mask[prev:pos])
            seg_embs.append(embs[prev:pos])
            seg_audio.append(torch.zeros(pos - prev, dtype=torch.bool, device=ids.device))
            seg_docs.append(docs[prev:pos])
            if pos == n:
                break
            frames = audio_embeds[next_audio].to(embs.dtype)
            count = frames.shape[0]
            next_audio += 1
            seg_ids.append(torch.full((count,), mask_token_id, dtype=ids.dtype, device=ids.device))
            seg_mask.append(torch.zeros(count, dtype=torch.bool, device=ids.device))
            seg_embs.append(frames)
            seg_audio.append(torch.ones(count, dtype=torch.bool, device=ids.device))
            seg_docs.append(docs[pos].expand(count))
            prev = pos + 1
        rows.append(tuple(torch.cat(seg) for seg in (seg_ids, seg_mask, seg_embs, seg_audio, seg_docs)))
    spliced = _right_pad(rows, pad_id, text_embeds)
    if document_ids is None:
        spliced.document_ids = None
    return spliced


def _right_pad(rows, pad_id: int, like: torch.Tensor) -> SplicedBatch:
    row_lengths = [r[0].shape[0] for r in rows]
    new_lengths = torch.tensor(row_lengths, device=like.device)
    width = max(row_lengths, default=0)
    batch, hidden = len(rows), like.shape[-1]
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device=like.device)
    loss = torch.zeros(batch, width, dtype=torch.bool, device=like.device)
    audio = torch.zeros_like(loss)
    docs = torch.full((batch, width), -1, dtype=torch.long, device=like.device)
    embeds = torch.zeros(batch, width, hidden, dtype=like.dtype, device=like.device)
    for i, (r_ids, r_mask, r_embs, r_audio, r_docs) in enumerate(rows):
        n = r_ids.shape[0]
        ids[i, :n], loss[i, :n], embeds[i, :n], audio[i, :n], docs[i, :n] = r_ids, r_mask, r_embs, r_audio, r_docs
    attention = torch.arange(width, device=like.device)[None, :] < new_lengths[:, None]
    return SplicedBatch(embeds, ids, loss, attention, audio, new_lengths, docs)
