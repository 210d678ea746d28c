"""The variant registry: everything that differs between DFlash and DFlash2 lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from dflash_train.config.schema import DFlash2Config, DFlashConfig


@dataclass(frozen=True)
class DraftVariant:
    """How one draft method is built, trained and exported.

    ``draft_cls`` / ``trainer_cls`` are nemo_automodel's draft model and trainer core;
    ``export_architecture`` is the class name vLLM's registry knows; ``extra_config_keys``
    are the ``dflash.*`` keys copied into the exported ``dflash_config``; ``serving_note`` is what
    a user must know before serving the export.
    """

    name: str
    export_architecture: str
    extra_config_keys: tuple[str, ...]
    trainer_kwargs: Callable[[DFlashConfig], dict]
    load_classes: Callable[[], tuple[type[nn.Module], type[nn.Module]]]
    serving_note: str = ""


def _dflash_classes():
    from nemo_automodel.components.speculative.dflash import DFlashTrainerModule, Qwen3DFlashDraftModel

    return Qwen3DFlashDraftModel, DFlashTrainerModule


def _dflash2_classes():
    from nemo_automodel.components.speculative.dflash import DFlash2TrainerModule, Qwen3DFlash2DraftModel

    return Qwen3DFlash2DraftModel, DFlash2TrainerModule


def _dflash2_trainer_kwargs(cfg: DFlashConfig) -> dict:
    assert isinstance(cfg, DFlash2Config)
    return {"selector_loss_weight": cfg.selector_loss_weight}


VARIANT_REGISTRY: dict[str, DraftVariant] = {
    "dflash": DraftVariant(
        name="dflash",
        export_architecture="DFlashDraftModel",
        extra_config_keys=(),
        trainer_kwargs=lambda cfg: {},
        load_classes=_dflash_classes,
    ),
    "dflash2": DraftVariant(
        name="dflash2",
        export_architecture="DFlash2DraftModel",
        extra_config_keys=("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
        trainer_kwargs=_dflash2_trainer_kwargs,
        load_classes=_dflash2_classes,
        serving_note=(
            "vLLM serves DFlash2 drafts only with its V2 model runner (GPU, Triton); "
            "for vLLM's CPU build train a DFlash draft (dflash=dflash)"
        ),
    ),
}

# Training-time class names that mean the same architecture as vLLM's names.
ARCHITECTURE_ALIASES = {
    "Qwen3DFlashDraftModel": "DFlashDraftModel",
    "DFlashQwen3DFlashDraftModel": "DFlashDraftModel",
    "Qwen3DFlash2DraftModel": "DFlash2DraftModel",
    "DFlashQwen3DFlash2DraftModel": "DFlash2DraftModel",
}


def variant_for_architecture(architecture: str) -> DraftVariant:
    """The variant whose export (or training-time alias) carries ``architecture``."""
    canonical = ARCHITECTURE_ALIASES.get(architecture, architecture)
    for variant in VARIANT_REGISTRY.values():
        if variant.export_architecture == canonical:
            return variant
    raise ValueError(f"'{architecture}' is not a DFlash draft architecture ({sorted(ARCHITECTURE_ALIASES)})")
