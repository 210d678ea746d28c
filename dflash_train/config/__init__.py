"""Typed schema of the Hydra recipe and its validation (unknown keys, types, cross-field rules)."""

from dflash_train.config.schema import (
    DataConfig,
    DatasetConfig,
    ExpManagerConfig,
    ModelConfig,
    ParallelismConfig,
    RunConfig,
    TrainerConfig,
)
from dflash_train.config.validate import missing_keys, read_resolved_config, validate_config

__all__ = [
    "DataConfig",
    "DatasetConfig",
    "ExpManagerConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RunConfig",
    "TrainerConfig",
    "missing_keys",
    "read_resolved_config",
    "validate_config",
]
