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

``--endpoint [NAME=]URL`` measures a server that is already running (``vllm serve`` with the
plugin, with whatever flags the deployment uses) instead of starting an engine: the same
requests through its OpenAI chat API, streamed (TTFT, TPOT), acceptance from its Prometheus
``/metrics`` counters over each phase, its vLLM version and K recorded. The target alone is a
second server (``--baseline-endpoint URL``) or a saved report of it (``--baseline REPORT``);
``--target`` is then a local copy of the served checkpoint, read for its tokenizer and chat
template only.

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
    served.add_argument("--target", required=True,
                        help="vLLM-ready SALM directory (dflash-export-target's output); with --endpoint a local copy "
                        "of the served one (tokenizer and chat template)")
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
    server = parser.add_argument_group("a running server instead of an in-process engine")
    server.add_argument("--endpoint", metavar="[NAME=]URL",
                        help="base URL of a running vLLM server to measure (http://HOST:PORT); NAME defaults to "
                        "'speculative' when it speculates, else target_only")
    server.add_argument("--baseline-endpoint", metavar="URL",
                        help="with --endpoint: a server of the same target without speculation (speed-up, equality)")
    server.add_argument("--baseline", metavar="REPORT",
                        help="with --endpoint: the report.json of an earlier run of the target alone on the same "
                        "requests, used as the baseline")
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
    from dflash_train.target.vllm_export import draft_method, draft_speculative_tokens
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
        configs.append(ServedConfig(name, draft_method(path), str(Path(path).resolve()), k, export_training_step(path)))
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
    if args.endpoint is None and (args.baseline_endpoint or args.baseline):
        raise UsageError("--baseline-endpoint and --baseline go with --endpoint (a running server to measure)")
    levels = _levels(args.concurrency)
    for flag, value in (("--repeats", args.repeats), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be >= 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup} must be >= 0")
    inp = input_config(args)
    if inp is None:
        raise UsageError("--cuts or --manifest is required: the audio requests to serve")
    if args.endpoint is not None:
        return _run_endpoint(args, inp, levels)
    overrides = _engine_overrides(args.engine_arg)
    configs = _drafts(args)

    import torch
    import vllm

    from dflash_train.vllm_plugin.bench import BenchPlan, engine_args, run_bench, target_only

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    requests, failures = _requests(args, inp)
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
        **_settings(args, inp, levels),
        "target": plan.target,
        "warmup": plan.warmup,
        "dtype": args.dtype,
        "device": device,
        "max_num_seqs": max(levels),
        "engine_args": dict(plan.engine_args),
        "vllm_version": vllm.__version__,
    }
    return _write(run_bench(plan, requests, failures, settings), Path(args.out))


def _requests(args: argparse.Namespace, inp) -> tuple[list, list]:
    """The serving requests of the selected records and the records that could not become one."""
    from transformers import AutoTokenizer

    from dflash_train.evaluate.requests import RequestFailure
    from dflash_train.vllm_plugin.serving import read_serving_requests

    selected = read_serving_requests(
        inp, AutoTokenizer.from_pretrained(args.target), args.limit, args.prompt_format or "qwen",
        args.system_prompt, set(args.sample_id) if args.sample_id else None,
    )
    requests = [r for r in selected if not isinstance(r, RequestFailure)]
    if not requests:
        raise UsageError("no request to serve: the input is empty, every record failed, or --sample-id / --limit "
                         "match nothing")
    return requests, [r for r in selected if isinstance(r, RequestFailure)]


def _settings(args: argparse.Namespace, inp, levels: list[int]) -> dict:
    """The settings both modes record: the command, the requests' selection and limits, the load."""
    return {
        "command": ["dflash-serve-bench", *_command_without_selection(sys.argv[1:] if args.argv is None else args.argv)],
        "input": inp.cuts_path or inp.manifest_filepath,
        "limit": args.limit,
        "sample_ids": args.sample_id,
        "max_tokens": args.max_tokens,
        "prompt_format": args.prompt_format or "qwen",
        "system_prompt": args.system_prompt,
        "concurrency": levels,
        "repeats": args.repeats,
    }


