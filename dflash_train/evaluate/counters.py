"""Acceptance counters of speculative decoding, kept the way vLLM keeps them (docs/evaluation.md).

Every draft round proposes K tokens; the target verifies them greedily and accepts the
longest prefix equal to its own greedy tokens, then adds one token of its own (the bonus).
Per round this module records the number accepted; everything else is derived from those
numbers, pooled over every round of every measured request:

    MAL            = 1 + accepted / rounds           (the bonus token makes the 1)
    accepted@k     = rounds whose first k proposals were all accepted
    proposed@k     = rounds that proposed a k-th token (every round: K proposals)
    acceptance@k   = accepted@k / proposed@k          (unconditional)
    conditional@k  = accepted@k / accepted@(k-1)      (accepted@0 = rounds)

These are vLLM's ``spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``. A mean of per-request
MALs weights a 3-token reply like a 300-token one; serving throughput follows the pooled
ratio, so the pooled MAL is the only one reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

COUNTER_DEFINITIONS = {
    "rounds": "draft rounds: target verification passes, each checking K proposed tokens (vLLM num_drafts)",
    "proposed": "draft tokens proposed, K per round (vLLM num_draft_tokens)",
    "accepted": "proposed tokens accepted: per round, the longest prefix equal to the target's greedy tokens "
    "(vLLM num_accepted_tokens)",
    "MAL": "1 + accepted / rounds, pooled over every round of every evaluated request; tokens per target "
    "forward, bonus token included",
    "accepted@k": "rounds whose first k proposals were all accepted (vLLM num_accepted_tokens_per_pos[k-1])",
    "proposed@k": "rounds that proposed a k-th token",
    "acceptance@k": "accepted@k / proposed@k (unconditional)",
    "conditional@k": "accepted@k / accepted@(k-1), accepted@0 = rounds (k-th accepted given the first k-1 were)",
}


@dataclass(frozen=True)
class PositionStats:
    """Acceptance at draft position ``k`` (1-based)."""

    k: int
    accepted: int
    proposed: int
    rate: float
    conditional: float


@dataclass
class AcceptanceCounters:
    """Additive counters over draft rounds; ``+`` pools two sets (same K)."""

    num_speculative_tokens: int
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        self.accepted_per_position = list(self.accepted_per_position) or [0] * k
        self.proposed_per_position = list(self.proposed_per_position) or [0] * k

    @classmethod
    def from_rounds(cls, num_speculative_tokens: int, accepted_per_round: Sequence[int]) -> "AcceptanceCounters":
        """Counters of rounds that each proposed K tokens and accepted ``accepted_per_round[i]``."""
        counters = cls(num_speculative_tokens)
        for accepted in accepted_per_round:
            counters.observe(num_speculative_tokens, accepted)
        return counters

    @classmethod
    def pooled(cls, num_speculative_tokens: int, parts: Iterable["AcceptanceCounters"]) -> "AcceptanceCounters":
        """The sum of ``parts`` (an empty sum has zero rounds)."""
        total = cls(num_speculative_tokens)
        for part in parts:
            total = total + part
        return total

    def observe(self, proposed: int, accepted: int) -> None:
        """Record one round that proposed ``proposed`` tokens and accepted the first ``accepted``."""
        if not 0 <= accepted <= proposed <= self.num_speculative_tokens:
            raise ValueError(f"a round accepted {accepted} of {proposed} proposals (K={self.num_speculative_tokens})")
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        for i in range(proposed):
            self.proposed_per_position[i] += 1

    def __add__(self, other: "AcceptanceCounters") -> "AcceptanceCounters":
        if other.num_speculative_tokens != self.num_speculative_tokens:
            raise ValueError(
                f"cannot pool counters of K={self.num_speculative_tokens} and K={other.num_speculative_tokens}"
            )
        return AcceptanceCounters(
            self.num_speculative_tokens,
            self.rounds + other.rounds,
            self.proposed + other.proposed,
            self.accepted + other.accepted,
            [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)],
            [a + b for a, b in zip(self.proposed_per_position, other.proposed_per_position)],
        )

    @property
    def mal(self) -> float:
        """Mean acceptance length, bonus-inclusive: ``1 + accepted / rounds`` (NaN without rounds)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else float("nan")

    def positions(self) -> list[PositionStats]:
        """Per draft position k = 1..K: accepted@k, proposed@k, unconditional and conditional rates."""
        rows = []
        previous = self.rounds
        for k, (accepted, proposed) in enumerate(zip(self.accepted_per_position, self.proposed_per_position), start=1):
            rows.append(PositionStats(k, accepted, proposed, _ratio(accepted, proposed), _ratio(accepted, previous)))
            previous = accepted
        return rows

    def to_dict(self) -> dict:
        """JSON-ready counters, MAL and per-position rates."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "mal": self.mal,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "per_position": [
                {
                    "k": p.k,
                    "accepted": p.accepted,
                    "proposed": p.proposed,
                    "acceptance": p.rate,
                    "conditional": p.conditional,
                }
                for p in self.positions()
            ],
        }


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else float("nan")


def first_difference(reference: Sequence[int], candidate: Sequence[int]) -> Optional[int]:
    """First position where two token sequences differ (a prefix ends at the shorter length); ``None`` if equal."""
    reference, candidate = list(reference), list(candidate)
    if reference == candidate:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), min(len(reference), len(candidate))
    )
