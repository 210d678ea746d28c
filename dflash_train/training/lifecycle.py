"""A run's launches as a cluster makes them: started, preempted, requeued, resumed, re-run after it finished.

One step numbering everywhere: **step N is the state after N optimizer steps** (Lightning's
``global_step``). The console's lines, the logged metrics (CSV, TensorBoard, W&B: the metrics of
the N-th optimizer step and a validation after it are logged at step N), the run report, the
checkpoint names (``step=N``), ``run_info.json``'s ``start_step`` and the export's
``training_info.global_step`` all use it; a launch that resumes from a checkpoint of step S starts at
step S and makes step S + 1 first.

What Lightning leaves to the run and this module supplies:

- :func:`validation_schedule`: Lightning decides a validation step by the batch index within the
  epoch, and a checkpoint is written at a batch's end before Lightning counts that batch as
  completed: a resumed launch counted one batch short and validated one batch early on every later
  validation step (at step 21 instead of 30 after a resume at 20). The schedule counts optimizer
  steps over the whole run instead (``check_val_every_n_epoch=None``). A launch resuming from a
  checkpoint written at a validation step validates that step first (Lightning's rule: the launch
  that wrote the checkpoint may have stopped before validating, preempted or killed); the values
  equal the earlier launch's.
- :class:`StepCounters`: on a resume, counts the batch the checkpoint was written at as completed
  (Lightning counts it as processed only and restores the completed count, so the first resumed
  micro-batch took the last place of an accumulation window and the optimizer stepped after one
  micro-batch); keeps the logger's step equal to ``global_step``; logs each launch's start step
  (``launch/start_step``: the report marks resumes with it).
- :class:`ValidationRecord`: the step and figures of the last validation, kept in the checkpoint, so
  an export written by a launch that did not validate still records the figures and says from which
  step they are.
- :func:`check_launch`: before anything is built, a launch that would resume past ``max_steps`` is a
  one-line error, and a finished run (its export at ``max_steps``) is reported as finished and left
  as it is: a requeued job that already finished does no work and changes no file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from dflash_train.errors import ConfigError
from dflash_train.training.history import LAUNCH_START_METRIC

log = logging.getLogger(__name__)


def restored_step(checkpoint: Path) -> int:
    """The global step a Lightning checkpoint was saved at (memory-mapped: the weights are not read)."""
    state = torch.load(str(checkpoint), map_location="cpu", mmap=True, weights_only=False)
    return int(state.get("global_step", 0))


@dataclass(frozen=True)
class FinishedRun:
    """A run whose export already holds its last step: what a re-run of it reports."""

    export_dir: Path
    step: int
    figures: dict
    chosen: Optional[str] = None  # the export holds the best checkpoint's weights: by which metric, which step

    def report(self) -> list[str]:
        """The lines a re-run prints instead of training again."""
        recorded = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in self.figures.items())
        return [
            f"finished: the run reached trainer.max_steps={self.step}; nothing to do (raise trainer.max_steps to "
            "train further from its last checkpoint)",
            f"export: {self.export_dir} (step {self.step}" + (f", {self.chosen}" if self.chosen else "")
            + (f"; recorded {recorded})" if recorded else ")"),
        ]


def _export_info(export_dir: Path) -> Optional[dict]:
    from dflash_train.constants import CONFIG_FILE
    from dflash_train.files import read_json_object

    if not (export_dir / CONFIG_FILE).is_file():
        return None
    info = read_json_object(export_dir / CONFIG_FILE, "the run's export").get("training_info")
    return info if isinstance(info, dict) else None


def check_launch(resume_from: Optional[Path], export_dir: Path, max_steps: int) -> Optional[FinishedRun]:
    """Before a launch builds anything: :class:`FinishedRun` when the run it resumes already finished, a
    :class:`ConfigError` when ``max_steps`` is below the step it would resume from, else ``None`` (train)."""
    if resume_from is None or max_steps is None or max_steps < 0:
        return None
    step = restored_step(resume_from)
    if step > max_steps:
        raise ConfigError(
            f"trainer.max_steps={max_steps} is below step {step}, where {resume_from} resumes the run: set "
            f"trainer.max_steps >= {step}, or start a new run (another exp_manager.explicit_log_dir, or "
            "exp_manager.resume_if_exists=false)"
        )
    info = _export_info(export_dir) if step == max_steps else None
    # an export of the best checkpoint holds an earlier step's weights; trained_steps is where training ended
    # (exports written before it was recorded hold the last step: global_step)
    if info is None or info.get("trained_steps", info.get("global_step")) != step:
        return None  # not finished, or it stopped before writing its export: the launch writes it
    figures = {k: info[k] for k in ("val_step", "val_accept_len", "val_serving_mal") if info.get(k) is not None}
    choice = info.get("exported_checkpoint") or {}
    chosen = (f"the best by {choice['monitor']}: step {info['global_step']}" if choice.get("choice") == "best"
              else None)
    return FinishedRun(export_dir, step, figures, chosen)


def validation_schedule(trainer_kwargs: dict, accumulate: int) -> dict:
    """Lightning arguments that validate every ``val_check_interval`` optimizer steps of the whole run.

    The module accumulates gradients itself, so Lightning counts micro-batches: the interval is scaled by
    the accumulation; ``check_val_every_n_epoch=None`` counts them over the run, not within an epoch
    (which ``limit_train_batches`` ends and a resume restarts). A fractional interval (of an epoch) is
    Lightning's own and is left as it is."""
    every = trainer_kwargs.get("val_check_interval")
    if not isinstance(every, int) or isinstance(every, bool):
        return {}
    return {"val_check_interval": every * accumulate, "check_val_every_n_epoch": None}


