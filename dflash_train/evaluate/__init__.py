"""Measure what serving will see: reference speculative decoder, pooled acceptance, WER, offline labels."""

from dflash_train.evaluate.counters import COUNTER_DEFINITIONS, AcceptanceCounters, PositionStats
from dflash_train.evaluate.decoder import (
    Decoded,
    DraftProposer,
    Proposer,
    StopRule,
    greedy_decode,
    speculative_decode,
)
from dflash_train.evaluate.loading import TargetSource, load_draft, load_target
from dflash_train.evaluate.report import EvalReport, Generation, SampleResult
from dflash_train.evaluate.requests import EvalRequest, RequestFailure, prompt_embeddings, read_requests
from dflash_train.evaluate.session import TargetSession

__all__ = [
    "COUNTER_DEFINITIONS",
    "AcceptanceCounters",
    "Decoded",
    "DraftProposer",
    "EvalReport",
    "EvalRequest",
    "Generation",
    "PositionStats",
    "Proposer",
    "RequestFailure",
    "SampleResult",
    "StopRule",
    "TargetSession",
    "TargetSource",
    "greedy_decode",
    "load_draft",
    "load_target",
    "prompt_embeddings",
    "read_requests",
    "speculative_decode",
]
