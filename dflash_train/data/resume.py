"""Where a resumed run's data stream must continue."""

from __future__ import annotations


def batches_consumed(trainer) -> int:
    """Training batches this rank has completed, as restored from a checkpoint (0 on a fresh run).

    Read it when creating the train dataloader and skip that many batches of the
    deterministic stream. Counting processed batches (not fetched ones) keeps Lightning's
    one-batch prefetch from shifting the stream; checkpoints are written after a batch is
    processed and before Lightning marks it completed, so ``processed`` is the right count.
    """
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
