"""The draft variants, one module each, registered in :data:`VARIANTS`.

Adding a variant means adding a module that subclasses
:class:`~dflash_train.variants.base.DraftVariant` and listing its instance here
(docs/development.md, Adding a draft variant).
"""

from __future__ import annotations

from dflash_train.errors import ConfigError
from dflash_train.variants.base import ANCHOR_BUDGETS, DFlashConfig, DraftVariant, TargetDims
from dflash_train.variants.dflash import DFLASH
from dflash_train.variants.dflash2 import DFLASH2, DFlash2Config
from dflash_train.variants.eagle3 import EAGLE3_VARIANT, Eagle3Config
from dflash_train.variants.mtp import MTP_VARIANT, MTPConfig

VARIANTS: dict[str, DraftVariant] = {variant.name: variant for variant in (DFLASH, DFLASH2, MTP_VARIANT, EAGLE3_VARIANT)}

ARCHITECTURE_ALIASES: dict[str, str] = {
    alias: variant.export_architecture for variant in VARIANTS.values() for alias in variant.architecture_aliases
}
"""Training-time class names -> the architecture name vLLM serves."""


def variant_named(name: str) -> DraftVariant:
    """The registered variant ``name`` (``dflash.variant``); a one-line error naming the choices."""
    if name not in VARIANTS:
        raise ConfigError(f"dflash.variant='{name}' is not a known variant; choose one of {sorted(VARIANTS)}")
    return VARIANTS[name]


def variant_for_architecture(architecture: str) -> DraftVariant:
    """The variant whose export (or training-time alias) carries ``architecture``."""
    canonical = ARCHITECTURE_ALIASES.get(architecture, architecture)
    for variant in VARIANTS.values():
        if variant.export_architecture == canonical:
            return variant
    known = sorted({*ARCHITECTURE_ALIASES, *(v.export_architecture for v in VARIANTS.values())})
    raise ValueError(f"'{architecture}' is not a DFlash draft architecture ({known})")


__all__ = [
    "ANCHOR_BUDGETS",
    "ARCHITECTURE_ALIASES",
    "DFlash2Config",
    "DFlashConfig",
    "DraftVariant",
    "Eagle3Config",
    "MTPConfig",
    "TargetDims",
    "VARIANTS",
    "variant_for_architecture",
    "variant_named",
]
