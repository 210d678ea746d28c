"""Draft models (nemo_automodel's DFlash / DFlash2 classes): build, warm start, export."""

from dflash_train.draft.build import DraftSpec, build_draft, build_draft_config, build_trainer_core
from dflash_train.draft.export import (
    DraftExportError,
    full_state_dict,
    load_export,
    verify_export,
    write_export,
)
from dflash_train.draft.variants import ARCHITECTURE_ALIASES, VARIANT_REGISTRY, DraftVariant

__all__ = [
    "ARCHITECTURE_ALIASES",
    "DraftExportError",
    "DraftSpec",
    "DraftVariant",
    "VARIANT_REGISTRY",
    "build_draft",
    "build_draft_config",
    "build_trainer_core",
    "full_state_dict",
    "load_export",
    "verify_export",
    "write_export",
]
