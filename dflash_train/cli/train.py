"""``dflash-train``: compose the Hydra recipe, validate it, load the frozen target, train.

Hydra's own flags work as usual (``--config-name``, ``--config-dir``, ``--cfg job --resolve``,
overrides). With ``--cfg`` the composed config is printed and mandatory values that are
still ``???`` are listed by key on stderr; nothing is built.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dflash_train.cli.console import configure_console, console_level
from dflash_train.config import missing_keys, validate_config
from dflash_train.constants import CONFIG_DIR
from dflash_train.errors import ConfigError
from dflash_train.training.launch import launch_stamp

log = logging.getLogger("dflash_train")

# ${dflash_launch_stamp:} in hydra.run.dir: one directory for all ranks of a launch.
OmegaConf.register_new_resolver("dflash_launch_stamp", launch_stamp, use_cache=True, replace=True)
# ${dflash_console_level:} in hydra.job_logging: INFO on rank 0, WARNING on the other ranks.
OmegaConf.register_new_resolver("dflash_console_level", console_level, replace=True)


def run(cfg: DictConfig) -> None:
    """Validate the recipe, train the draft, print where the export is and how to serve it."""
    validated = validate_config(cfg)
    from dflash_train.training.recipe import train

    summary = train(validated)
    for line in summary.report(validated.run):
        log.info(line)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="dflash")
def _hydra_main(cfg: DictConfig) -> None:
    """One line on stderr and exit status 1 for bad input or config (``HYDRA_FULL_ERROR=1``: the traceback)."""
    from dflash_train.cli.common import describe, user_errors

    try:
        run(cfg)
    except (*user_errors(), OSError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        prefix = "config error" if isinstance(err, ConfigError) else "error"
        raise SystemExit(f"{prefix}: {describe(err)}") from None


def _report_missing_after_show_cfg() -> None:
    if not HydraConfig.initialized():
        return
    # Hydra keeps the composed job config as the parent of its own `hydra` node.
    full = HydraConfig.instance().cfg.hydra._get_parent()
    job = OmegaConf.masked_copy(full, [k for k in full.keys() if k != "hydra"])
    missing = missing_keys(job)
    if missing:
        print(f"# mandatory values not set (???): {', '.join(missing)}", file=sys.stderr)


def main() -> None:
    """Console entry point (``dflash-train``, ``python -m dflash_train``, ``torchrun -m dflash_train``)."""
    configure_console()
    _hydra_main()
    if any(arg in ("--cfg", "-c") or arg.startswith("--cfg=") for arg in sys.argv[1:]):
        _report_missing_after_show_cfg()
