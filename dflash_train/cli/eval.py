"""``dflash-eval``: measure a draft the way vLLM serves it, before deploying it.

Decodes every sample of an evaluation set greedily with the target alone and with the
draft(s) through the reference speculative decoder (:mod:`dflash_train.evaluate.decoder`),
then reports pooled MAL, per-position acceptance (unconditional and conditional), rounds,
tokens, sample counts, failures and truncations by id, and WER of both transcripts; as a
table on stdout, as JSON (``--json``) and as a PNG plot (``--plot``). Speculative output
must equal target-only output token for token on every sample.

Exit status: 0 all good; 1 speculation changed a greedy output (listed by sample id);
2 bad arguments, config or inputs; 3 some samples failed (the numbers are provisional:
run ``dflash-eval --rerun-failed REPORT.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.evaluate.arguments import (
    UsageError,
    add_data_arguments,
    add_decoding_arguments,
    add_target_arguments,
    device,
    input_config,
    target_source,
)
from dflash_train.files import check_writable_file

if TYPE_CHECKING:
    from dflash_train.evaluate.report import EvalReport

EXIT_MISMATCH, EXIT_USAGE, EXIT_FAILED_SAMPLES = 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-eval",
        description="Measure a draft the way vLLM serves it: pooled MAL, per-position acceptance, WER, "
        "greedy equivalence.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(parser, "evaluation set (its validation input)")
    drafts = parser.add_argument_group("drafts")
    drafts.add_argument("--draft", help="draft export directory (config.json + model.safetensors) to evaluate")
    drafts.add_argument(
        "--baseline",
        help="a second draft export evaluated side by side on identical samples, target, prompt, K, precision "
        "and limits (e.g. the draft before adaptation)",
    )
    drafts.add_argument(
        "--mtp",
        action="store_true",
        help="also (or, without --draft, only) evaluate the MTP heads stored in the --target checkpoint, as vLLM's "
        "method 'mtp' serves them",
    )
    drafts.add_argument(
        "--num-speculative-tokens", "-k", type=int,
        help="K, proposals per round (default: block_size - 1 for a draft, the trained head count for --mtp)",
    )
    add_data_arguments(parser)
    add_decoding_arguments(parser, max_new_tokens=128)
    add_debug_argument(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", help="write the full report (aggregates, every sample, settings) to this file")
    out.add_argument("--plot", help="write the per-position acceptance PNG here (default: the --json path with .png)")
    out.add_argument(
        "--rerun-failed",
        metavar="REPORT",
        help="re-evaluate the failed samples of a previous --json report under its exact settings, keep their ids, "
        "merge them in and write the report back (to --json when given); no other option applies",
    )
    return parser


def _run(args: argparse.Namespace):
    from dflash_train.evaluate.report import EvalReport
    from dflash_train.evaluate.run import BASELINE, DRAFT, MTP, TARGET_MTP_HEADS, evaluate, prepare, rerun_failed

    if args.rerun_failed:
        own = ("target", "config_name", "draft", "baseline", "mtp", "cuts", "manifest")
        given = [flag for flag in own if getattr(args, flag)]
        if given:
            raise UsageError(f"--rerun-failed takes its settings from the report; drop --{given[0].replace('_', '-')}")
        report = rerun_failed(EvalReport.read_json(args.rerun_failed))
        return report, Path(args.json or args.rerun_failed)
    if not args.draft and not args.mtp:
        raise UsageError("--draft (a draft export directory) or --mtp (the target's own MTP heads) is required")
    drafts = {DRAFT: args.draft} if args.draft else {}
    drafts.update({**({BASELINE: args.baseline} if args.baseline else {}), **({MTP: TARGET_MTP_HEADS} if args.mtp else {})})
    settings, loaded = prepare(
        target_source(args),
        drafts,
        input_config(args),
        prompt_format=args.prompt_format,
        system_prompt=args.system_prompt,
        num_speculative_tokens=args.num_speculative_tokens,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=args.stop_token_id,
        dtype=args.dtype,
        perception_dtype=args.perception_dtype,
        device=device(args),
        limit=args.limit,
        sample_ids=args.sample_id,
    )
    report = evaluate(settings, loaded)
    if report.expected == 0:
        raise UsageError("no sample selected: the input is empty or --sample-id / --limit match nothing")
    return report, Path(args.json) if args.json else None


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    configure_console()
    return run_command("dflash-eval", lambda: _evaluate(args), args.debug, EXIT_USAGE)


def _evaluate(args: argparse.Namespace) -> int:
    for flag in ("json", "plot"):
        if getattr(args, flag):
            check_writable_file(getattr(args, flag), f"the --{flag} output")
    report, json_path = _run(args)
    return publish(report, json_path, args.plot)


def publish(report: EvalReport, json_path: Optional[Path], plot_path: Optional[str | Path] = None) -> int:
    """Print ``report``'s table, write its JSON (``json_path``) and its plot (``plot_path``, default: the
    JSON path with ``.png``), naming both; returns the exit status (see the module docstring)."""
    print(report.format_table())
    if json_path is not None:
        print(f"report: {report.write_json(json_path)}")
    plot_path = plot_path or (json_path.with_suffix(".png") if json_path is not None else None)
    if plot_path is not None:
        print(f"plot: {report.plot(plot_path)}")
    if any(report.mismatches(name) for name in report.draft_names):
        return EXIT_MISMATCH
    return EXIT_FAILED_SAMPLES if report.provisional else 0


if __name__ == "__main__":
    sys.exit(main())
