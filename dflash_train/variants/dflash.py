"""DFlash: a block-diffusion draft proposing a whole block per round from tapped target features."""

from __future__ import annotations

from dflash_train.variants.base import DraftVariant, automodel_speculative_dflash


class DFlash(DraftVariant):
    """The base method: argmax proposals, the decayed block cross-entropy, no extra keys."""

    name = "dflash"
    export_architecture = "DFlashDraftModel"
    architecture_aliases = ("Qwen3DFlashDraftModel", "DFlashQwen3DFlashDraftModel")

    def load_classes(self):
        dflash = automodel_speculative_dflash()
        return dflash.Qwen3DFlashDraftModel, dflash.DFlashTrainerModule


DFLASH = DFlash()
