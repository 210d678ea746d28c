"""``dflash-report``: write a run's ``report.md`` and its figures from what the run directory holds.

    dflash-report RUN_DIR [--serve-target DIR]

``dflash-train`` writes the same report when training ends; this command rewrites it at any time
(during training, after a resume, after copying a run directory). What it holds:
:mod:`dflash_train.training.report`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``dflash-report``."""
    parser = argparse.ArgumentParser(prog="dflash-report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory dflash-train wrote")
    parser.add_argument("--serve-target", default=None,
                        help="the vLLM-ready target directory (dflash-export-target) for the report's serve command")
    add_debug_argument(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point: 0 on success, 2 when the directory holds no run to report."""
    args = build_parser().parse_args(argv)
    configure_console()

    def write() -> int:
        from dflash_train.training.report import write_run_report

        print(f"report: {write_run_report(args.run_dir, args.serve_target)}")
        return 0

    return run_command("dflash-report", write, args.debug, EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
