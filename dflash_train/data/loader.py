"""Loaders whose workers do all per-sample work: each walks the sampler, and collates its share.

A map-style ``DataLoader`` runs its sampler in the training process, and a lhotse sampler reads
every record there: parsing manifests, tokenizing, opening each audio file's header (see
``Preparer`` and ``inputs.checked_audio``) between training steps. Here the sampler runs inside
the loader's workers instead: worker *w* of *W* walks the whole (deterministic) sampler and
collates batches *w*, *w + W*, ... ; torch's ``DataLoader`` takes one batch from each worker in
turn, so the training process receives the sampler's batches in the sampler's order, exactly as
if one process had made them, for any *W* (0 included: then the training process does it all).

What this costs and keeps:

- Every worker prepares every example of the stream (tokenization, header reads, the
  finite-sample decode of float audio); only the owner of a batch decodes its audio for
  training. Integer and compressed audio is decoded once, by that worker.
- Skips: all workers meet the same skipped records; worker 0 alone counts them, into a
  shared-memory table the training process reads (``SkipCounter.worker_table``), so counts stay
  exact and rank-disjoint.
- Resume: the first ``skip`` batches are sampled, never collated, then dealt as above: the
  resumed stream equals the uninterrupted one.
- Errors raised in a worker reach the training process as their one-line message
  (``errors.OneLineError``).
- Every worker walks the *same* stream: lhotse's bucketing sampler would seed its bucket choice
  with the worker's id when iterated in one (its own design gives each worker a different
  shard), so the sampler is started as the training process would start it
  (:func:`_as_the_training_process`); the bucket choice stays in step across ranks as well.
- Exit: workers ignore preemption signals (:func:`leave_preemption_to_the_trainer`), but SIGTERM
  is also how ``multiprocessing`` stops daemon processes when their parent leaves, before
  joining them: a process leaving with live workers (a worker raised, the run failed) would wait
  for them forever. So an exit hook of the training process, which runs before
  ``multiprocessing``'s, raises a shared flag; a worker obeys SIGTERM once it is up.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
from contextlib import contextmanager
from itertools import islice
from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from dflash_train.config.schema import DatasetConfig
from dflash_train.constants import PREEMPTION_SIGNALS
from dflash_train.data.batch import SpeechBatch
from dflash_train.data.collate import SpeechCollator
from dflash_train.data.examples import Example, SkipCounter


# Raised by the training process's exit hook; registered after multiprocessing's (imported with
# torch), so it runs first. Workers read it through their dataset (``SampledBatches.exiting``).
_EXITING = multiprocessing.RawValue("b", 0)


@atexit.register
def _training_process_is_leaving() -> None:
    _EXITING.value = 1


def leave_preemption_to_the_trainer(_worker_id: int) -> None:
    """Loader workers ignore SIGTERM / SIGUSR1 while their training process runs: it turns them into a checkpoint.

    torchrun passes SIGTERM to each rank's whole process group and SLURM signals every process of
    a job step, workers included; a worker killed by it makes the rank's loader fail ("worker
    exited unexpectedly") before the step boundary where the preemption checkpoint is saved.
    Workers still stop when the loader shuts them down, when their rank dies, and on SIGTERM once
    their training process is leaving (see the module docstring).
    """
    exiting = get_worker_info().dataset.exiting

    def on_sigterm(_signum, _frame) -> None:
        if exiting.value:
            os._exit(0)

    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, on_sigterm if signum == signal.SIGTERM else signal.SIG_IGN)


@contextmanager
def _as_the_training_process() -> Iterator[None]:
    """Within: ``get_worker_info()`` is ``None``, as in the training process (see the module docstring)."""
    info = torch_worker._worker_info
    torch_worker._worker_info = None
    try:
        yield
    finally:
        torch_worker._worker_info = info


class SampledBatches(IterableDataset):
    """The sampler's batches after the first ``skip``, collated; in a loader worker only its share.

    See the module docstring for the dealing, the skip counts and what each worker repeats.
    """

    def __init__(self, sampler: Iterable[list[Example]], collate: SpeechCollator, skips: SkipCounter,
                 worker_skips: torch.Tensor | None, skip: int = 0):
        self.sampler = sampler
        self.collate = collate
        self.skips = skips
        self.worker_skips = worker_skips
        self.skip = skip
        self.exiting = _EXITING

    def __iter__(self) -> Iterator[SpeechBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            self.skips.count_in_worker(self.worker_skips, counts=worker == 0)
        with _as_the_training_process():  # islice starts the sampler (a lhotse sampler restarts on each iter())
            batches = islice(self.sampler, self.skip + worker, None, workers)
        for examples in batches:
            yield self.collate(examples)


def speech_loader(sampler: Iterable[list[Example]], collate: SpeechCollator, skips: SkipCounter,
                  ds: DatasetConfig, skip: int = 0) -> DataLoader:
    """A ``DataLoader`` of ``sampler``'s batches (after the first ``skip``) with the split's worker settings."""
    workers = ds.num_workers
    pin = torch.cuda.is_available() if ds.pin_memory is None else ds.pin_memory
    return DataLoader(
        SampledBatches(sampler, collate, skips, skips.worker_table() if workers > 0 else None, skip),
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=leave_preemption_to_the_trainer if workers > 0 else None,
        prefetch_factor=ds.prefetch_factor,
        pin_memory=pin,
    )
