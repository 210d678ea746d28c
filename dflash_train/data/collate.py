"""Batches of examples -> :class:`SpeechBatch`: audio loading, right padding or packing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from dflash_train.data.batch import SpeechBatch
from dflash_train.data.conversation import DataError
from dflash_train.data.examples import Example


AUDIO_THREADS = 8  # audio files of one batch decoded at once (decoders release the GIL)


def _load_one(example_id: str, cut) -> torch.Tensor:
    try:
        samples = cut.load_audio()
    except Exception as err:  # a decoder failure after the header check: name the sample, stop
        detail = f"{type(err).__name__}: {err}"
        raise DataError(f"sample '{example_id}': cannot load audio {cut.id} ({detail})") from None
    mono = samples.mean(axis=0) if samples.ndim == 2 else samples
    if mono.shape[0] != cut.num_samples:
        raise DataError(f"sample '{example_id}': audio {cut.id} loaded {mono.shape[0]} samples, expected {cut.num_samples}")
    return torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))


def load_audio(examples: Sequence[Example]) -> list[torch.Tensor]:
    """Every audio segment of ``examples``, in placeholder order, as mono float32 tensors of exactly the
    expected sample counts; decoded by lhotse (``Cut.load_audio``) on up to :data:`AUDIO_THREADS` threads."""
    jobs = [(ex.id, cut) for ex in examples for cut in ex.audio]
    if len(jobs) <= 1:
        return [_load_one(*job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(AUDIO_THREADS, len(jobs))) as pool:
        return list(pool.map(lambda job: _load_one(*job), jobs))


def _stack_audio(waves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([w.shape[0] for w in waves], dtype=torch.long)
    audios = torch.zeros(len(waves), int(lens.max()) if len(waves) else 0, dtype=torch.float32)
    for i, wave in enumerate(waves):
        audios[i, : wave.shape[0]] = wave
    return audios, lens


def anchor_runway(example: Example, placeholder_id: int) -> int:
    """The most text tokens (audio placeholders not counted) after a supervised token of ``example`` other
    than its first; -1 when it has none (see ``SpeechBatch.with_placements``)."""
    text = np.asarray(example.input_ids) != placeholder_id
    following = np.cumsum(text[::-1])[::-1] - text  # text tokens after each position
    supervised = np.asarray(example.loss_mask, dtype=bool).copy()
    supervised[:1] = False
    return int(following[supervised].max()) if supervised.any() else -1


def collate_padded(examples: Sequence[Example], pad_id: int, dataset_name: str) -> SpeechBatch:
    """One row per example, right-padded with ``pad_id`` (padding sits after every real token)."""
    lengths = torch.tensor([len(ex.input_ids) for ex in examples], dtype=torch.long)
    width = int(lengths.max())
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for row, ex in enumerate(examples):
        input_ids[row, : len(ex.input_ids)] = torch.from_numpy(ex.input_ids.astype(np.int64))
        loss_mask[row, : len(ex.loss_mask)] = torch.from_numpy(ex.loss_mask)
    audios, audio_lens = _stack_audio(load_audio(examples))
    return SpeechBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        audios=audios,
        audio_lens=audio_lens,
        audios_per_row=[len(ex.audio) for ex in examples],
        sample_ids=[ex.id for ex in examples],
        dataset_name=dataset_name,
    )


def collate_packed(examples: Sequence[Example], dataset_name: str) -> SpeechBatch:
    """All examples concatenated into one row; ``document_ids`` holds each token's example index."""
    ids = np.concatenate([ex.input_ids for ex in examples]).astype(np.int64)
    mask = np.concatenate([ex.loss_mask for ex in examples])
    docs = np.concatenate([np.full(len(ex.input_ids), i, dtype=np.int64) for i, ex in enumerate(examples)])
    audios, audio_lens = _stack_audio(load_audio(examples))
    return SpeechBatch(
        input_ids=torch.from_numpy(ids)[None],
        loss_mask=torch.from_numpy(mask)[None],
        lengths=torch.tensor([len(ids)], dtype=torch.long),
        audios=audios,
        audio_lens=audio_lens,
        audios_per_row=[sum(len(ex.audio) for ex in examples)],
        sample_ids=["+".join(ex.id for ex in examples)],
        document_ids=torch.from_numpy(docs)[None],
        dataset_name=dataset_name,
    )


class SpeechCollator:
    """A batch of examples (what a lhotse sampler yields) -> the :class:`SpeechBatch` training reads.

    Runs in the loader workers (``data.loader``): audio decoding, padding or packing and the
    splice placements happen off the training process.
    """

    def __init__(self, pad_id: int, placeholder_id: int, packed: bool, dataset_name: str):
        self.pad_id = pad_id
        self.placeholder_id = placeholder_id
        self.packed = packed
        self.dataset_name = dataset_name

    def __call__(self, examples: Sequence[Example]) -> SpeechBatch:
        """The collated batch, with its audio placements read here on the CPU (see ``SpeechBatch``)."""
        examples = list(examples)
        if self.packed:
            batch = collate_packed(examples, self.dataset_name)
        else:
            batch = collate_padded(examples, self.pad_id, self.dataset_name)
        frames = [count for ex in examples for count in ex.audio_frames]
        runway = max(anchor_runway(ex, self.placeholder_id) for ex in examples)
        return batch.with_placements(self.placeholder_id, frames, runway)
