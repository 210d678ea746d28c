"""Serving acceptance from vLLM's spec-decode counters, as :mod:`dflash_train.evaluate.counters` counts it.

vLLM counts, per engine, ``vllm:spec_decode_num_drafts`` (draft rounds),
``..._num_draft_tokens`` (tokens proposed), ``..._num_accepted_tokens`` and the vector
``..._num_accepted_tokens_per_pos`` (entry k-1: rounds whose first k proposals were all
accepted). These are exactly the fields of :class:`AcceptanceCounters`, which derives the
pooled MAL and per-position acceptance (definitions in its module and docs/evaluation.md). vLLM does
not export proposals per position; every round proposes K tokens unless cut short, so
proposed@k = rounds, checked by ``draft_tokens == K x drafts`` (:attr:`ServingReport.full_rounds`).

Counters are cumulative over an engine's life: measure a run as the difference of two
snapshots. vLLM-free: works on any objects with vLLM's metric shape (``name`` plus
``value`` or ``values``), and on the text a running server's ``/metrics`` endpoint returns
(Prometheus exposition: the same counters with a ``_total`` suffix, the per-position vector as
one sample per ``position`` label).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from dflash_train.evaluate.counters import AcceptanceCounters, first_difference

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
FINISHED_REQUESTS = "vllm:request_success"  # requests the engine finished, one sample per finished_reason
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class PrometheusSample:
    """One sample line of a Prometheus text exposition: metric name, labels, value."""

    name: str
    labels: dict
    value: float


def prometheus_samples(text: str) -> list[PrometheusSample]:
    """Every sample of a Prometheus text exposition (comments and blank lines skipped)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or line.lstrip().startswith("#"):
            continue
        name, labels, value = match.groups()
        samples.append(PrometheusSample(name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def finished_requests(samples: Iterable[PrometheusSample]) -> int:
    """Requests a vLLM server has finished so far, over every finish reason and engine."""
    return int(sum(s.value for s in samples if s.name == f"{FINISHED_REQUESTS}_total"))


class MissingCounters(RuntimeError):
    """vLLM reported no spec-decode counters (speculation off, or stats logging disabled)."""


@dataclass(frozen=True)
class SpecDecodeSnapshot:
    """vLLM's spec-decode counters at one moment (or the difference of two), summed over engines."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: tuple[int, ...]

    @classmethod
    def from_metrics(cls, metrics: Iterable) -> "SpecDecodeSnapshot":
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

    @classmethod
    def from_prometheus(cls, samples: Iterable[PrometheusSample]) -> "SpecDecodeSnapshot":
        """Read the counters from a server's ``/metrics`` samples (:func:`prometheus_samples`), summed over
        engines; :class:`MissingCounters` if any is absent (the server does not speculate)."""
        scalars: dict[str, int] = {}
        per_position: dict[int, int] = {}
        for sample in samples:
            name = sample.name.removesuffix("_total")
            if name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                scalars[name] = scalars.get(name, 0) + int(sample.value)
            elif name == ACCEPTED_PER_POSITION and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0) + int(sample.value)
        missing = [f"{name}_total" for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED) if name not in scalars]
        if not per_position:
            missing.append(f"{ACCEPTED_PER_POSITION}_total")
        if missing:
            raise MissingCounters(f"the server's /metrics has no {', '.join(missing)}: it does not speculate")
        vector = tuple(per_position.get(k, 0) for k in range(max(per_position) + 1))
        return cls(scalars[DRAFTS], scalars[DRAFT_TOKENS], scalars[ACCEPTED], vector)

    def __sub__(self, earlier: "SpecDecodeSnapshot") -> "SpecDecodeSnapshot":
        return SpecDecodeSnapshot(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            tuple(a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)),
        )

    def counters(self) -> AcceptanceCounters:
        """The pooled counters (K = length of the per-position vector; proposed@k = drafts)."""
        k = len(self.accepted_per_position)
        return AcceptanceCounters(
            k,
            rounds=self.drafts,
            proposed=self.draft_tokens,
            accepted=self.accepted,
            accepted_per_position=list(self.accepted_per_position),
            proposed_per_position=[self.drafts] * k,
        )


@dataclass(frozen=True)
class ServingReport:
    """Pooled acceptance of one served run, with the sample counts needed to judge it."""

    counters: AcceptanceCounters
    requests: int
    generated_tokens: int
    failures: int
    truncated: int

    @property
    def full_rounds(self) -> bool:
        """Whether every round proposed K tokens, so that proposed@k = rounds exactly."""
        return self.counters.proposed == self.counters.num_speculative_tokens * self.counters.rounds

    def format(self, title: str) -> str:
        """A plain-text report: MAL, sample counts, failures, truncations, per-position table."""
        c = self.counters
        lines = [
            f"{title}: MAL {c.mal:.3f} = 1 + {c.accepted} accepted / {c.rounds} draft rounds "
            f"(K={c.num_speculative_tokens}, pooled over {self.requests} requests)",
            f"  requests {self.requests}, generated tokens {self.generated_tokens}, draft rounds {c.rounds}, "
            f"proposed tokens {c.proposed}, failures {self.failures}, truncated at max_tokens {self.truncated}",
            "  k  accepted@k  proposed@k  accepted@k/proposed@k  conditional (accepted@k/accepted@k-1)",
        ]
        lines += [
            f"  {p.k:<2} {p.accepted:>10}  {p.proposed:>10}  {p.rate:>21.3f}  {p.conditional:>10.3f}"
            for p in c.positions()
        ]
        if not self.full_rounds:
            lines.append(
                f"  note: {c.proposed} proposed tokens != K x rounds = {c.num_speculative_tokens * c.rounds}; "
                "proposed@k is an upper bound"
            )
        return "\n".join(lines)


def first_mismatches(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> dict[int, int]:
    """``{request index: first differing token position}`` for every request whose token ids differ."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} outputs to compare with {len(reference)} references")
    found = {index: first_difference(ref, out) for index, (ref, out) in enumerate(zip(reference, candidate))}
    return {index: position for index, position in found.items() if position is not None}
