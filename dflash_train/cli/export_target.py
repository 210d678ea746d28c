"""``dflash-export-target``: write a SALM checkpoint as a directory vLLM serves with our plugin.

What the directory holds, and why: :mod:`dflash_train.target.vllm_export` (docs/serving.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_train.target.vllm_export import TargetExportError, draft_speculative_tokens, export_target, serve_command


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="dflash-export-target", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="SALM checkpoint directory (SALM.save_pretrained layout)")
    parser.add_argument("out", help="directory to write (may equal source: rewrite in place)")
    parser.add_argument("--draft", help="a draft export: also print the vllm serve command for both")
    args = parser.parse_args(argv)
    try:
        out = export_target(args.source, args.out)
    except TargetExportError as err:
        print(f"dflash-export-target: error: {err}", file=sys.stderr)
        return 1
    print(f"dflash-export-target: wrote {out}")
    if args.draft:
        print(serve_command(out, Path(args.draft).resolve(), draft_speculative_tokens(args.draft)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
