"""A tiny resumable datamodule over fixed SpeechBatches, for module/recipe tests."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from dflash_train.data.resume import batches_consumed


def _identity(item):
    return item


class ResumableBatches:
    """Cycles through ``batches`` forever, starting after the ``start`` batches a resumed run consumed."""

    def __init__(self, batches, start: int = 0):
        self.batches = batches
        self.start = start

    def __iter__(self):
        position = self.start
        while True:
            yield self.batches[position % len(self.batches)]
            position += 1


class ListDataModule(L.LightningDataModule):
    """Rank ``r`` of ``w`` trains on ``train[r::w]``; validation batches are split the same way."""

    def __init__(self, train, val, val_names=("val",)):
        super().__init__()
        self.train, self.val, self.val_names = train, val, list(val_names)

    def _shard(self, batches):
        rank = self.trainer.global_rank if self.trainer else 0
        world = self.trainer.world_size if self.trainer else 1
        return batches[rank::world]

    def supervised_sample(self, limit):
        """The training batches' ``input_ids`` / ``loss_mask``, at most ``limit`` of them (an EAGLE-3 vocabulary)."""
        return [{"input_ids": b.input_ids, "loss_mask": b.loss_mask} for b in self.train[:limit]]

    def train_dataloader(self):
        return ResumableBatches(self._shard(self.train), start=batches_consumed(self.trainer))

    def val_dataloader(self):
        return [DataLoader(self._shard(self.val), batch_size=None, collate_fn=_identity)]
