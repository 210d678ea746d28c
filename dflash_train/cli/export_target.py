"""``dflash-export-target``: write a SALM checkpoint as a directory vLLM serves with our plugin.

What the directory holds, and why: :mod:`dflash_train.target.vllm_export` (docs/serving.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.files import check_writable_directory
from dflash_train.target.vllm_export import draft_method, draft_speculative_tokens, export_target, serve_command


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (2: bad input, nothing written)."""
    parser = argparse.ArgumentParser(prog="dflash-export-target", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="SALM checkpoint directory (SALM.save_pretrained layout)")
    parser.add_argument("out", help="directory to write (may equal source: rewrite in place)")
    parser.add_argument("--draft", help="a draft export: also print the vllm serve command for both")
    add_debug_argument(parser)
    args = parser.parse_args(argv)
    configure_console()

    def body() -> int:
        k = draft_speculative_tokens(args.draft) if args.draft else None  # a bad --draft fails before writing
        check_writable_directory(args.out, "the vLLM-ready target")
        out = export_target(args.source, args.out)
        print(f"dflash-export-target: wrote {out}")
        if args.draft:
            print(serve_command(out, Path(args.draft).resolve(), k, method=draft_method(args.draft)))
        return 0

    return run_command("dflash-export-target", body, args.debug)


if __name__ == "__main__":
    sys.exit(main())
