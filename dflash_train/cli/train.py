"""``dflash-train``: compose the Hydra recipe, validate it, load the frozen target, train.

Hydra's own flags work as usual (``--config-name``, ``--config-dir``, ``--cfg job --resolve``,
overrides). ``--cfg job`` (or ``all``) is the config check: Hydra prints the composed config, then
every check a launch makes before its target's weights load runs on it
(:func:`check_before_loading`), and a failure exits as the launch would: the same one line on
stderr, exit status 1. While mandatory values are still ``???`` only the key check runs (the
others need the values) and the unset keys are listed. Nothing is built.

A plain command-line override of a key no schema field takes (``dflash.num_anchor=16``) fails
before Hydra composes, naming the nearest valid key, as a typo in a YAML file does. ``--config-dir``
is searched before the shipped recipe, as :func:`~dflash_train.config.compose.compose_config` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dflash_train.cli.common import describe, user_errors
from dflash_train.cli.console import configure_console, console_level
from dflash_train.config import missing_keys, validate_config
from dflash_train.config.validate import check_config_keys, check_override_key
from dflash_train.constants import CONFIG_DIR
from dflash_train.errors import ConfigError
from dflash_train.training.launch import hydra_log_root, launch_stamp

if TYPE_CHECKING:
    from dflash_train.training.lifecycle import FinishedRun

log = logging.getLogger("dflash_train")

# ${dflash_launch_stamp:} in hydra.run.dir: one directory for all ranks of a launch.
OmegaConf.register_new_resolver("dflash_launch_stamp", launch_stamp, use_cache=True, replace=True)
# ${dflash_run_dir:...} in hydra.run.dir: Hydra's per-launch logs inside the run's directory.
OmegaConf.register_new_resolver("dflash_run_dir", hydra_log_root, replace=True)
# ${dflash_console_level:} in hydra.job_logging: INFO on rank 0, WARNING on the other ranks.
OmegaConf.register_new_resolver("dflash_console_level", console_level, replace=True)


def run(cfg: DictConfig) -> None:
    """Validate the recipe, train the draft, print where the export is and how to serve it."""
    validated = validate_config(cfg)
    from dflash_train.training.recipe import train

    summary = train(validated)
    for line in summary.report(validated.run):
        log.info(line)


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """Bad input or config: one line on stderr and exit status 1 (``HYDRA_FULL_ERROR=1``: the traceback)."""
    try:
        yield
    except (*user_errors(), OSError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        prefix = "config error" if isinstance(err, ConfigError) else "error"
        raise SystemExit(f"{prefix}: {describe(err)}") from None


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="dflash")
def _hydra_main(cfg: DictConfig) -> None:
    """Launch the composed recipe; a bad input or config fails in one line (:func:`_one_line_errors`)."""
    with _one_line_errors():
        run(cfg)


def check_before_loading(cfg: DictConfig) -> Optional[FinishedRun]:
    """Every check a launch makes before its target's weights load, in the launch's order, with the
    launch's own functions, building nothing: the schema and rules (:func:`validate_config`), the
    attention backend (unless ``trainer.accelerator=auto`` on a machine without a GPU, where the
    launch's host decides), the data paths, the run directory, the checkpoint it resumes from
    against ``trainer.max_steps``, then taps, mask token, the variant's sizes and expert parallelism
    against the target's config files. Returns the finished run a launch would only report (it
    checks nothing further then), else ``None``."""
    import torch

    from dflash_train.data.validate import validate_data_config
    from dflash_train.target.load import check_target_for_run
    from dflash_train.training.lifecycle import check_launch
    from dflash_train.training.recipe import RunPaths, data_parallel_size, resolve_attention_backend

    run, trainer_kwargs = validate_config(cfg)
    accelerator = str(trainer_kwargs.get("accelerator", "auto"))
    if accelerator != "auto" or torch.cuda.is_available():
        resolve_attention_backend(run.dflash.attention_backend, accelerator)
    validate_data_config(run.data)
    paths = RunPaths.of(run)
    finished = check_launch(paths.resume_from, paths.export_dir, trainer_kwargs.get("max_steps"))
    if finished is None:
        check_target_for_run(run, data_parallel_size(run, trainer_kwargs))
    return finished


def _check_shown_config() -> None:
    """After ``--cfg job`` / ``--cfg all`` printed the composed config: the launch's checks on it; while
    ``???`` values are unset, the key check and the list of those keys."""
    # Hydra keeps the composed job config as the parent of its own `hydra` node.
    full = HydraConfig.instance().cfg.hydra._get_parent()
    job = OmegaConf.masked_copy(full, [k for k in full.keys() if k != "hydra"])
    missing = missing_keys(job)
    with _one_line_errors():
        if missing:
            check_config_keys(job)
        else:
            finished = check_before_loading(job)
    if missing:
        print(f"# mandatory values not set (???): {', '.join(missing)}; the other launch checks run once they are set",
              file=sys.stderr)
        return
    print("# config check passed: every check a launch makes before loading the target's weights", file=sys.stderr)
    if finished is not None:
        print(f"# {finished.report()[0]}", file=sys.stderr)


def _hydra_arguments(argv: list[str]) -> Optional[argparse.Namespace]:
    """The command line as ``@hydra.main`` reads it (its own parser), or ``None`` where Hydra will refuse it."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        return parser.parse_known_args(argv)[0]
    except argparse.ArgumentError:
        return None


def _user_configs_first(argv: list[str], args: argparse.Namespace) -> list[str]:
    """``argv`` with ``--config-dir`` made Hydra's primary config directory and the shipped recipe searched after
    it, as :func:`~dflash_train.config.compose.compose_config` composes. Hydra itself searches ``--config-dir``
    after the decorator's directory, so a run config named like a shipped one (the runbook's ``dflash_local``)
    would silently be the shipped one. Left as it is when ``--config-path`` or ``hydra.searchpath`` is given."""
    if args.config_dir is None or args.config_path is not None or any("hydra.searchpath" in o for o in args.overrides):
        return argv
    # the override joins the others: argparse takes one run of overrides
    at = max(i for i, arg in enumerate(argv) if arg == args.overrides[-1]) + 1 if args.overrides else 0
    return [f"--config-path={os.path.abspath(args.config_dir)}", *argv[:at], f"hydra.searchpath=[file://{CONFIG_DIR}]",
            *argv[at:]]


def check_override_keys(overrides: list[str]) -> None:
    """Each plain ``key=value`` override of a job key against the schema (:func:`check_override_key`).
    ``+key=value`` adds a key, which the composed config's check names; a malformed override is Hydra's to refuse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return
    for override in parsed:
        group_path = override.package is not None or "/" in override.key_or_group
        if override.type is OverrideType.CHANGE and not override.is_hydra_override() and not group_path:
            check_override_key(override.key_or_group)


def main() -> None:
    """Console entry point (``dflash-train``, ``python -m dflash_train``, ``torchrun -m dflash_train``)."""
    configure_console()
    args = _hydra_arguments(sys.argv[1:])
    if args is not None:
        with _one_line_errors():
            check_override_keys(args.overrides)
        sys.argv[1:] = _user_configs_first(sys.argv[1:], args)
    _hydra_main()
    if args is not None and args.cfg in ("job", "all"):
        _check_shown_config()
