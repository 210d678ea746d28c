"""Which checkpoint a run exports: its last step, or its best validated checkpoint.

``exp_manager.export_checkpoint: best`` exports the checkpoint Lightning's ``ModelCheckpoint`` keeps as
the best by ``exp_manager.checkpoint_monitor`` / ``checkpoint_mode`` instead of the last step: a draft's
serving acceptance can fall late in a run (issue 49: 0.37 serving MAL between the best validated step and
the last one), and the export is what serving gets. The best-so-far is part of every checkpoint (the
callback's state), so a preempted and resumed run still exports the best step of the whole run.

What a monitor may name is checked before any weight loads (config/metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dflash_train.config.schema import RunConfig
from dflash_train.draft.export import full_state_dict
from dflash_train.errors import InputFileError
from dflash_train.training.lifecycle import ValidationRecord


@dataclass(frozen=True)
class ExportedCheckpoint:
    """The weights an export holds and why: the step, the draft's state, the validation record of that step,
    and how it was chosen (``training_info.exported_checkpoint``)."""

    step: int
    state: dict
    validation: dict
    choice: dict

    def describe(self, trained_steps: int) -> Optional[str]:
        """What the run summary says after ``export:`` (``None``: the last step, as asked)."""
        if self.choice["choice"] == "last":
            return f"the last step, {trained_steps}: {self.choice['reason']}" if "reason" in self.choice else None
        return (f"the best validated checkpoint by {self.choice['monitor']} ({self.choice['mode']}): step {self.step}, "
                f"{self.choice['score']:.4f}; trained to step {trained_steps}")


def best_checkpoint_callback(trainer: L.Trainer, monitor: str) -> Optional[ModelCheckpoint]:
    """The run's ``ModelCheckpoint`` that keeps the best checkpoints by ``monitor`` (``None``: the run keeps none)."""
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor == monitor),
                None)


def read_best_checkpoint(path: Path, prefix: str, monitor: str, mode: str, score: float) -> ExportedCheckpoint:
    """The draft's weights (the module's state-dict entries under ``prefix``) and the validation record stored in
    the best checkpoint ``path``.

    The record is :class:`ValidationRecord`'s state in that checkpoint: the figures validation logged at
    the checkpoint's step (the best checkpoint is written after the validation that scored it)."""
    checkpoint = torch.load(str(path), map_location="cpu", mmap=True, weights_only=False)
    step = int(checkpoint["global_step"])
    record = ValidationRecord()
    record.load_state_dict(checkpoint.get("callbacks", {}).get(record.state_key, {}))
    if record.step != step:
        raise InputFileError(f"{path}: the best checkpoint of step {step} holds the validation record of step "
                             f"{record.step}; it was not written after its validation")
    state = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    choice = {"choice": "best", "monitor": monitor, "mode": mode, "score": score, "checkpoint": path.name}
    return ExportedCheckpoint(step, state, record.training_info(), choice)


def draft_prefix(pl_module: torch.nn.Module, draft: torch.nn.Module) -> str:
    """Where ``draft`` sits in ``pl_module``'s state dict (``core.draft_model.``, ...)."""
    return next(f"{name}." for name, module in pl_module.named_modules() if module is draft and name)


def choose_export(trainer: L.Trainer, pl_module, run: RunConfig, last: Optional[ValidationRecord]) -> ExportedCheckpoint:
    """What the export of a finished run holds, on every rank.

    ``exp_manager.export_checkpoint=last``: the draft as training left it (a collective under FSDP2: every
    rank calls this; rank 0 receives the state) with the last validation's record. ``best``: the best
    checkpoint's draft weights and record, read by every rank from the file rank 0 wrote; when no validation
    ran, the last step, saying so."""
    em = run.exp_manager
    choice: dict = {"choice": "last"}
    if em.export_checkpoint == "best":
        callback = best_checkpoint_callback(trainer, em.checkpoint_monitor)
        if callback is not None and callback.best_model_path and callback.best_model_score is not None:
            return read_best_checkpoint(Path(callback.best_model_path), draft_prefix(pl_module, pl_module.draft),
                                        em.checkpoint_monitor, em.checkpoint_mode, float(callback.best_model_score))
        choice["reason"] = f"exp_manager.export_checkpoint=best but no checkpoint was validated on {em.checkpoint_monitor}"
    record = last.training_info() if last is not None else {}
    return ExportedCheckpoint(trainer.global_step, full_state_dict(pl_module.draft), record, choice)
