"""The training step the plan measures: the module's own pieces, in the order ``training_step`` runs them.

``DFlashDraftModule.prepare`` (splice audio, target forward with taps and labels) and ``_forward_core``
(anchors, draft forward, chunked loss), the backward of ``loss_sum · world_size`` exactly as
``training_step`` takes it, then the optimizer step. What is left out is Lightning's bookkeeping and
``_finish_window``'s one host read (the window's Σw, a non-finite flag and Σgrad², three scalars): the
plan steps the optimizer unconditionally, as a window with supervision does.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from dflash_train.data.batch import SpeechBatch
from dflash_train.plan.memory import StepMemory
from dflash_train.training.module import DFlashDraftModule

PHASES = ("perception", "target", "draft_forward", "loss", "backward", "optimizer")
"""The step's phases, in order, as FLOPs and times are reported."""


class PhaseHooks:
    """Where the step is, while the block runs: the module's pieces wrapped so that each reports the phase it
    enters, the perception's first-batch frame check marked done (the batch's counts are the estimator's) and,
    for a target that encodes in chunks, its frame estimator built ahead on real tensors.

    ``on_phase(name)`` is called as a phase starts and returns a context the phase runs in (the FLOP
    counter's and the memory counter's bookkeeping). Perception runs inside ``prepare``, the loss inside
    the core's forward: their entry points are wrapped on the instances, never on the classes, and put
    back on exit (a target may be shared, as the tests' is)."""

    def __init__(self, module: DFlashDraftModule, on_phase: Callable[[str], contextlib.AbstractContextManager]):
        self.module = module
        self.on_phase = on_phase
        self._saved: list[tuple[object, str, bool, object]] = []

    def __enter__(self) -> "PhaseHooks":
        target, core = self.module.target, self.module.core
        self._set(target, "_frames_checked", True)
        if getattr(target, "encoder_chunk_size_seconds", None) is not None:  # per-chunk counts, read on real tensors
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                target.frame_estimator()
        if hasattr(target, "encode_audio"):  # a text-only target has no perception
            self._wrap(target, "encode_audio", "perception")
        if hasattr(core, "head_loss"):  # the chunked LM head and loss (DFlash, DFlash2)
            self._wrap(core, "head_loss", "loss")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, had, value in reversed(self._saved):
            if had:
                object.__setattr__(owner, name, value)
            else:
                object.__delattr__(owner, name)
        self._saved.clear()

    def _set(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, name in vars(owner), vars(owner).get(name)))
        object.__setattr__(owner, name, value)  # on the instance, past nn.Module's attribute bookkeeping

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            with self.on_phase(phase):
                return original(*args, **kwargs)

        self._set(owner, name, wrapped)


def run_step(module: DFlashDraftModule, batch: SpeechBatch, optimizer: torch.optim.Optimizer, world_size: int,
             on_phase: Callable[[str], contextlib.AbstractContextManager], autocast: Optional[torch.dtype]) -> None:
    """One micro-batch that ends its window: target, draft, loss, backward, optimizer step."""
    amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with on_phase("target"), amp:
        inputs = module.prepare(batch)
    with on_phase("draft_forward"), amp:
        _, _, loss_sum = module._forward_core(inputs, rng_key=0)
    with on_phase("backward"):
        (loss_sum * world_size).backward()
    del inputs, loss_sum
    with on_phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


MEMORY_CATEGORY = {"perception": "target_activations", "target": "target_activations",
                   "draft_forward": "draft_activations", "loss": "loss_chunks", "backward": "backward",
                   "optimizer": "optimizer_state"}
"""Which memory category a phase's new storages are charged to."""


def phase_contexts(memory: Optional[StepMemory], flops) -> Callable[[str], contextlib.AbstractContextManager]:
    """``on_phase`` for :func:`run_step`: charge memory and FLOPs to the phase (either may be ``None``)."""

    @contextlib.contextmanager
    def on_phase(name: str):
        with contextlib.ExitStack() as stack:
            if memory is not None:
                stack.enter_context(memory.charged_to(MEMORY_CATEGORY[name]))
            if flops is not None:
                stack.enter_context(flops.charged_to(name))
            yield

    return on_phase
