"""``dflash-plan``: will the recipe fit on a GPU, and how fast can its step be, before any GPU or weight.

    dflash-plan --config-dir D --config-name N [overrides] --gpu {h100,h200,a100-80g,b200}
                --gpus-per-node G --nodes K [--json OUT]

The run is composed and checked exactly as ``dflash-train`` composes and checks it before loading
weights (:func:`~dflash_train.cli.train.check_before_loading`), with ``trainer.devices=G`` and
``trainer.num_nodes=K``; then :func:`~dflash_train.plan.plan_run` builds target and draft from their
config files under fake tensors and runs the recipe's step twice on the worst batch over a fake
process group of G·K ranks. It prints the per-rank peak memory by category against the GPU (and, when
it does not fit, the knob values that do), FLOPs and collective bytes by phase, and a roofline lower
bound of the step time; ``--json`` writes all of it as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from dflash_train.cli.common import add_debug_argument, run_command
from dflash_train.cli.console import configure_console
from dflash_train.errors import ConfigError

EXIT_USAGE = 2
GPU_CHOICES = ("h100", "h200", "a100-80g", "b200")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``dflash-plan``."""
    parser = argparse.ArgumentParser(prog="dflash-plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config-dir", default=None, help="searched before the shipped recipe (as dflash-train)")
    parser.add_argument("--config-name", default="dflash", help="the run config to compose (default: dflash)")
    parser.add_argument("--gpu", required=True, choices=GPU_CHOICES, help="the GPU to plan for")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (default 8)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the plan as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as dflash-train takes them")
    add_debug_argument(parser)
    return parser


def _check_arguments(args: argparse.Namespace) -> None:
    """Sizes and paths the plan needs, checked before anything is composed or built."""
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={args.gpus_per_node}: give the number of GPUs per node (1 or more)")
    if args.nodes < 1:
        raise ConfigError(f"--nodes={args.nodes}: give the number of nodes (1 or more)")
    if args.config_dir is not None and not Path(args.config_dir).is_dir():
        raise ConfigError(f"--config-dir={args.config_dir} is not a directory; point it at the run configs (e.g. conf)")
    if args.json is not None and not args.json.parent.is_dir():
        raise ConfigError(f"--json={args.json}: its directory {args.json.parent} does not exist; create it first")


def plan_command(args: argparse.Namespace) -> int:
    """Compose, check, plan, print (and write the JSON)."""
    from dflash_train.cli.train import check_before_loading, check_override_keys
    from dflash_train.config import missing_keys, validate_config
    from dflash_train.config.compose import compose_config
    from dflash_train.plan import plan_run, weights_optional
    from dflash_train.plan.advice import fit_advice

    _check_arguments(args)
    check_override_keys(args.overrides)
    world = args.gpus_per_node * args.nodes
    overrides = [*args.overrides, f"trainer.devices={args.gpus_per_node}", f"trainer.num_nodes={args.nodes}"]
    cfg = compose_config(args.config_name, overrides, args.config_dir)
    missing = missing_keys(cfg)
    if missing:
        raise ConfigError(f"mandatory values not set (???): {', '.join(missing)}; set them as overrides "
                          f"(e.g. {missing[0]}=...)")
    with weights_optional():
        finished = check_before_loading(cfg)
    if finished is not None:
        print(f"dflash-plan: {finished.report()[0]} (nothing left to train: no plan)")
        return 0
    plan = plan_run(validate_config(cfg), args.gpu, world, args.gpus_per_node)

    def plan_with(override: str):
        changed = compose_config(args.config_name, [*overrides, override], args.config_dir)
        return plan_run(validate_config(changed), args.gpu, world, args.gpus_per_node)

    plan.advice = fit_advice(plan, plan_with)
    print("\n".join(plan.table()))
    if args.json is not None:
        args.json.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
        print(f"plan: {args.json}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Console entry point: 0 when the plan was made (fitting or not), 2 on bad input."""
    args = build_parser().parse_args(argv)
    configure_console()
    return run_command("dflash-plan", lambda: plan_command(args), args.debug, EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
