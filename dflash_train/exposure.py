"""``dflash-exposure``: estimate the share of training anchors that fall in long-audio examples.

    dflash-exposure --config-name my_run [overrides] [--long-audio-seconds 30] [--batches 1000]

Long audio is rare in most speech sets, and a token budget packs few long examples per
batch, so a draft can see far less long-audio signal than the example count suggests.
This runs the recipe's real training sampler (its token budget, bucketing, filters,
shuffle and seed, as rank 0 of a one-process run; audio is never loaded) for ``--batches``
batches and counts, per batch, the anchors the DFlash objective can draw (docs/evaluation.md:
a supervised position with a whole block left in its row / document, at most
``num_anchors`` per row, drawn uniformly) for each example. The estimate is

    expected anchors in examples with audio > threshold / expected anchors in all examples

over every sampled batch, batches of short examples only included. It is an *estimate*:
anchors are drawn at random, and a multi-rank run shards the data between ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from dflash_train.data.examples import Example

EXIT_USAGE = 2


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
    """Expected anchors drawn in each example of one batch.

    Padded rows: one row per example, width = the longest example; anchors at supervised
    positions ``a <= width - block_size``, at most ``num_anchors``. Packed: one row of all
    examples; a block must stay inside its document (``a <= length - block_size``), and
    ``num_anchors`` are drawn uniformly from the row's valid positions.
    """
    width = max(ex.num_tokens for ex in batch)
    valid = []
    for ex in batch:
        last = (ex.num_tokens if packed else width) - block_size
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


def build_parser() -> argparse.ArgumentParser:
    from dflash_train.evaluate.arguments import add_recipe_arguments

    parser = argparse.ArgumentParser(
        prog="dflash-exposure",
        description="Estimate the fraction of training anchors in long-audio examples, with the recipe's real sampler.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arguments(parser.add_argument_group("recipe (its data, model and dflash sections are used)"))
    parser.add_argument("--long-audio-seconds", type=float, default=30.0,
                        help="an example is long when its total audio lasts longer (default %(default)s)")
    parser.add_argument("--batches", type=int, default=1000, help="training batches to sample (default %(default)s)")
    parser.add_argument("--json", help="also write the estimate to this JSON file")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point: 0 on success, 2 on bad arguments, config or data."""
    from dflash_train.data.conversation import DataError
    from dflash_train.data.prompt import build_prompt_format
    from dflash_train.errors import ConfigError
    from dflash_train.evaluate.loading import compose_recipe, load_target
    from dflash_train.target import TargetLoadError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s %(levelname)s] %(message)s")
    try:
        if not args.config_name:
            raise ConfigError("--config-name is required: the estimate runs a recipe's training sampler")
        if args.batches < 1 or args.long_audio_seconds < 0:
            raise ConfigError("--batches must be >= 1 and --long-audio-seconds >= 0")
        run = compose_recipe(args.config_name, args.config_dir, args.overrides)
        target = load_target(run.model, "cpu", "float32")  # its tokenizer and perception lengths are needed
        prompt_format = build_prompt_format(run.data.prompt_format, target.tokenizer, run.model.audio_locator_tag)
        estimate = estimate_exposure(
            recipe_batches(run, target, args.batches),
            prompt_format.audio_locator_tag_id,
            run.dflash.block_size,
            run.dflash.num_anchors,
            run.data.train_ds.packing,
            args.long_audio_seconds,
        )
    except (ConfigError, DataError, TargetLoadError) as err:
        print(f"dflash-exposure: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(estimate.format())
    if args.json:
        Path(args.json).write_text(json.dumps(estimate.to_dict(), indent=2))
        print(f"estimate: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
