"""``dflash-serve-bench``: does the draft make serving faster? Throughput, latency and acceptance through vLLM.

Serves the same audio requests with vLLM's engine and this project's plugin three ways
(the target alone, and with each given draft) at each ``--concurrency``, in one process on
one machine, and writes a report to ``--out``: ``report.json`` (every request's tokens,
timings and draft rounds; diff two runs), ``report.md`` (the deployment table) and
``report.png`` (acceptance per position, latency distributions). Per configuration and
concurrency: output tokens/s, requests/s, speed-up over target-only, latency p50/p90/p99,
time to first token, time per output token, pooled MAL, acceptance per position
(unconditional and conditional, in the JSON), greedy equality with target-only, WER,
evaluated / expected / failed / truncated requests, K and the export's training step.

Needs vLLM (on a GPU machine: ``pip install vllm``; on CPU the ``.venv-vllm`` test venv).

``dflash-serve-bench compare A/report.json B/report.json`` prints B's deltas against A (MAL,
acceptance per position, throughput, latency and WER per configuration and concurrency, greedy
outputs that differ by sample id), refusing two reports of different sample ids, input, limits,
precision, prompt or K with the differing field.

Exit status: 0 measured; 2 bad arguments or inputs; 3 some requests failed (aggregates are
provisional: the report prints the command that re-runs exactly those ids).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.evaluate.arguments import UsageError, add_data_arguments, input_config

EXIT_USAGE, EXIT_FAILED_REQUESTS = 2, 3
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"  # a sweep: where speculation stops paying


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-serve-bench",
        description="Serve the same audio requests through vLLM with and without drafts: throughput, latency, "
        "speed-up, acceptance, WER.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    served = parser.add_argument_group("what is served")
    served.add_argument("--target", required=True, help="vLLM-ready SALM directory (dflash-export-target's output)")
    served.add_argument(
        "--draft", action="append", default=[], metavar="[NAME=]EXPORT",
        help="a draft export directory served with method dflash (DFlash or DFlash2; repeatable); NAME defaults to "
        "the variant (dflash, dflash2)",
    )
    served.add_argument(
        "--mtp", type=int, metavar="K",
        help="also serve the target's own MTP heads with K proposals per round (vLLM method mtp)",
    )
    served.add_argument(
        "--num-speculative-tokens", "-k", type=int,
        help="K for every --draft (default: each export's block_size - 1, the value it was trained for)",
    )
    add_data_arguments(parser)
    load = parser.add_argument_group("load and engine")
    load.add_argument("--max-tokens", type=int, default=128, help="tokens per reply at most (default %(default)s)")
    load.add_argument(
        "--concurrency", default=DEFAULT_CONCURRENCY,
        help="comma-separated levels of requests kept in flight (default %(default)s)",
    )
    load.add_argument("--repeats", type=int, default=1, help="measure every configuration N times, interleaved")
    load.add_argument(
        "--warmup", type=int, default=2, help="requests served (not measured) after each engine starts (default 2)"
    )
    load.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default %(default)s)")
    load.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    load.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="a vLLM engine argument (VALUE parsed as JSON when it is JSON), e.g. max_model_len=2048 (repeatable)",
    )
    parser.add_argument("--out", required=True, help="directory for report.json, report.md and report.png")
    add_debug_argument(parser)
    return parser


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency {text!r}: give comma-separated positive integers, e.g. {DEFAULT_CONCURRENCY}")
    return sorted(set(levels))


def _engine_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--engine-arg {item!r}: write KEY=VALUE, e.g. max_model_len=2048")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _drafts(args: argparse.Namespace):
    """The speculative configurations: each --draft (name, export, K, training step), then --mtp."""
    from dflash_train.evaluate.loading import export_training_step
    from dflash_train.files import read_json_object
    from dflash_train.constants import CONFIG_FILE
    from dflash_train.target.vllm_export import draft_speculative_tokens
    from dflash_train.variants import variant_for_architecture
    from dflash_train.vllm_plugin.bench_report import TARGET_ONLY, ServedConfig

    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise UsageError(f"--num-speculative-tokens {args.num_speculative_tokens} must be >= 1")
    configs = []
    for item in args.draft:
        name, sep, path = item.rpartition("=")
        path = path if sep else item
        k = args.num_speculative_tokens or draft_speculative_tokens(path)
        if not name:
            config = read_json_object(Path(path) / CONFIG_FILE, "point --draft at a draft export")
            name = variant_for_architecture((config.get("architectures") or ["?"])[0]).name
        configs.append(ServedConfig(name, "dflash", str(Path(path).resolve()), k, export_training_step(path)))
    if args.mtp is not None:
        if args.mtp < 1:
            raise UsageError(f"--mtp {args.mtp}: K must be >= 1")
        configs.append(ServedConfig("mtp", "mtp", None, args.mtp, None))
    names = [c.name for c in configs]
    duplicate = next((n for n in names if names.count(n) > 1 or n == TARGET_ONLY), None)
    if duplicate:
        raise UsageError(f"two configurations are named {duplicate!r}: name them, e.g. --draft base={args.draft[0]}")
    if not configs:
        raise UsageError("nothing to compare: give --draft EXPORT (repeatable) and/or --mtp K")
    return configs


def _run(args: argparse.Namespace) -> int:
    from dflash_train.files import require_directory

    require_directory(args.target, "the vLLM-ready target (dflash-export-target's output)")
    levels = _levels(args.concurrency)
    overrides = _engine_overrides(args.engine_arg)
    for flag, value in (("--repeats", args.repeats), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be >= 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup} must be >= 0")
    inp = input_config(args)
    if inp is None:
        raise UsageError("--cuts or --manifest is required: the audio requests to serve")
    configs = _drafts(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import vllm
    from transformers import AutoTokenizer

    from dflash_train.evaluate.requests import RequestFailure
    from dflash_train.vllm_plugin.bench import BenchPlan, engine_args, run_bench, target_only
    from dflash_train.vllm_plugin.serving import read_serving_requests

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    selected = read_serving_requests(
        inp, AutoTokenizer.from_pretrained(args.target), args.limit, args.prompt_format or "qwen",
        args.system_prompt, set(args.sample_id) if args.sample_id else None,
    )
    requests = [r for r in selected if not isinstance(r, RequestFailure)]
    failures = [r for r in selected if isinstance(r, RequestFailure)]
    if not requests:
        raise UsageError("no request to serve: the input is empty, every record failed, or --sample-id / --limit "
                         "match nothing")
    plan = BenchPlan(
        target=str(Path(args.target).resolve()),
        configs=[target_only(), *configs],
        max_tokens=args.max_tokens,
        concurrency=levels,
        repeats=args.repeats,
        warmup=min(args.warmup, len(requests)),
        engine_args=engine_args(device, args.dtype, max(levels), overrides),
    )
    settings = {
        "command": ["dflash-serve-bench", *_command_without_selection(sys.argv[1:] if args.argv is None else args.argv)],
        "target": plan.target,
        "input": inp.cuts_path or inp.manifest_filepath,
        "limit": args.limit,
        "sample_ids": args.sample_id,
        "max_tokens": args.max_tokens,
        "prompt_format": args.prompt_format or "qwen",
        "system_prompt": args.system_prompt,
        "concurrency": levels,
        "repeats": args.repeats,
        "warmup": plan.warmup,
        "dtype": args.dtype,
        "device": device,
        "max_num_seqs": max(levels),
        "engine_args": dict(plan.engine_args),
        "vllm_version": vllm.__version__,
    }
    report = run_bench(plan, requests, failures, settings)
    table = report.markdown()
    (out / "report.md").write_text(table)
    print(table)
    for path in (report.write_json(out / "report.json"), out / "report.md", report.plot(out / "report.png")):
        print(f"wrote {path}")
    if not report.served()[1:]:
        print("dflash-serve-bench: no draft could be served by the installed vLLM (reasons above)", file=sys.stderr)
    return EXIT_FAILED_REQUESTS if report.provisional else 0


def _command_without_selection(argv: list[str]) -> list[str]:
    """The command line minus --sample-id (a re-run names its own ids), quoted for a shell."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--sample-id":
            skip = True
            continue
        if token.startswith("--sample-id="):
            continue
        kept.append(shlex.quote(token))
    return kept


def compare_main(argv: list[str]) -> int:
    """``dflash-serve-bench compare A/report.json B/report.json``: the delta table of B against A."""
    parser = argparse.ArgumentParser(prog="dflash-serve-bench compare",
                                     description="Compare two dflash-serve-bench reports of the same requests.")
    parser.add_argument("baseline", help="report.json of the baseline (A)")
    parser.add_argument("candidate", help="report.json to compare against it (B)")
    add_debug_argument(parser)
    args = parser.parse_args(argv)
    configure_console()

    def compare() -> int:
        from dflash_train.files import read_json_object
        from dflash_train.vllm_plugin.bench_report import ServeBenchReport, compare_reports

        fix = "point at a report.json that dflash-serve-bench wrote"
        reports = [ServeBenchReport.from_dict(read_json_object(path, fix)) for path in (args.baseline, args.candidate)]
        print(compare_reports(*reports, names=(args.baseline, args.candidate)), end="")
        return 0

    return run_command("dflash-serve-bench compare", compare, args.debug, EXIT_USAGE)


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point; returns the exit status (see the module docstring)."""
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["compare"]:
        return compare_main(given[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    configure_console()
    return run_command("dflash-serve-bench", lambda: _run(args), args.debug, EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