def _write(report, out: Path) -> int:
    """Write the report's JSON, table and plot to ``out``; the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    table = report.markdown()
    (out / "report.md").write_text(table)
    print(table)
    for path in (report.write_json(out / "report.json"), out / "report.md", report.plot(out / "report.png")):
        print(f"wrote {path}")
    if any(c.unservable for c in report.configs) and not [c for c in report.served() if c.num_speculative_tokens]:
        print("dflash-serve-bench: no draft could be served by the installed vLLM (reasons above)", file=sys.stderr)
    return EXIT_FAILED_REQUESTS if report.provisional else 0


def _run_endpoint(args: argparse.Namespace, inp, levels: list[int]) -> int:
    """``--endpoint``: measure running servers (module docstring)."""
    from dflash_train.files import read_json_object
    from dflash_train.target.vllm_export import AUDIO_LOCATOR_TAG
    from dflash_train.vllm_plugin import endpoint
    from dflash_train.vllm_plugin.bench import EndpointPlan, run_endpoint_bench
    from dflash_train.vllm_plugin.bench_report import TARGET_ONLY, ServeBenchReport, ServedConfig, check_comparable

    if args.draft or args.mtp is not None or args.engine_arg or args.device or args.num_speculative_tokens:
        raise UsageError("with --endpoint the server decides what is served: drop --draft, --mtp, -k, --device and "
                         "--engine-arg")
    if args.baseline_endpoint and args.baseline:
        raise UsageError("give one baseline: --baseline-endpoint URL or --baseline REPORT")
    name, sep, url = args.endpoint.rpartition("=")
    url = url if sep else args.endpoint
    try:
        measured = endpoint.probe(url)
        baseline_server = endpoint.probe(args.baseline_endpoint, "--baseline-endpoint") if args.baseline_endpoint else None
    except endpoint.EndpointError as err:
        raise UsageError(str(err)) from None
    k = measured.num_speculative_tokens
    config = ServedConfig(name or ("speculative" if k else TARGET_ONLY), "server" if k else None, None, k, None)
    servers = [(config, measured)]
    if baseline_server is not None:
        if baseline_server.num_speculative_tokens:
            raise UsageError(f"--baseline-endpoint {baseline_server.url} speculates (K="
                             f"{baseline_server.num_speculative_tokens}): the baseline is the target alone")
        if config.name == TARGET_ONLY:
            raise UsageError(f"--endpoint {measured.url} does not speculate: nothing to compare with the baseline")
        servers.insert(0, (ServedConfig(TARGET_ONLY), baseline_server))
    requests, failures = _requests(args, inp)
    settings = {
        **_settings(args, inp, levels),
        "mode": "endpoint",
        "target": measured.model,
        "endpoints": {c.name: s.url for c, s in servers},
        "warmup": max(min(args.warmup, len(requests)), 1),
        "dtype": "as served",
        "device": "server",
        "max_num_seqs": None,
        "vllm_version": measured.vllm_version,
        "num_speculative_tokens": k,
    }
    baseline = None
    if args.baseline:
        baseline = ServeBenchReport.from_dict(read_json_object(args.baseline, "point --baseline at a report.json "
                                                                               "that dflash-serve-bench wrote"))
        if not any(p.config == TARGET_ONLY for p in baseline.phases):
            raise UsageError(f"--baseline {args.baseline} has no {TARGET_ONLY} measurement")
        check_comparable(baseline, ServeBenchReport(settings, {r.id: r.reference for r in requests}, failures, [], []),
                         (args.baseline, "this run"))
        settings["baseline_report"] = str(Path(args.baseline).resolve())
    plan = EndpointPlan(servers, args.max_tokens, levels, args.repeats, settings["warmup"], AUDIO_LOCATOR_TAG)
    try:
        report = run_endpoint_bench(plan, requests, failures, settings)
    except endpoint.EndpointError as err:
        raise UsageError(str(err)) from None
    if baseline is not None:
        report.adopt_baseline(baseline)
    return _write(report, Path(args.out))


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
