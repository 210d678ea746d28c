"""Draft models (the variant's nemo_automodel classes): build, warm start, attention, export."""

from dflash_train.draft.build import DraftSpec, build_draft, build_draft_config, build_trainer_core
from dflash_train.draft.export import (
    DraftExportError,
    full_state_dict,
    load_export,
    verify_export,
    write_export,
)

__all__ = [
    "DraftExportError",
    "DraftSpec",
    "build_draft",
    "build_draft_config",
    "build_trainer_core",
    "full_state_dict",
    "load_export",
    "verify_export",
    "write_export",
]
