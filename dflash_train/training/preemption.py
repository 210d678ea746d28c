"""Preemption-safe training: a signal becomes a resumable checkpoint at the next step boundary.

Schedulers announce the end of a job with a signal: SLURM sends ``--signal=USR1@120`` (or
SIGTERM at the time limit and on ``scancel``), torchrun forwards SIGTERM to its workers, and
Kubernetes sends SIGTERM before the kill. Saving inside the signal handler is unsafe (under
FSDP2 the save is a collective that other ranks are not in), so the handler only notes the
signal. At the end of each optimizer step every rank reports whether it received one; if any
did, all ranks together save ``last.ckpt``, stop, and (when configured under SLURM) rank 0
requeues the job. The next run with ``exp_manager.resume_if_exists=true`` continues from it
exactly (the data stream, the anchors' random keys and the scheduler are all restored).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from dflash_train.constants import PREEMPTION_SIGNALS
from dflash_train.distributed import all_reduce_sum
from dflash_train.training.lifecycle import skip_validation

log = logging.getLogger(__name__)


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes: ``ARRAY_TASK`` form for array jobs, else ``SLURM_JOB_ID``."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None and "SLURM_ARRAY_TASK_ID" in os.environ:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


class PreemptionCheckpoint(Callback):
    """On SIGTERM or SIGUSR1: save ``checkpoint_path`` at the next step boundary on every rank, then stop.

    ``requeue``: rank 0 runs ``scontrol requeue <job>`` after the save (SLURM only; a run
    outside SLURM logs that it cannot). The handlers are installed when training starts
    (replacing Lightning's, which would stop at the next batch without a checkpoint) and the
    previous ones are restored when it ends.
    """

    def __init__(self, checkpoint_path: Path, requeue: bool = False):
        self.checkpoint_path = Path(checkpoint_path)
        self.requeue = requeue
        self.received: int = 0
        self.stopped_by: Optional[str] = None
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, _frame) -> None:
        # Only set a flag: a signal handler must not log (lock re-entry) or touch collectives.
        self.received = self.received or int(signum)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._note)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        accumulate = pl_module.settings.optim.accumulate_grad_batches
        if (batch_idx + 1) % accumulate:
            return  # mid-window: the accumulated gradients are not in a checkpoint; wait for the step
        flags = torch.zeros(len(PREEMPTION_SIGNALS), dtype=torch.float64, device=pl_module.device)
        if self.received:
            flags[PREEMPTION_SIGNALS.index(self.received)] = 1.0
        flags = all_reduce_sum(flags)
        if not bool(flags.any()):
            return
        name = signal.Signals(PREEMPTION_SIGNALS[int(flags.argmax())]).name
        trainer.save_checkpoint(str(self.checkpoint_path))  # every rank: a collective under FSDP2
        self.stopped_by = name
        trainer.should_stop = True
        skip_validation(trainer)  # the grace period is short, and the uninterrupted run does not validate here
        if trainer.is_global_zero:
            log.warning(
                "preemption: %s received; saved %s at step %d and stopped; resume with exp_manager.resume_if_exists=true",
                name,
                self.checkpoint_path,
                trainer.global_step,
            )
            if self.requeue:
                self._requeue()

    def _requeue(self) -> None:
        job = slurm_job_id()
        if job is None:
            log.warning("preemption: exp_manager.requeue_on_preemption=true but this is not a SLURM job; not requeued")
            return
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if result.returncode == 0:
            log.info("preemption: requeued SLURM job %s", job)
        else:
            log.error("preemption: `scontrol requeue %s` failed (%d): %s", job, result.returncode, result.stderr.strip())
