"""``dflash-labels``: write a training file whose replies are the frozen target's own greedy transcripts.

    dflash-labels --target SALM_CKPT --cuts train_cuts.jsonl.gz --out labelled_cuts.jsonl.gz

Each record is decoded greedily with the prompt training and serving use; the output is
the input's format with the generated text as the supervised reply and everything else
kept (ids, audio paths, offsets, durations, context; the old reply under
``original_text`` / ``original_value``). Failed, truncated and empty generations are left
out and listed. ``<out>.labels.json`` records the target, decoding settings and exclusions.
Then train with ``data.train_ds.input_cfg[0].cuts_path=<out> dflash.label_source=ground_truth``.

Exit status: 0 labels written (exclusions listed); 1 no record could be labelled; 2 bad
arguments, config or inputs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.evaluate.arguments import (
    add_data_arguments,
    add_decoding_arguments,
    add_target_arguments,
    device,
    input_config,
    target_source,
)
from dflash_train.files import check_writable_file

EXIT_NOTHING_WRITTEN, EXIT_USAGE = 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-labels",
        description="Label a training set with the frozen target's greedy transcripts (offline target labels).",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(parser, "training set (its single train input)")
    add_data_arguments(parser)
    add_decoding_arguments(parser, max_new_tokens=256)
    add_debug_argument(parser)
    parser.add_argument(
        "--out", required=True, help="the labelled file to write, same format as the input (.jsonl or .jsonl.gz)"
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    configure_console()
    return run_command("dflash-labels", lambda: _label(args), args.debug, EXIT_USAGE)


def _label(args) -> int:
    from dflash_train.evaluate.decoder import StopRule
    from dflash_train.evaluate.loading import default_stop_token_ids, load_target_context
    from dflash_train.evaluate.offline_labels import generate_labels, sidecar_path

    check_writable_file(args.out, "the labelled file")
    source = target_source(args)
    dev = device(args)
    context = load_target_context(
        source, input_config(args), "train", args.prompt_format, args.system_prompt, args.dtype, dev,
        perception_dtype=args.perception_dtype,
    )
    stop_ids = args.stop_token_id or default_stop_token_ids(context.prompt_format)
    rule = StopRule(args.max_new_tokens, frozenset(stop_ids))
    settings = {
        "target": {**source.to_dict(), "description": source.describe()},
        "target_checkpoint": context.checkpoint(),
        "target_init_from_checkpoint": context.model.init_from_checkpoint,
        "input": context.data.cuts_path or context.data.manifest_filepath,
        "input_type": context.data.type,
        "prompt_format": context.prompt_format.name,
        "system_prompt": context.system_prompt,
        "context": (context.data.tags or {}).get("context"),
        "decoding": "greedy",
        "max_new_tokens": rule.max_new_tokens,
        "stop_token_ids": sorted(rule.stop_token_ids),
        "dtype": args.dtype,
        "perception_dtype": args.perception_dtype,
        "device": dev,
    }
    run = generate_labels(
        context.target,
        context.prompt_format,
        context.estimator,
        context.data,
        rule,
        args.out,
        settings,
        system_prompt=context.system_prompt,
        limit=args.limit,
        sample_ids=set(args.sample_id) if args.sample_id else None,
    )
    print(f"dflash-labels: wrote {run.written} labelled records to {run.output} (settings: {sidecar_path(run.output)})")
    for reason in ("failed", "truncated", "empty"):
        left_out = [e for e in run.excluded if e.reason == reason]
        if left_out:
            print(f"left out, {reason} ({len(left_out)}): " + ", ".join(e.id for e in left_out))
    return 0 if run.written else EXIT_NOTHING_WRITTEN


if __name__ == "__main__":
    sys.exit(main())
