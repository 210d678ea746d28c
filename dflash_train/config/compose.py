"""Compose the Hydra recipe outside ``dflash-train``: one helper for the demo, evaluation, benchmarks and tests.

``dflash-train`` composes through ``@hydra.main``; everything else goes through
:func:`compose_config`, so a recipe means the same thing wherever it is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from dflash_train.constants import CONFIG_DIR
from dflash_train.errors import ConfigError


def compose_config(config_name: str, overrides: Sequence[str] = (), config_dir: Optional[str | Path] = None) -> DictConfig:
    """The recipe ``config_name`` as ``dflash-train --config-dir --config-name <overrides>`` composes it.

    ``config_dir`` is searched first, then the shipped recipe (so a run config can inherit
    ``dflash``); a Hydra error becomes a one-line :class:`ConfigError`.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    primary = Path(config_dir).resolve() if config_dir else CONFIG_DIR
    extra = [f"hydra.searchpath=[file://{CONFIG_DIR}]"] if config_dir else []
    try:
        with initialize_config_dir(config_dir=str(primary), version_base="1.3"):
            return compose(config_name=config_name, overrides=[*extra, *overrides])
    except HydraException as err:
        raise ConfigError(f"cannot compose recipe '{config_name}': {str(err).splitlines()[0]}") from None
