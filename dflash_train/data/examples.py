"""From conversations to tokenized examples, with every dropped sample counted by reason."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import numpy as np
import torch
from lhotse.cut import Cut

from dflash_train.data.conversation import SKIP_REASONS, Conversation, SampleSkipped
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.inputs import Input
from dflash_train.data.prompt import ChatMLFormat

log = logging.getLogger(__name__)

SKIP_REASON_ORDER = sorted(SKIP_REASONS)  # the slots of a worker table


@dataclass
class Example:
    """A tokenized sample: what lhotse samplers batch and the collator turns into tensors.

    ``num_tokens`` is the sample's exact length in LLM positions after audio splicing
    (text tokens, minus one placeholder per audio, plus that audio's perception frames).
    """

    id: str
    input_ids: np.ndarray  # int32, one placeholder token per audio
    loss_mask: np.ndarray  # bool
    audio: list[Cut]  # at the target's sampling rate, in placeholder order
    audio_frames: list[int]
    num_tokens: int
    num_supervised: int
    duration: float

    def with_id(self, id: str) -> "Example":
        """Copy under a new id (lhotse renames duplicated examples at the end of a distributed pass)."""
        return replace(self, id=id)


@dataclass(frozen=True)
class Filters:
    """Sample filters of one split; ``None`` disables a bound."""

    min_duration: Optional[float] = None
    max_duration: Optional[float] = None
    max_tokens: Optional[int] = None


class Preparer:
    """Conversation -> :class:`Example`: duration filters, tokenization, exact length, token cap."""

    def __init__(self, prompt_format: ChatMLFormat, estimator: AudioTokenEstimator, filters: Filters):
        self.prompt_format = prompt_format
        self.estimator = estimator
        self.filters = filters

    def __call__(self, conversation: Conversation) -> Example:
        f, name = self.filters, f"sample '{conversation.id}'"
        duration = conversation.duration
        if f.min_duration is not None and duration < f.min_duration:
            raise SampleSkipped("below_min_duration", f"{name}: {duration:.2f}s < {f.min_duration}s")
        if f.max_duration is not None and duration > f.max_duration:
            raise SampleSkipped("above_max_duration", f"{name}: {duration:.2f}s > {f.max_duration}s")
        encoded = self.prompt_format.encode(conversation)
        audio = conversation.audio_cuts
        frames = [self.estimator.frames(cut.num_samples) for cut in audio]
        num_tokens = len(encoded.input_ids) - len(frames) + sum(frames)
        if f.max_tokens is not None and num_tokens > f.max_tokens:
            raise SampleSkipped("too_many_tokens", f"{name}: {num_tokens} > {f.max_tokens} positions")
        return Example(
            id=conversation.id,
            input_ids=encoded.input_ids,
            loss_mask=encoded.loss_mask,
            audio=audio,
            audio_frames=frames,
            num_tokens=num_tokens,
            num_supervised=int(encoded.loss_mask.sum()),
            duration=duration,
        )


class SkipCounter:
    """Skipped samples by reason, as this rank's share of the total.

    Record *i* of an input belongs to rank ``i % world_size``. Training streams prepare only
    the records their rank owns; validation streams prepare every record (lhotse then deals
    whole batches to ranks) but count only owned skips. Either way, summing the counters over
    ranks gives the true total. The first few skips of each reason are logged with details.

    Loader workers each walk the same stream (see ``data.loader``), so in a loader's workers only
    worker 0 counts, into that loader's shared-memory table (:meth:`worker_table`), which the
    training process adds to its own counts when asked (:attr:`counts`).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, log_first: int = 3):
        self.rank = rank
        self.world_size = world_size
        self.log_first = log_first
        self._local: Counter[str] = Counter()
        self._tables: list[torch.Tensor] = []
        self._sink: Optional[torch.Tensor] = None  # in a loader worker: its loader's table
        self._counting = True

    def owns(self, index: int) -> bool:
        """Whether record ``index`` of an input belongs to this rank."""
        return index % self.world_size == self.rank

    def worker_table(self) -> torch.Tensor:
        """A new shared-memory table (one slot per skip reason) for one loader's workers to count into."""
        table = torch.zeros(len(SKIP_REASON_ORDER), dtype=torch.int64).share_memory_()
        self._tables.append(table)
        return table

    def count_in_worker(self, table: torch.Tensor, counts: bool) -> None:
        """In a loader worker: count into ``table`` (its loader's) when ``counts``, else count nothing."""
        self._sink, self._counting = table, counts

    def add(self, skip: SampleSkipped) -> None:
        """Count one skipped sample (call only for records this rank owns)."""
        if not self._counting:
            return
        if self._sink is None:
            self._local[skip.reason] += 1
            seen = self._local[skip.reason]
        else:
            slot = SKIP_REASON_ORDER.index(skip.reason)
            self._sink[slot] += 1
            seen = int(self._sink[slot])
        if seen <= self.log_first:
            log.warning("data: skipped a sample (%s): %s", skip.reason, skip.detail)

    @property
    def counts(self) -> Counter[str]:
        """Skips by reason: this process's own and its loaders' workers'."""
        total = Counter(self._local)
        for table in self._tables:
            total.update({reason: int(n) for reason, n in zip(SKIP_REASON_ORDER, table.numpy()) if n})
        return total


class ExampleStream:
    """Re-iterable examples of one input, optionally only this rank's shard of its records.

    Skipped records are counted once each, however often the stream is re-read (training
    repeats it; validation re-reads it every validation run).
    """

    def __init__(self, source: Input, prepare: Preparer, counter: SkipCounter, sharded: bool):
        self.source = source
        self.prepare = prepare
        self.counter = counter
        self.sharded = sharded
        self._counted_below = 0  # records with a smaller index were already counted if skipped

    def __iter__(self) -> Iterator[Example]:
        for index, record in enumerate(self.source.records):
            owned = self.counter.owns(index)
            if self.sharded and not owned:
                continue
            try:
                example = self.prepare(self.source.convert(record))
            except SampleSkipped as skip:
                if owned and index >= self._counted_below:
                    self.counter.add(skip)
                continue
            finally:
                self._counted_below = max(self._counted_below, index + 1)
            yield example
