"""Where serving's rounds start, and how the draft does there versus everywhere else.

A serving round starts at a *bonus* token: the target's own token after the last accepted
proposal. Its context is the verified prefix, which is the target's greedy reply so far, and
its proposals are checked against the target's greedy continuation. So the tokens a round
accepts are exactly what teacher forcing gives at that anchor when the labels are the
target's greedy reply. Teacher-forced validation averages over every anchor of a reply;
serving averages over the round starts only. :func:`anchor_profile` measures both on one
request: the accepted length the draft reaches at every anchor of the target's greedy reply,
and which of those anchors serving's rounds started at (the first one, those after a round
whose proposals were all accepted, and those right after the target corrected the draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from dflash_train.evaluate.decoder import StopRule, greedy_decode, proposer_for, speculative_decode
from dflash_train.evaluate.session import StepOutput, TargetSession
from dflash_train.target.base import FrozenTarget

FIRST, AFTER_FULL, AFTER_CORRECTION, NOT_A_START = "first round", "after a full round", "after a correction", "not a start"
KINDS = (FIRST, AFTER_FULL, AFTER_CORRECTION, NOT_A_START)


@dataclass
class AnchorProfile:
    """One request: the accepted length at every anchor and the kind of each anchor.

    ``accepted[j]`` is how many of the K proposals made at reply position ``j`` (the bonus
    ``reply[j]``, context ``reply[:j]``) equal the target's greedy continuation. ``kinds[j]`` says
    whether serving started a round there and why. ``served`` is serving's accepted count per
    round, from the reference decoder (it must equal ``accepted`` at the round starts).
    """

    accepted: list[int]
    kinds: list[str]
    served: list[int]

    @property
    def starts(self) -> list[int]:
        return [j for j, kind in enumerate(self.kinds) if kind != NOT_A_START]

    def consistent(self) -> bool:
        """Whether teacher forcing at the round starts reproduces every round serving ran."""
        return [self.accepted[j] for j in self.starts] == self.served


def round_starts(accepted_per_round: Sequence[int], k: int) -> list[tuple[int, str]]:
    """Reply positions where serving's rounds started, with their kind: round r+1 starts one past the
    last token round r verified (its accepted proposals and its bonus)."""
    starts, position = [], 0
    for r, accepted in enumerate(accepted_per_round):
        kind = FIRST if r == 0 else AFTER_FULL if accepted_per_round[r - 1] == k else AFTER_CORRECTION
        starts.append((position, kind))
        position += accepted + 1
    return starts


@torch.no_grad()
def anchor_profile(
    target: FrozenTarget, draft: nn.Module, prompt_embeds: torch.Tensor, rule: StopRule, k: int
) -> AnchorProfile:
    """Decode one request like serving, then propose at every anchor of its reply (see the module docstring).

    Anchors are the reply positions a round can start at: every token but the last. The labels of
    the last anchors run past the reply's end into the target's greedy continuation, as serving's
    verification does.
    """
    proposer, layer_ids = proposer_for(draft, target, k)
    decoded = speculative_decode(TargetSession(target, layer_ids), proposer, prompt_embeds, rule)
    reply = decoded.token_ids
    labels = greedy_decode(
        TargetSession(target, rolls_back=False), prompt_embeds, StopRule(len(reply) + k, frozenset())
    ).token_ids
    if labels[: len(reply)] != reply:
        raise RuntimeError("speculative output differs from the target's greedy reply: the profile would be wrong")
    session = TargetSession(target, layer_ids)
    prefill = session.prefill(prompt_embeds)
    verified = session.extend(reply[:-1]) if len(reply) > 1 else None
    # A serving run whose every round accepts nothing: a round starts at every position, each with the
    # same proposer state serving would have there (context = the reply before it).
    proposer, _ = proposer_for(draft, target, k)
    proposer.start(prompt_embeds, prefill)
    accepted = []
    for j in range(len(reply) - 1):
        drafts = proposer.propose(reply[j], prompt_embeds.shape[1] + j)
        count = 0
        while count < k and drafts[count] == labels[j + 1 + count]:
            count += 1
        accepted.append(count)
        features = verified.features[j : j + 1] if verified.features is not None else None
        proposer.extend([reply[j]], StepOutput(verified.logits[j : j + 1], features, verified.hidden[j : j + 1]))
    kinds = [NOT_A_START] * len(accepted)
    for position, kind in round_starts(decoded.accepted_per_round, k):
        kinds[position] = kind
    return AnchorProfile(accepted, kinds, list(decoded.accepted_per_round))


@dataclass
class AnchorTable:
    """Pooled acceptance per anchor kind: anchors, accepted@i counts (i = 1..K)."""

    k: int
    anchors: dict[str, int] = field(default_factory=dict)
    accepted_at: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, profiles: Iterable[AnchorProfile], k: int) -> "AnchorTable":
        table = cls(k, {kind: 0 for kind in KINDS}, {kind: [0] * k for kind in KINDS})
        for profile in profiles:
            for accepted, kind in zip(profile.accepted, profile.kinds):
                table.anchors[kind] += 1
                for i in range(accepted):
                    table.accepted_at[kind][i] += 1
        return table

    def row(self, kinds: Sequence[str]) -> tuple[int, float, list[float]]:
        """Over anchors of ``kinds``: their number, the mean accepted length (bonus included) and acceptance@1..K."""
        n = sum(self.anchors[kind] for kind in kinds)
        counts = [sum(self.accepted_at[kind][i] for kind in kinds) for i in range(self.k)]
        if n == 0:
            return 0, float("nan"), [float("nan")] * self.k
        return n, 1 + sum(counts) / n, [c / n for c in counts]
