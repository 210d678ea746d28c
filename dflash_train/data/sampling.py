"""Token-budget and fixed-size batching with lhotse samplers.

:class:`TokenBudget` is a lhotse ``SamplingConstraint`` measuring examples in LLM positions
(text tokens + exact audio frames). It is strict: a batch never exceeds ``batch_tokens``,
counting padding (padded rows: ``rows x longest``) or not (packed row: sum of documents).
lhotse's batchers decide to stop *after* adding an example, so the constraint stops as soon
as one more example of the largest size that can still arrive would not fit. With
bucketing that size is the current bucket's upper edge; without it, the token cap.

Sharding: given ``rank``/``world_size`` (validation), every rank iterates the same stream and
lhotse hands rank *r* every ``world_size``-th batch: disjoint samples and, on a finite stream,
the same number of batches per rank. Training streams arrive already sharded per rank.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable, Optional

from lhotse.dataset import DynamicBucketingSampler, DynamicCutSampler
from lhotse.dataset.sampling.base import CutSampler, SamplingConstraint
from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

from dflash_train.config.schema import DatasetConfig
from dflash_train.data.examples import Example

log = logging.getLogger(__name__)


@dataclass
class TokenBudget(SamplingConstraint):
    """Batch limits in LLM positions and/or examples; see the module docstring for strictness."""

    batch_tokens: Optional[int] = None
    batch_size: Optional[int] = None
    packed: bool = False
    measure_total_length: bool = True
    max_tokens: Optional[int] = None  # the largest measured length any example can have
    bins: list[float] = field(default_factory=list)  # bucket upper edges (inclusive), ascending
    count: int = 0
    total: int = 0
    longest: int = 0
    bound: int = 0

    def measure_length(self, example: Example) -> int:
        """Whole sequence, or only its unsupervised (prompt) positions when ``measure_total_length`` is off."""
        if self.measure_total_length:
            return example.num_tokens
        return example.num_tokens - example.num_supervised

    def _edge(self, length: int) -> int:
        index = bisect.bisect_left(self.bins, length)
        upper = self.bins[index] if index < len(self.bins) else self.max_tokens
        return int(upper) if upper is not None else length

    def add(self, example: Example) -> None:
        length = self.measure_length(example)
        if self.count == 0:
            self.bound = self._edge(length)
        self.count += 1
        self.total += length
        self.longest = max(self.longest, length)
        self.bound = max(self.bound, length)

    def _cost(self, count: int, total: int, longest: int) -> int:
        return total if self.packed else count * longest

    def exceeded(self) -> bool:
        if self.batch_size is not None and self.count > self.batch_size:
            return True
        return self.batch_tokens is not None and self._cost(self.count, self.total, self.longest) > self.batch_tokens

    def close_to_exceeding(self) -> bool:
        if self.batch_size is not None and self.count >= self.batch_size:
            return True
        if self.batch_tokens is None:
            return False
        worst_next = self._cost(self.count + 1, self.total + self.bound, max(self.longest, self.bound))
        return worst_next > self.batch_tokens

    def reset(self) -> None:
        self.count = self.total = self.longest = self.bound = 0


def token_cap(cfg: DatasetConfig) -> Optional[int]:
    """The longest sample a split keeps: ``max_tokens``, else ``batch_tokens`` (a longer one never fits)."""
    return cfg.max_tokens if cfg.max_tokens is not None else cfg.batch_tokens


def train_shuffle(ds) -> bool:
    """Whether the training stream is shuffled: ``shuffle: null`` means yes for training."""
    return True if ds.shuffle is None else ds.shuffle


def build_sampler(
    examples: Iterable[Example], cfg: DatasetConfig, shuffle: bool, seed: int, rank: int, world_size: int
) -> CutSampler:
    """A lhotse sampler over ``examples`` honouring the split's budget, bucketing and shuffle settings."""
    constraint = TokenBudget(
        batch_tokens=cfg.batch_tokens,
        batch_size=cfg.batch_size,
        packed=cfg.packing,
        measure_total_length=cfg.measure_total_length,
        max_tokens=token_cap(cfg),
    )
    common = dict(constraint=constraint, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=False)
    if not cfg.use_bucketing:
        return DynamicCutSampler(examples, shuffle_buffer_size=cfg.shuffle_buffer_size, **common)
    bins = list(cfg.bucket_bins) if cfg.bucket_bins is not None else estimate_bins(examples, cfg, constraint)
    constraint.bins = bins
    log.info("data: %d buckets, upper edges %s (+ cap %s) LLM positions", len(bins) + 1, bins, constraint.max_tokens)
    return DynamicBucketingSampler(
        examples, duration_bins=bins, buffer_size=cfg.bucket_buffer_size, num_buckets=None, **common
    )


def estimate_bins(examples: Iterable[Example], cfg: DatasetConfig, constraint: TokenBudget) -> list[int]:
    """Bucket edges holding roughly equal token mass, from the first ``bucket_estimate_samples`` examples."""
    sample = list(islice(iter(examples), cfg.bucket_estimate_samples))
    num_buckets = min(cfg.num_buckets, len(sample))
    if num_buckets < 2:
        return []
    return sorted({int(edge) for edge in estimate_duration_buckets(sample, num_buckets, constraint)})
