"""Serving acceptance from vLLM's spec-decode counters: pooled MAL and per-position acceptance.

vLLM counts, per engine, ``vllm:spec_decode_num_drafts`` (draft rounds),
``..._num_draft_tokens`` (tokens proposed), ``..._num_accepted_tokens`` and the vector
``..._num_accepted_tokens_per_pos`` (entry k-1 counts rounds whose first k proposals were
all accepted). From them, over all measured requests together (DESIGN.md §3G):

    MAL             = 1 + accepted / drafts          (the bonus token makes the 1)
    accepted@k      = accepted_per_pos[k-1]
    proposed@k      = drafts                         (every round proposes K tokens; checked)
    rate@k          = accepted@k / proposed@k
    conditional@k   = accepted@k / accepted@(k-1)    (accepted@0 = drafts)

Counters are cumulative over an engine's life: measure a run as the difference of two
snapshots. vLLM-free: works on any objects with vLLM's metric shape (``name`` plus
``value`` or ``values``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


class MissingCounters(RuntimeError):
    """vLLM reported no spec-decode counters (speculation off, or stats logging disabled)."""


@dataclass(frozen=True)
class SpecDecodeCounters:
    """One snapshot (or the difference of two) of vLLM's spec-decode counters, summed over engines."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: tuple[int, ...]

    @classmethod
    def from_metrics(cls, metrics: Iterable) -> "SpecDecodeCounters":
        """Read the counters from ``LLM.get_metrics()``; :class:`MissingCounters` if any is absent."""
        scalars: dict[str, int] = {}
        per_position: list[int] | None = None
        for metric in metrics:
            if metric.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                scalars[metric.name] = scalars.get(metric.name, 0) + int(metric.value)
            elif metric.name == ACCEPTED_PER_POSITION:
                values = [int(v) for v in metric.values]
                per_position = values if per_position is None else [a + b for a, b in zip(per_position, values)]
        missing = [name for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED) if name not in scalars]
        if per_position is None:
            missing.append(ACCEPTED_PER_POSITION)
        if missing:
            raise MissingCounters(
                f"vLLM reported no {', '.join(missing)}; serve with a speculative config and disable_log_stats=False"
            )
        return cls(scalars[DRAFTS], scalars[DRAFT_TOKENS], scalars[ACCEPTED], tuple(per_position))

    def __sub__(self, earlier: "SpecDecodeCounters") -> "SpecDecodeCounters":
        return SpecDecodeCounters(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            tuple(a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)),
        )


@dataclass(frozen=True)
class AcceptanceReport:
    """Pooled acceptance of one measured run, with the sample counts needed to judge it."""

    counters: SpecDecodeCounters
    num_speculative_tokens: int
    requests: int
    generated_tokens: int
    failures: int
    truncated: int

    @property
    def mal(self) -> float:
        """Mean acceptance length, bonus-inclusive, pooled over every draft round of every request."""
        return 1.0 + self.counters.accepted / self.counters.drafts if self.counters.drafts else float("nan")

    @property
    def full_rounds(self) -> bool:
        """Whether every round proposed K tokens (so proposed@k = drafts exactly)."""
        return self.counters.draft_tokens == self.num_speculative_tokens * self.counters.drafts

    def positions(self) -> list[tuple[int, int, int, float, float]]:
        """Per position k = 1..K: (k, accepted@k, proposed@k, rate@k, conditional@k)."""
        rows = []
        previous = self.counters.drafts
        for k, accepted in enumerate(self.counters.accepted_per_position, start=1):
            proposed = self.counters.drafts
            rows.append((k, accepted, proposed, _ratio(accepted, proposed), _ratio(accepted, previous)))
            previous = accepted
        return rows

    def format(self, title: str) -> str:
        """A plain-text report: definitions, MAL, per-position table, sample counts, failures, truncations."""
        c = self.counters
        lines = [
            f"{title}: MAL {self.mal:.3f} = 1 + {c.accepted} accepted / {c.drafts} drafts "
            f"(K={self.num_speculative_tokens}, pooled over {self.requests} requests)",
            f"  requests {self.requests}, generated tokens {self.generated_tokens}, draft rounds {c.drafts}, "
            f"proposed tokens {c.draft_tokens}, failures {self.failures}, truncated at max_tokens {self.truncated}",
            "  k  accepted@k  proposed@k  accepted@k/proposed@k  conditional (accepted@k/accepted@k-1)",
        ]
        lines += [f"  {k:<2} {a:>10}  {p:>10}  {r:>21.3f}  {q:>10.3f}" for k, a, p, r, q in self.positions()]
        if not self.full_rounds:
            lines.append(
                f"  note: {c.draft_tokens} proposed tokens != K x drafts = {self.num_speculative_tokens * c.drafts}; "
                "proposed@k is an upper bound"
            )
        return "\n".join(lines)


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else float("nan")


def first_mismatches(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> dict[int, int]:
    """``{request index: first differing token position}`` for every request whose token ids differ."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} outputs to compare with {len(reference)} references")
    mismatches = {}
    for index, (ref, out) in enumerate(zip(reference, candidate)):
        if list(ref) != list(out):
            mismatches[index] = next(
                (pos for pos, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out))
            )
    return mismatches
