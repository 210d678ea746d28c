"""A tiny resumable datamodule over fixed SpeechBatches, for module/recipe tests."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader


def _identity(item):
    return item


class ResumableBatches:
    """Cycles through ``batches`` forever; its position is saved in and restored from checkpoints."""

    def __init__(self, batches):
        self.batches = batches
        self.position = 0

    def __iter__(self):
        while True:
            batch = self.batches[self.position % len(self.batches)]
            self.position += 1
            yield batch

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class ListDataModule(L.LightningDataModule):
    """Rank ``r`` of ``w`` trains on ``train[r::w]``; validation batches are split the same way."""

    def __init__(self, train, val, val_names=("val",)):
        super().__init__()
        self.train, self.val, self.val_names = train, val, list(val_names)

    def _shard(self, batches):
        rank = self.trainer.global_rank if self.trainer else 0
        world = self.trainer.world_size if self.trainer else 1
        return batches[rank::world]

    def train_dataloader(self):
        return ResumableBatches(self._shard(self.train))

    def val_dataloader(self):
        return [DataLoader(self._shard(self.val), batch_size=None, collate_fn=_identity)]
