"""Peak memory of one training step by category, counted tensor by tensor as the step allocates.

The same counter runs on fake tensors (the plan) and on real ones (the check that the plan is right):
every storage an operator creates is charged, rounded up to the CUDA caching allocator's 512-byte
blocks, to the step's current phase, or to a fixed category when the storage is one registered
beforehand (frozen target weights, draft parameter shards). FSDP2's gathered parameters grow and
shrink by ``UntypedStorage.resize_``, not by an operator, so resizes are charged to
``gathered_params``. A storage stops counting when Python frees it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

BLOCK = 512
"""The CUDA caching allocator's block size: every allocation is rounded up to it."""

CATEGORIES = ("target_weights", "target_activations", "draft_params", "gathered_params", "draft_activations",
              "loss_chunks", "backward", "optimizer_state")
"""The categories of the breakdown; ``backward`` holds the gradients and the backward's temporaries."""


def _rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


def _storages(values) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``values``' tensors; a wrapper such as FSDP2's DTensor holds none of its own, its
    inner (local) tensors do, and an operator on it runs theirs out of this mode's sight."""
    for value in tree_flatten(values)[0]:
        if not isinstance(value, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(value):
            yield from _storages([getattr(value, name) for name in value.__tensor_flatten__()[0]])
        else:
            yield value.untyped_storage()


class StepMemory(TorchDispatchMode):
    """Live bytes per category while active, and the breakdown at the highest total (``peak``).

    ``phase`` names the category new storages are charged to; :meth:`register` pins existing storages
    to a category. Call :meth:`reset_peak` between iterations to measure the steady state (the second
    step, with the optimizer state already allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "target_activations"
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict(self.live)
        self.peak_total = 0
        self.high_water = dict(self.live)  # each category's own highest live bytes (its peak need not be the step's)
        self._owner: dict[int, tuple[str, int]] = {}  # id(storage) -> (category, bytes)
        self._resize = None

    def register(self, tensors, category: str) -> None:
        """Charge the storages of ``tensors`` (already allocated) to ``category``."""
        for tensor in tensors:
            self._charge(tensor.untyped_storage(), category)

    def _charge(self, storage, category: str) -> None:
        key = id(storage)
        size = _rounded(storage.nbytes())
        if key in self._owner or size == 0:
            return
        self._owner[key] = (category, size)
        self.live[category] += size
        weakref.finalize(storage, self._release, key)
        self._observe()

    def _release(self, key: int) -> None:
        category, size = self._owner.pop(key, (None, 0))
        if category is not None:
            self.live[category] -= size

    def _resized(self, storage, new_size: int) -> None:
        key = id(storage)
        category, size = self._owner.pop(key, ("gathered_params", 0))
        self.live[category] -= size
        if new_size:
            self._owner[key] = (category, _rounded(new_size))
            self.live[category] += _rounded(new_size)
            if size == 0:
                weakref.finalize(storage, self._release, key)
        self._observe()

    def _observe(self) -> None:
        for category, live in self.live.items():
            if live > self.high_water[category]:
                self.high_water[category] = live
        total = sum(self.live.values())
        if total > self.peak_total:
            self.peak_total = total
            self.peak = dict(self.live)

    def reset_peak(self) -> None:
        """Forget the peak so far: the next one is measured from what is live now."""
        self.peak_total = 0
        self.high_water = dict(self.live)
        self._observe()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(storage) for storage in _storages((args, kwargs))}
        for storage in _storages(out):
            if id(storage) not in inputs:
                self._charge(storage, self.phase)
        return out

    @contextmanager
    def tracking(self) -> Iterator["StepMemory"]:
        """Count while the block runs, storage resizes (FSDP2's gathers and frees) included."""
        original = torch.UntypedStorage.resize_
        memory = self

        def resize(storage, size):
            result = original(storage, size)
            memory._resized(storage, int(size))
            return result

        torch.UntypedStorage.resize_ = resize
        try:
            with self:
                yield self
        finally:
            torch.UntypedStorage.resize_ = original

    @contextmanager
    def charged_to(self, category: str) -> Iterator[None]:
        """New storages of the block go to ``category``."""
        previous, self.phase = self.phase, category
        try:
            yield
        finally:
            self.phase = previous
