"""Serving acceptance measured during validation: the reference speculative decoder on a fixed subset.

Teacher-forced ``val/accept_len`` scores the draft on blocks anchored anywhere in a reply,
with the true tokens as context. Serving scores it on rounds that start where the previous
round stopped, after the target corrected the draft. The two differ (docs/benchmarks.md), so
validation also runs what serving runs: the reference decoder that reproduces vLLM's tokens and
counters (:mod:`dflash_train.evaluate.decoder`), on the first ``samples`` records of the first
validation set, with serving's K and perception precision, greedy, up to ``max_new_tokens``.

Every rank decodes the requests ``i % world_size == rank`` with an unsharded copy of the draft
in its export form; the counters (rounds, accepted, accepted per position) are summed over
ranks, so ``val/serving_mal`` is exactly the pooled MAL ``dflash-eval`` reports for the same
weights, samples and settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dflash_train.config.schema import InputConfig
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.prompt import ChatMLFormat
from dflash_train.evaluate.counters import AcceptanceCounters
from dflash_train.evaluate.decoder import StopRule, proposer_for, speculative_decode
from dflash_train.evaluate.loading import default_stop_token_ids
from dflash_train.evaluate.requests import RequestFailure, prompt_inputs, read_requests
from dflash_train.evaluate.session import TargetSession
from dflash_train.progress import progress
from dflash_train.target.base import FrozenTarget

log = logging.getLogger(__name__)
SERVING_LOG_EVERY = 100  # a log line per this many decoded records: a validation line follows anyway


@dataclass(frozen=True)
class ServingValidationSettings:
    """Which samples are decoded and how: as ``dflash-eval --limit samples`` would decode them."""

    samples: int
    max_new_tokens: int
    num_speculative_tokens: int
    perception_dtype: torch.dtype


class ServingValidation:
    """This rank's share of the fixed serving-validation requests and the counters of one measurement."""

    def __init__(
        self,
        inp: InputConfig,
        prompt_format: ChatMLFormat,
        estimator: AudioTokenEstimator,
        system_prompt: Optional[str],
        settings: ServingValidationSettings,
    ):
        self.inp = inp
        self.prompt_format = prompt_format
        self.estimator = estimator
        self.system_prompt = system_prompt
        self.settings = settings
        self.rule = StopRule(settings.max_new_tokens, frozenset(default_stop_token_ids(prompt_format)))
        self._prompts: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # this rank's (embeddings, ids)
        self._failures = 0  # this rank's records that could not become a request (counted, not decoded)

    def _own_prompts(self, target: FrozenTarget, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._prompts is None:
            self._prompts = []
            requests = read_requests(
                self.inp, self.prompt_format, self.estimator, system_prompt=self.system_prompt,
                limit=self.settings.samples,
            )
            with target.perception_as_served(self.settings.perception_dtype):
                for request in requests:
                    if request.index % world_size != rank:
                        continue
                    if isinstance(request, RequestFailure):
                        self._failures += 1
                        log.warning("serving validation: sample %s cannot be decoded: %s", request.id, request.error)
                        continue
                    self._prompts.append(prompt_inputs(target, request.prompt))  # the target is frozen
        return self._prompts

    @torch.no_grad()
    def measure(self, target: FrozenTarget, draft: nn.Module, rank: int, world_size: int) -> torch.Tensor:
        """Decode this rank's requests with ``draft`` (export form); its counters as a float64 vector:
        rounds, accepted, failed requests, accepted@1..K (summed over ranks by the caller)."""
        k = self.settings.num_speculative_tokens
        proposer, layer_ids = proposer_for(draft, target, k)
        counters = AcceptanceCounters(k)
        prompts = self._own_prompts(target, rank, world_size)
        for embeds, ids in progress(prompts, "serving validation", total=len(prompts), every=SERVING_LOG_EVERY,
                                    transient=True):
            decoded = speculative_decode(TargetSession(target, layer_ids), proposer, embeds, self.rule, ids)
            counters = counters + AcceptanceCounters.from_rounds(k, decoded.accepted_per_round)
        values = [counters.rounds, counters.accepted, self._failures, *counters.accepted_per_position]
        return torch.tensor(values, dtype=torch.float64)

    def metrics(self, totals: torch.Tensor, seconds: float) -> dict[str, float]:
        """Log values of counters summed over ranks: pooled MAL, acceptance@k and conditional@k (both
        definitions, docs/evaluation.md), rounds, failed samples, and this rank's decoding seconds."""
        k = self.settings.num_speculative_tokens
        rounds, accepted, failures, *per_position = (int(v) for v in totals.tolist())
        counters = AcceptanceCounters(k, rounds, rounds * k, accepted, per_position, [rounds] * k)
        out = {"val/serving_mal": counters.mal, "val/serving_rounds": float(rounds),
               "val/serving_failed": float(failures), "val/serving_seconds": seconds}
        for position in counters.positions():
            out[f"val/serving_acceptance@{position.k}"] = position.rate
            out[f"val/serving_conditional@{position.k}"] = position.conditional
        return out