def skip_validation(trainer: L.Trainer) -> None:
    """No validation after this batch although ``trainer.should_stop`` is set (Lightning validates on a stop
    request; a preempted launch stops between scheduled validations and must not add one)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    trainer.limit_val_batches = 0  # a validation loop not set up yet sets itself up with none
    val_loop._max_batches = [0] * len(val_loop._max_batches)  # one already set up keeps its counts


class StepCounters(Callback):
    """Lightning's batch counters as the checkpoint left them (see the module docstring), the logger's step
    equal to ``global_step`` (Lightning's own counter is one behind during a batch and
    restarts from the wrong value on a resume), and the launch's start logged as ``launch/start_step`` and, on
    a resume from ``ckpt_path``, said on the console with the restored learning rate."""

    def __init__(self, ckpt_path: Optional[Path]):
        self.ckpt_path = ckpt_path

    @staticmethod
    def _keep_logger_step(trainer: L.Trainer) -> None:
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.ckpt_path is not None:
            # the checkpoint was written at a batch's end, before Lightning counted the batch as completed; on restore
            # it goes back to that count, and the next batch_idx (the micro-batch's place in its accumulation window)
            # would repeat the last one: count it as completed
            progress = trainer.fit_loop.epoch_loop.batch_progress
            for tracker in (progress.total, progress.current):
                tracker.completed = tracker.processed
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            log.info("resumed from %s at global step %d, lr %.3g", self.ckpt_path, trainer.global_step, lr)
        self._keep_logger_step(trainer)
        for logger in trainer.loggers if trainer.is_global_zero else ():
            logger.log_metrics({LAUNCH_START_METRIC: float(trainer.global_step)}, step=trainer.global_step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        # Lightning's "is this a log step" reads this counter + 1: the step this batch makes
        self._keep_logger_step(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        # the batch's metrics and a validation after it are logged after this hook: at the step just made
        self._keep_logger_step(trainer)


class ValidationRecord(Callback):
    """The last validation's step and figures (teacher-forced accept_len, serving MAL), kept in checkpoints."""

    def __init__(self) -> None:
        self.step: Optional[int] = None
        self.figures: dict[str, float] = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        self.step = trainer.global_step
        self.figures = {
            name: float(metrics[key])
            for name, key in (("val_accept_len", "val/accept_len"), ("val_serving_mal", "val/serving_mal"))
            if key in metrics
        }

    def training_info(self) -> dict:
        """The export's record of the last validation: ``val_step`` and its figures (empty: never validated)."""
        return {} if self.step is None else {"val_step": self.step, **self.figures}

    def state_dict(self) -> dict:
        return {"step": self.step, "figures": dict(self.figures)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict.get("step")
        self.figures = dict(state_dict.get("figures") or {})
