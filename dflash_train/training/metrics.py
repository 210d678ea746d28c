"""Additive step statistics, summed exactly across batches and data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dflash_train.distributed import all_reduce_sum


@dataclass
class BlockStats:
    """Sums from which loss, accuracy and acceptance length are exact ratios.

    ``weighted_loss`` is Σ w·CE (the loss times its weight), ``weight`` Σ w; ``accept_sum``
    is the bonus-inclusive acceptance length summed over ``blocks``.
    """

    weighted_loss: float = 0.0
    weight: float = 0.0
    correct: float = 0.0
    tokens: float = 0.0
    accept_sum: float = 0.0
    blocks: float = 0.0
    batches: float = 0.0
    skipped: float = 0.0

    def add(self, other: "BlockStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_list(self) -> list[float]:
        """The sums in field order (to fuse them with other sums into one all-reduce)."""
        return [getattr(self, f.name) for f in fields(self)]

    def all_reduced(self, device: torch.device) -> "BlockStats":
        """The same sums over every rank."""
        values = torch.tensor(self.as_list(), dtype=torch.float64, device=device)
        return BlockStats(*all_reduce_sum(values).tolist())

    @property
    def loss(self) -> float:
        return self.weighted_loss / self.weight if self.weight > 0 else 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens if self.tokens > 0 else 0.0

    @property
    def accept_len(self) -> float:
        return self.accept_sum / self.blocks if self.blocks > 0 else 0.0


WEIGHT_INDEX = [f.name for f in fields(BlockStats)].index("weight")


def step_sums(metrics) -> torch.Tensor:
    """:class:`BlockStats` of one trainer-core step as a float64 tensor on its device, field order.

    Kept on the device so that a training step reads them back once, after its single
    all-reduce, instead of synchronising the host once per value.
    """
    loss = metrics.loss.detach().double()
    weight = metrics.loss_weight.detach().double()
    values = [loss * weight, weight] + [
        torch.as_tensor(v, device=loss.device).detach().double()
        for v in (metrics.correct_tokens, metrics.valid_tokens, metrics.accept_len_sum, metrics.valid_blocks)
    ]
    return torch.stack(values + [torch.ones_like(loss), torch.zeros_like(loss)])


def empty_step_sums(device: torch.device) -> torch.Tensor:
    """The sums of a batch that had no valid anchor: one batch, skipped."""
    return torch.tensor(BlockStats(batches=1.0, skipped=1.0).as_list(), dtype=torch.float64, device=device)

