"""Typed schema of the Hydra recipe and its validation (unknown keys, types, cross-field rules)."""

from dflash_train.config.schema import (
    VARIANTS,
    DataConfig,
    DatasetConfig,
    DFlash2Config,
    DFlashConfig,
    ExpManagerConfig,
    ModelConfig,
    ParallelismConfig,
    RunConfig,
    TrainerConfig,
)
from dflash_train.config.validate import missing_keys, validate_config

__all__ = [
    "DataConfig",
    "DatasetConfig",
    "DFlash2Config",
    "DFlashConfig",
    "ExpManagerConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RunConfig",
    "TrainerConfig",
    "VARIANTS",
    "missing_keys",
    "validate_config",
]
