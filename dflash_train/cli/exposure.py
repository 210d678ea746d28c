"""``dflash-exposure``: estimate the share of training anchors that fall in long-audio examples.

    dflash-exposure --config-name my_run [overrides] [--long-audio-seconds 30] [--batches 1000]

The estimate itself is :mod:`dflash_train.data.exposure` (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.data import exposure as exposure_estimate
from dflash_train.data.exposure import estimate_exposure, recipe_batches
from dflash_train.files import check_writable_file
from dflash_train.progress import progress

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from dflash_train.evaluate.arguments import add_recipe_arguments

    parser = argparse.ArgumentParser(
        prog="dflash-exposure",
        description="Estimate the fraction of training anchors in long-audio examples, with the recipe's real sampler.",
        epilog=exposure_estimate.__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arguments(parser.add_argument_group("recipe (its data, model and dflash sections are used)"))
    parser.add_argument("--long-audio-seconds", type=float, default=30.0,
                        help="an example is long when its total audio lasts longer (default %(default)s)")
    parser.add_argument("--batches", type=int, default=1000, help="training batches to sample (default %(default)s)")
    parser.add_argument("--json", help="also write the estimate to this JSON file")
    add_debug_argument(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point: 0 on success, 2 on bad arguments, config or data."""
    args = build_parser().parse_args(argv)
    configure_console()
    return run_command("dflash-exposure", lambda: _estimate(args), args.debug, EXIT_USAGE)


def _estimate(args: argparse.Namespace) -> int:
    from dflash_train.data.prompt import build_prompt_format
    from dflash_train.data.validate import validate_data_config
    from dflash_train.errors import ConfigError
    from dflash_train.evaluate.loading import compose_recipe, load_target

    if not args.config_name:
        raise ConfigError("--config-name is required: the estimate runs a recipe's training sampler")
    if args.batches < 1 or args.long_audio_seconds < 0:
        raise ConfigError("--batches must be >= 1 and --long-audio-seconds >= 0")
    if args.json:
        check_writable_file(args.json, "the estimate")
    run = compose_recipe(args.config_name, args.config_dir, args.overrides)
    validate_data_config(run.data)
    target = load_target(run.model, "cpu", "float32")  # its tokenizer and perception lengths are needed
    prompt_format = build_prompt_format(run.data.prompt_format, target.tokenizer, run.model.audio_locator_tag)
    estimate = estimate_exposure(
        progress(recipe_batches(run, target, args.batches), "dflash-exposure", total=args.batches, unit="batch"),
        prompt_format.audio_locator_tag_id,
        run.dflash.block_size,
        run.dflash.num_anchors,
        run.data.train_ds.packing,
        args.long_audio_seconds,
    )
    print(estimate.format())
    if args.json:
        Path(args.json).write_text(json.dumps(estimate.to_dict(), indent=2))
        print(f"estimate: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
