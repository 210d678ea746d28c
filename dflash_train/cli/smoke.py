"""``dflash-smoke``: the runbook's smoke run on the user's own recipe, checked item by item.

    dflash-smoke --config-name N [--config-dir D] [Hydra overrides] [--steps 25] [--out DIR]
    torchrun --standalone --nproc_per_node=8 -m dflash_train.cli.smoke --config-name N trainer.devices=8 ...

Launched as training is launched (plain, or under ``torchrun`` at any world size), it trains the recipe
for ``--steps`` steps into a fresh directory beside the run directory (never the run directory itself),
validates, checkpoints, stops half-way and resumes exactly, exports and reloads the export strictly, then
prints one checklist table (each item pass / fail with its evidence) and the figures (step time by
phase, tokens/s, MFU, memory, host syncs, recompiles). ``smoke.json`` and ``smoke.md`` are written into
the out directory. Exit status: 0 when every item passed, 1 when one failed (named on the last line),
2 for bad input (one line naming the key or file, before anything loads). What runs:
:mod:`dflash_train.smoke`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.smoke.run import DEFAULT_STEPS

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``dflash-smoke``: ``dflash-train``'s recipe arguments, the step budget, the out directory."""
    parser = argparse.ArgumentParser(prog="dflash-smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--config-name", required=True, help="the run config, as dflash-train --config-name takes it")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="searched before the shipped recipe, as dflash-train --config-dir")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"optimizer steps of the smoke (stopped and resumed at half); default {DEFAULT_STEPS}")
    parser.add_argument("--out", type=Path, default=None,
                        help="a fresh directory for the smoke's runs and report (default: beside the run directory, "
                             "<run dir>-smoke-<launch time>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as dflash-train takes them (key=value)")
    add_debug_argument(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point: 0 when every checklist item passed, 1 when one failed, 2 for bad input."""
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after the flags, as Hydra takes them
    configure_console()

    def smoke() -> int:
        from dflash_train.cli.train import check_override_keys, check_before_loading
        from dflash_train.smoke.run import SmokeRequest, plan_smoke, run_smoke

        check_override_keys(args.overrides)  # a typo'd key: named with its nearest valid key, as dflash-train does
        request = SmokeRequest(args.config_name, tuple(args.overrides), args.config_dir, args.steps, args.out)
        plan = plan_smoke(request)
        check_before_loading(plan.first_fit())  # every check dflash-train makes before the target's weights load
        return run_smoke(plan)

    return run_command("dflash-smoke", smoke, args.debug, EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
