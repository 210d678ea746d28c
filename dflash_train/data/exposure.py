"""Estimate the share of training anchors that fall in long-audio examples (``dflash-exposure``).

Long audio is rare in most speech sets, and a token budget packs few long examples per
batch, so a draft can see far less long-audio signal than the example count suggests.
:func:`recipe_batches` runs the recipe's real training sampler (its token budget, bucketing,
filters, shuffle and seed, as rank 0 of a one-process run; audio is never loaded) and
:func:`estimate_exposure` counts, per batch, the anchors the DFlash objective can draw
(docs/evaluation.md: a supervised position with a whole block left in its own sequence, at
most ``num_anchors`` per row, drawn uniformly) for each example. The estimate is

    expected anchors in examples with audio > threshold / expected anchors in all examples

over every sampled batch, batches of short examples only included. It is an *estimate*:
anchors are drawn at random, and a multi-rank run shards the data between ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import islice
from typing import Iterable

import numpy as np

from dflash_train.data.examples import Example


def supervised_positions(example: Example, placeholder_id: int) -> np.ndarray:
    """Positions of the supervised tokens after audio splicing (each placeholder becomes its frames)."""
    ids = example.input_ids
    is_audio = ids == placeholder_id
    growth = np.zeros(len(ids), dtype=np.int64)
    growth[is_audio] = np.asarray(example.audio_frames, dtype=np.int64) - 1
    shift = np.cumsum(growth) - growth  # positions added by the placeholders before each token
    return (np.arange(len(ids)) + shift)[example.loss_mask]


def expected_anchors(
    batch: list[Example], placeholder_id: int, block_size: int, num_anchors: int, packed: bool
) -> list[float]:
    """Expected anchors drawn in each example of one batch, by training's rule.

    An anchor is a supervised position whose whole block stays inside its own sequence
    (``a <= length - block_size``: padding is no document, so a padded row of a batch's
    longest example gives a short example no extra anchors). Padded rows: one row per
    example, at most ``num_anchors`` each. Packed: one row of all examples, ``num_anchors``
    drawn uniformly from the row's valid positions.
    """
    valid = []
    for ex in batch:
        last = ex.num_tokens - block_size
        valid.append(int((supervised_positions(ex, placeholder_id) <= last).sum()))
    if not packed:
        return [float(min(num_anchors, v)) for v in valid]
    total = sum(valid)
    share = min(1.0, num_anchors / total) if total else 0.0
    return [v * share for v in valid]


@dataclass
class ExposureEstimate:
    """Expected anchors in long-audio examples against all, over the sampled batches."""

    long_audio_seconds: float
    block_size: int
    num_anchors: int
    packed: bool
    batches: int = 0
    short_only_batches: int = 0
    examples: int = 0
    long_examples: int = 0
    anchors: float = 0.0
    long_anchors: float = 0.0

    @property
    def fraction(self) -> float:
        return self.long_anchors / self.anchors if self.anchors else float("nan")

    def add(self, batch: list[Example], anchors: list[float]) -> None:
        is_long = [ex.duration > self.long_audio_seconds for ex in batch]
        self.batches += 1
        self.short_only_batches += not any(is_long)
        self.examples += len(batch)
        self.long_examples += sum(is_long)
        self.anchors += sum(anchors)
        self.long_anchors += sum(a for a, long in zip(anchors, is_long) if long)

    def to_dict(self) -> dict:
        return {**asdict(self), "estimated_long_anchor_fraction": self.fraction, "is_estimate": True}

    def format(self) -> str:
        return "\n".join(
            [
                f"ESTIMATE: {100 * self.fraction:.2f}% of training anchors fall in long-audio examples "
                f"(audio > {self.long_audio_seconds:g} s)",
                f"  over {self.batches} sampled batches ({self.short_only_batches} with short audio only, "
                "counted in the denominator)",
                f"  examples: {self.examples} ({self.long_examples} long, "
                f"{_percent(self.long_examples, self.examples)})",
                f"  expected anchors: {self.anchors:.0f} ({self.long_anchors:.0f} in long examples); block_size "
                f"{self.block_size}, num_anchors {self.num_anchors} per row, "
                f"{'packed' if self.packed else 'padded'} rows",
                "  an estimate: anchors are drawn at random, and several ranks shard the data between them",
            ]
        )


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "n/a"


def estimate_exposure(
    batches: Iterable[list[Example]],
    placeholder_id: int,
    block_size: int,
    num_anchors: int,
    packed: bool,
    long_audio_seconds: float,
) -> ExposureEstimate:
    """Accumulate :func:`expected_anchors` over ``batches``."""
    estimate = ExposureEstimate(long_audio_seconds, block_size, num_anchors, packed)
    for batch in batches:
        batch = list(batch)
        estimate.add(batch, expected_anchors(batch, placeholder_id, block_size, num_anchors, packed))
    return estimate


def recipe_batches(run, target, count: int) -> Iterable[list[Example]]:
    """The first ``count`` batches the recipe's training sampler yields (rank 0 of one process)."""
    from dflash_train.data.estimator import AudioTokenEstimator
    from dflash_train.data.module import SpeechDataModule
    from dflash_train.data.sampling import build_sampler, train_shuffle

    module = SpeechDataModule(
        run.data, target.tokenizer, run.model.audio_locator_tag, AudioTokenEstimator.from_target(target), run.seed, 0, 1
    )
    ds = run.data.train_ds
    sampler = build_sampler(module.train_examples(), ds, train_shuffle(ds), run.seed, rank=0, world_size=1)
    return (list(batch) for batch in islice(sampler, count))
