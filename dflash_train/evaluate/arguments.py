"""Command-line options shared by ``dflash-eval``, ``dflash-labels`` and ``dflash-exposure``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from dflash_train.config.schema import InputConfig
from dflash_train.evaluate.loading import DTYPES, SERVING_PERCEPTION_DTYPE, TargetSource

INPUT_TYPES = ("lhotse_as_conversation", "multimodal_conversation")


class UsageError(Exception):
    """Arguments that do not fit together."""


def add_recipe_arguments(group) -> None:
    """``--config-name`` / ``--config-dir`` / Hydra overrides: a ``dflash-train`` recipe."""
    group.add_argument("--config-name", help="a dflash-train recipe name (as dflash-train --config-name takes it)")
    group.add_argument("--config-dir", help="directory holding --config-name (default: the package's conf/)")
    group.add_argument("overrides", nargs="*", help="Hydra overrides for --config-name, e.g. model.pretrained_name=DIR")


def add_target_arguments(parser: argparse.ArgumentParser, recipe_data: str) -> None:
    """Where the frozen target comes from; ``recipe_data`` says what a recipe's data section provides."""
    group = parser.add_argument_group(
        "target: exactly one of --target and --config-name",
        f"A recipe's model section is the target; its data section gives the default prompt format, system "
        f"prompt and {recipe_data}.",
    )
    group.add_argument("--target", help="SALM checkpoint directory (config.json + model.safetensors)")
    add_recipe_arguments(group)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the samples come from and how their prompt is rendered (the data pipeline's readers)."""
    group = parser.add_argument_group("data and prompt")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--cuts", help="lhotse cuts (.jsonl.gz); supervisions[0].text is the reply")
    source.add_argument("--manifest", help="NeMo ASR manifest or conversation JSONL (see --input-type)")
    group.add_argument(
        "--input-type",
        choices=INPUT_TYPES,
        default="lhotse_as_conversation",
        help="how --manifest is read: a NeMo ASR manifest (lhotse_as_conversation) or multi-turn conversations "
        "(multimodal_conversation; the last assistant turn is the reply); default %(default)s",
    )
    group.add_argument("--context", help="user text before the audio for records without their own 'context'")
    group.add_argument(
        "--prompt-format", help="chat format: qwen or nemotron_nano_v3 (default: the recipe's, else qwen)"
    )
    group.add_argument("--system-prompt", help="system prompt for records without their own (default: the recipe's)")
    group.add_argument("--limit", type=int, help="only the first N records of the input")
    group.add_argument("--sample-id", action="append", help="only the record with this sample id (repeatable)")


def add_decoding_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """Greedy decoding limits, precision and device."""
    group = parser.add_argument_group("decoding (greedy)")
    group.add_argument(
        "--max-new-tokens", type=int, default=max_new_tokens, help="tokens per reply at most (default %(default)s)"
    )
    group.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        help="a token id that ends a reply (repeatable; default: the tokenizer's EOS and the prompt format's "
        "end-of-turn token)",
    )
    group.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="precision of target and draft (default %(default)s)"
    )
    group.add_argument(
        "--perception-dtype",
        choices=sorted(DTYPES),
        default=SERVING_PERCEPTION_DTYPE,
        help="precision of the target's audio encoder and projection (default %(default)s: what vLLM's NeMo SALM "
        "model runs whatever the serving dtype, so outputs match served tokens)",
    )
    group.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")


def device(args: argparse.Namespace) -> str:
    """``--device``, else cuda when available."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def input_config(args: argparse.Namespace) -> Optional[InputConfig]:
    """The input named by ``--cuts`` / ``--manifest`` (``None``: the recipe's)."""
    tags = {"context": args.context} if args.context else {}
    for flag in ("cuts", "manifest"):
        path = getattr(args, flag)
        if path and (not Path(path).is_file() or Path(path).stat().st_size == 0):
            problem = "is a directory" if Path(path).is_dir() else "does not exist" if not Path(path).exists() else "is empty"
            raise UsageError(f"--{flag} {path} {problem}; give the {flag} file (.jsonl or .jsonl.gz)")
    if args.cuts:
        return InputConfig(type="lhotse_as_conversation", cuts_path=args.cuts, tags=tags)
    if args.manifest:
        return InputConfig(type=args.input_type, manifest_filepath=args.manifest, tags=tags)
    return None


def target_source(args: argparse.Namespace) -> TargetSource:
    """The target named by ``--target`` or by a recipe."""
    if args.overrides and not args.config_name:
        raise UsageError(f"overrides {args.overrides} need --config-name")
    return TargetSource(args.target, args.config_name, args.config_dir, tuple(args.overrides))
