"""Serving-aware anchors and the on-policy stage: train where serving's rounds actually start.

Teacher-forced training draws its anchors uniformly over a reply; serving starts its rounds
only at bonus tokens, and the rounds that start right after the target corrected the draft are
where serving loses most (docs/benchmarks.md, "Where serving's rounds start"). With
``dflash.serving_anchor_fraction`` f > 0, every ``dflash.serving_anchor_every`` steps each rank
decodes the rows of its current batch with the reference speculative decoder (an unsharded copy
of the draft, the prompt as the row holds it, up to the row's reply length) and remembers, per
sample id, the reply offsets at which a round started after a correction. Whenever a remembered
sample is trained on again, up to f of its row's blocks are placed at those positions, each
replacing a block of the uniform draw chosen with a seed of the run's seed, the step and the
sample id (a position the draw also picked then trains twice); the number of blocks does not
change, and a sample gets the same blocks on any rank at any world size.

The memory is part of the checkpoint (gathered from every rank), mining happens on the same
steps on every rank and neither it nor the replacement touches the global random generators,
so resumes stay exact and two ranks train like one process on the same global batch.

The on-policy stage (``dflash.on_policy_from_step`` s ≥ 0) is the same miner with two changes from step s
on: it remembers *every* round start of the decode (the rounds serving meets with the current draft), and
up to ``dflash.on_policy_anchor_fraction`` of a row's blocks go there; the training module then switches
the block loss to the on-policy one (``ChunkedBlockLoss.on_policy``: the run's terms on each block's accepted
prefix, reverse KL at its first rejection). The draft's proposals are not stored: at a round start the
teacher-forced block *is* serving's round (its context is the verified prefix, the target's greedy reply,
which the row holds when its labels are the target's greedy reply: offline labels or
``label_source=target_argmax``), so the training forward recomputes them with the current weights. Each
rank mines its own batch, so the decoded samples are disjoint across ranks like the data.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dflash_train.draft.build import PreferredRow
from dflash_train.evaluate.anchors import AFTER_CORRECTION, round_starts
from dflash_train.evaluate.decoder import StopRule, proposer_for, speculative_decode
from dflash_train.evaluate.session import TargetSession
from dflash_train.target.base import FrozenTarget

CHECKPOINT_KEY = "dflash_train_serving_anchor_starts"


@dataclass(frozen=True)
class ServingAnchorSettings:
    """``fraction`` of a row's blocks at its mined round starts of the ``kinds`` kept, mined every ``every``
    steps from ``from_step`` on at K; ``on_policy``: the on-policy stage (its loss from ``from_step`` on)."""

    fraction: float
    every: int
    num_speculative_tokens: int
    stop_token_ids: frozenset[int]
    seed: int = 0  # the run's seed: with the step and the sample id it picks the replaced blocks
    kinds: frozenset[str] = frozenset({AFTER_CORRECTION})
    from_step: int = 0
    on_policy: bool = False

    def on_policy_at(self, global_step: int) -> bool:
        """Whether step ``global_step`` trains with the on-policy loss."""
        return self.on_policy and global_step >= self.from_step


def reply_span(loss_mask_row: torch.Tensor) -> Optional[tuple[int, int]]:
    """``(start, length)`` of the row's last supervised run (the reply serving would generate), or ``None``."""
    positions = torch.nonzero(loss_mask_row, as_tuple=False).flatten().tolist()
    if not positions:
        return None
    first = len(positions) - 1
    while first > 0 and positions[first - 1] == positions[first] - 1:
        first -= 1
    return positions[first], positions[-1] - positions[first] + 1


class ServingAnchorMiner:
    """Mined round starts per sample id and the preferred anchors of a batch."""

    def __init__(self, settings: ServingAnchorSettings):
        self.settings = settings
        self.starts: dict[str, list[int]] = {}  # sample id -> reply offsets of the kept rounds' starts
        self.seconds = 0.0  # wall time spent decoding on this rank since the last read (see take_seconds)

    def due(self, global_step: int, micro_batch: int) -> bool:
        """Whether this step mines (the same answer on every rank)."""
        offset = global_step - self.settings.from_step
        return micro_batch == 0 and offset >= 0 and offset % self.settings.every == 0

    def take_seconds(self) -> float:
        """Decode time on this rank since the previous call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @torch.no_grad()
    def mine(
        self, target: FrozenTarget, draft: nn.Module, inputs_embeds: torch.Tensor, loss_mask: torch.Tensor,
        sample_ids: Sequence[str],
    ) -> None:
        """Decode each row's prompt like serving (at most its reply's length) and remember where its rounds of
        the kept kinds started."""
        started = time.perf_counter()
        k = self.settings.num_speculative_tokens
        dtype = target.embed_tokens.weight.dtype
        for row, sample_id in enumerate(sample_ids):
            span = reply_span(loss_mask[row])
            if span is None or span[0] == 0:
                continue
            start, length = span
            proposer, layer_ids = proposer_for(draft, target, k)
            rule = StopRule(length, self.settings.stop_token_ids)
            prompt = inputs_embeds[row : row + 1, :start].to(dtype)
            decoded = speculative_decode(TargetSession(target, layer_ids), proposer, prompt, rule)
            starts = round_starts(decoded.accepted_per_round, k)
            self.starts[sample_id] = [offset for offset, kind in starts if kind in self.settings.kinds]
        self.seconds += time.perf_counter() - started

    def preferred(self, loss_mask: torch.Tensor, sample_ids: Sequence[str], global_step: int) -> list[PreferredRow]:
        """Per row, the sequence positions of its sample's remembered correction starts (empty when none) and
        the seed choosing the blocks they replace: from the run's seed, the step and the sample id only, so a
        sample gets the same blocks on whichever rank and at whichever world size it is trained."""
        rows = []
        for row, sample_id in enumerate(sample_ids):
            offsets = self.starts.get(sample_id)
            span = reply_span(loss_mask[row]) if offsets else None
            seed = zlib.crc32(f"{self.settings.seed}:{global_step}:{sample_id}".encode())
            rows.append(PreferredRow([span[0] + offset for offset in offsets] if span else [], seed))
        return rows

    def state(self) -> dict[str, list[int]]:
        """Every rank's memory merged (a collective: call it on every rank)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, self.starts)
            merged: dict[str, list[int]] = {}
            for part in parts:
                merged.update(part)
            return dict(sorted(merged.items()))
        return dict(sorted(self.starts.items()))

    def restore(self, starts: dict[str, list[int]]) -> None:
        self.starts = {key: list(value) for key, value in starts.items()}
