"""One request's KV-cached forward through the frozen target: greedy logits plus tapped features.

Speculative decoding needs three things from the target per step: the logits of every
position it just processed (to verify proposals and pick the next token), the tapped
features of those positions (the draft's context, docs/target.md: pre-final-norm block
outputs, captured with the same hooks training uses) and a cache it can roll back to the
accepted prefix. :class:`TargetSession` gives exactly that for one sequence.

A target with recurrent blocks (Nemotron-H's Mamba-2) cannot crop its cache: a recurrent state holds
no per-position entries to drop. Its session keeps a copy of the cache from before the first
extension after a crop and rolls back by restoring it and replaying the tokens that stay (exact:
the state is what a forward over exactly those tokens leaves).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_train.target.base import FrozenTarget


@dataclass
class StepOutput:
    """What the target computed for ``n`` positions: logits ``[n, V]`` (of the last position only after a
    prefill), tapped features ``[n, n_taps * H]`` (``None`` without taps) and final hidden states ``[n, H]``."""

    logits: torch.Tensor
    features: torch.Tensor | None
    hidden: torch.Tensor

    def first(self, n: int) -> "StepOutput":
        """The features and hidden states of the first ``n`` positions (the verified ones of a round)."""
        features = self.features[:n] if self.features is not None else None
        return StepOutput(self.logits[:n], features, self.hidden[:n])


class TargetSession:
    """Prefill, extend and crop one sequence of the target's LLM, holding its KV cache.

    ``layer_ids`` are the tapped decoder blocks (empty: no taps, e.g. target-only decoding).
    ``rolls_back=False``: the session is never cropped (greedy decoding), so a target with recurrent
    blocks keeps no copy of its state to roll back to (one copy of the whole cache per request).
    """

    def __init__(self, target: FrozenTarget, layer_ids: Sequence[int] = (), rolls_back: bool = True):
        self.target = target
        self.layer_ids = list(layer_ids)
        self.cache = target.new_cache()
        self.length = 0
        self.rolls_back = rolls_back
        self.replays = rolls_back and target.recurrent_block_ids != []
        self._rollback_point: tuple[object, int, list[int]] | None = None  # cache, its length, tokens since

    @torch.no_grad()
    def _forward(self, inputs_embeds: torch.Tensor, last_only: bool) -> StepOutput:
        count = inputs_embeds.shape[1]
        positions = torch.arange(self.length, self.length + count, device=inputs_embeds.device)[None]
        out = self.target.forward_cached(inputs_embeds, positions, self.cache, self.layer_ids)
        features = out.features[0] if out.features is not None else None
        hidden = out.last_hidden[0]
        self.length += count
        logits = self.target.lm_head(hidden[-1:] if last_only else hidden).float()
        return StepOutput(logits, features, hidden)

    def prefill(self, inputs_embeds: torch.Tensor) -> StepOutput:
        """Process the prompt ``[1, S, H]`` (audio frames already spliced); logits of its last position only."""
        if self.length:
            raise RuntimeError("prefill on a session that already holds a sequence")
        return self._forward(inputs_embeds, last_only=True)

    def extend(self, token_ids: Sequence[int]) -> StepOutput:
        """Append ``token_ids`` at the next positions; logits and features of each of them."""
        if self.replays:
            if self._rollback_point is None:
                self._rollback_point = (copy.deepcopy(self.cache), self.length, [])
            self._rollback_point[2].extend(token_ids)
        return self._forward(self._embed(token_ids), last_only=False)

    def _embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        device = self.target.embed_tokens.weight.device
        return self.target.embed_tokens(torch.tensor([list(token_ids)], dtype=torch.long, device=device))

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (rejected proposals).

        With recurrent blocks the cache from before the first extension since the last crop is
        restored and the kept tokens are run again; positions before it cannot be forgotten.
        """
        if length >= self.length:
            self._rollback_point = None
            return
        if not self.rolls_back:
            raise RuntimeError("crop on a TargetSession created with rolls_back=False (greedy decoding only)")
        if not self.replays:
            crop_cache(self.cache, length)
            self.length = length
            return
        if self._rollback_point is None or length < self._rollback_point[1]:
            raise RuntimeError(f"a recurrent state rolls back only to the last crop, not to position {length}")
        self.cache, self.length, token_ids = self._rollback_point
        self._rollback_point = None
        if length > self.length:
            self._forward(self._embed(token_ids[: length - self.length]), last_only=True)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of an HF cache (negative ``crop``: the non-deprecated form)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)
