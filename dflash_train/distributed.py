"""Sums over the data-parallel ranks: the one place the package calls ``torch.distributed`` for them.

Low in the import order (imports nothing of ours), so a variant's trainer core and the training
module share it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the default process group (identity in a single process); every rank must call it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def world_size() -> int:
    """Number of data-parallel processes (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
