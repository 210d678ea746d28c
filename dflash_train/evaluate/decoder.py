"""Reference speculative decoder: vLLM's DFlash inference, step for step, in plain PyTorch.

One request at a time (batching changes no greedy token and no counter):

1. Prefill: the target processes the prompt (audio frames spliced in); its greedy token
   is the first output token, the *bonus* of round 1. The tapped features of every
   prompt position become the draft's context.
2. Each round the draft reads ``[bonus, MASK x K]`` at the next K+1 positions, attending
   to its context (the features of every verified token so far) and to the whole query
   block, and proposes K tokens (DFlash: argmax per position; DFlash2: its candidate
   selector's greedy walk).
3. The target verifies ``[bonus, d_1 .. d_K]`` in one forward. The longest prefix of
   proposals equal to the target's greedy tokens is accepted; the target's token after
   it becomes the next bonus. The target's cache is cropped to the accepted prefix.
4. The draft's context grows only by verified tokens: the features of the bonus and the
   accepted proposals. Its cache never keeps the query block.
5. Output tokens are checked one by one for a stop token and the token limit, as vLLM
   does after each step; counters record the round before truncation, as vLLM's do.

MTP heads and EAGLE-3 drafts propose by a chain instead (step 2): K autoregressive steps, each
reading the previous step's token and hidden state (:class:`MTPProposer`, :class:`Eagle3Proposer`).

:func:`greedy_decode` is the target alone under the same stop rule: the reference the
speculative output must equal token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
from torch import nn

from dflash_train.evaluate.session import StepOutput, TargetSession, crop_cache
from dflash_train.target import FrozenTarget
from dflash_train.variants import variant_for_architecture


@dataclass(frozen=True)
class StopRule:
    """When a request ends: a stop token (kept in the output, as vLLM keeps EOS) or ``max_new_tokens``."""

    max_new_tokens: int
    stop_token_ids: frozenset[int]

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass
class Decoded:
    """One request's output: token ids, why it ended (``stop`` / ``length``), accepted proposals per round."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    accepted_per_round: list[int] = field(default_factory=list)

    def append(self, tokens: Sequence[int], rule: StopRule) -> bool:
        """Append ``tokens`` one by one until one stops the request; returns whether it stopped."""
        for token in tokens:
            self.token_ids.append(int(token))
            if token in rule.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= rule.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                return True
        return False


class Proposer(Protocol):
    """What the decoder asks of a draft: K proposals per round, and the verified tokens afterwards."""

    num_speculative_tokens: int

    def start(self, prompt_embeds: torch.Tensor, prefill: StepOutput, prompt_ids: Optional[torch.Tensor]) -> None:
        """A new request: the prompt's embeddings ``[1, S, H]``, what the target computed for it and its token
        ids ``[S]`` as vLLM holds them (the audio placeholder at audio frames; ``None`` if the caller has none)."""

    def propose(self, bonus: int, position: int) -> list[int]:
        """K proposals following ``bonus``, which sits at ``position``."""

    def extend(self, token_ids: Sequence[int], verified: StepOutput) -> None:
        """Tokens just verified (the bonus and the accepted proposals) and the target's output for them."""


def greedy_decode(session: TargetSession, prompt_embeds: torch.Tensor, rule: StopRule) -> Decoded:
    """The target alone, one token per forward: the output speculation must reproduce."""
    out = Decoded()
    token = int(session.prefill(prompt_embeds).logits[-1].argmax())
    while not out.append([token], rule):
        token = int(session.extend([token]).logits[-1].argmax())
    return out


def speculative_decode(
    session: TargetSession, proposer: Proposer, prompt_embeds: torch.Tensor, rule: StopRule,
    prompt_ids: Optional[torch.Tensor] = None,
) -> Decoded:
    """Speculative greedy decoding of one request (module docstring, steps 1-5); ``prompt_ids``: the prompt's
    token ids as vLLM holds them (:func:`~dflash_train.evaluate.requests.prompt_inputs`), which a proposer
    reading token ids at prompt positions (EAGLE-3) needs."""
    k = proposer.num_speculative_tokens
    out = Decoded()
    step = session.prefill(prompt_embeds)
    bonus = int(step.logits[-1].argmax())
    if out.append([bonus], rule):
        return out
    proposer.start(prompt_embeds, step, prompt_ids)
    position = prompt_embeds.shape[1]
    while True:
        drafts = proposer.propose(bonus, position)
        if len(drafts) != k:
            raise RuntimeError(f"the proposer returned {len(drafts)} tokens, expected K={k}")
        step = session.extend([bonus, *drafts])
        greedy = step.logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == greedy[accepted]:
            accepted += 1
        out.accepted_per_round.append(accepted)
        session.crop(position + accepted + 1)
        proposer.extend([bonus, *drafts[:accepted]], step.first(accepted + 1))
        position += accepted + 1
        bonus = greedy[accepted]
        if out.append([*drafts[:accepted], bonus], rule):
            return out


class _EmbeddingOwner:
    """Lets the draft embed its query block with the target's table (``draft.embed_noise_block`` API)."""

    def __init__(self, embed_tokens: nn.Embedding):
        self._embed_tokens = embed_tokens

    def get_input_embeddings(self) -> nn.Embedding:
        return self._embed_tokens


class _ProposerBase:
    """What every proposer holds: the target it drafts for and K, its proposals per round."""

    def __init__(self, target: FrozenTarget, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        self.target = target
        self.num_speculative_tokens = num_speculative_tokens


class DraftProposer(_ProposerBase):
    """An exported DFlash / DFlash2 draft proposing through its own KV cache of verified context."""

    def __init__(self, draft: nn.Module, target: FrozenTarget, num_speculative_tokens: int):
        super().__init__(target, num_speculative_tokens)
        self.draft = draft.eval()
        self.variant = variant_for_architecture(draft.config.architectures[0])
        self._embedder = _EmbeddingOwner(target.embed_tokens)
        self._cache = None
        self._pending: torch.Tensor | None = None

    def start(self, prompt_embeds: torch.Tensor, prefill: StepOutput, prompt_ids: Optional[torch.Tensor] = None) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.draft.config)
        self._pending = prefill.features

    @torch.no_grad()
    def propose(self, bonus: int, position: int) -> list[int]:
        k = self.num_speculative_tokens
        device = self._pending.device
        block = torch.tensor([[bonus] + [self.draft.mask_token_id] * k], dtype=torch.long, device=device)
        cached = self._cache.get_seq_length()
        hidden = self.draft(
            position_ids=torch.arange(cached, position + k + 1, device=device)[None],
            noise_embedding=self.draft.embed_noise_block(self._embedder, block),
            target_hidden=self._pending[None].to(self.draft.fc.weight.dtype),
            past_key_values=self._cache,
            use_cache=True,
            **self.variant.decode_forward_kwargs(k),
        )[:, 1:]
        crop_cache(self._cache, position)  # keep verified context only; the query block is re-drafted next round
        self._pending = self._pending[:0]
        logits = self.draft.compute_logits(hidden, self.target.lm_head).float()
        return self.variant.propose(self.draft, hidden, logits, bonus)

    def extend(self, token_ids: Sequence[int], verified: StepOutput) -> None:
        self._pending = verified.features


class MTPProposer(_ProposerBase):
    """The target's own MTP step, repeated for every draft position, as vLLM's MTP proposer runs it.

    Every verified position *i* has one cached entry of the step, made from the embedding of
    token *i + 1* (an audio frame's at audio positions) and the target's final hidden state at
    *i*; an entry needs the next token, so the newest verified position waits for the bonus.
    A round computes the waiting entries (the last one proposes ``d_1``), then runs the step on
    its own output K - 1 times (``d_2 .. d_K``); those draft entries are dropped afterwards.
    """

    def __init__(self, step: nn.Module, target: FrozenTarget, num_speculative_tokens: int):
        super().__init__(target, num_speculative_tokens)
        self.step = step.eval()
        self._cache = None
        self._hidden: torch.Tensor | None = None  # target hidden states of positions without an entry yet
        self._next_embeds: torch.Tensor | None = None  # embeddings of the tokens after them, bar the last

    def _embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        device = self.target.embed_tokens.weight.device
        return self.target.embed_tokens(torch.tensor(list(token_ids), dtype=torch.long, device=device))

    def start(self, prompt_embeds: torch.Tensor, prefill: StepOutput, prompt_ids: Optional[torch.Tensor] = None) -> None:
        self._cache = self.step.new_cache()
        self._hidden = prefill.hidden
        self._next_embeds = prompt_embeds[0, 1:]

    @torch.no_grad()
    def propose(self, bonus: int, position: int) -> list[int]:
        dtype = self.step.eh_proj.weight.dtype
        embeds = torch.cat([self._next_embeds, self._embed([bonus])]).to(dtype)
        out = self.step(embeds, self._hidden.to(dtype), self._cache)[-1:]
        drafts = [int(self.target.lm_head(out).argmax(dim=-1))]
        while len(drafts) < self.num_speculative_tokens:
            out = self.step(self._embed(drafts[-1:]).to(dtype), out, self._cache)
            drafts.append(int(self.target.lm_head(out).argmax(dim=-1)))
        for layer_cache in self._cache:
            layer_cache.crop(position)  # entries of verified positions only
        return drafts

    def extend(self, token_ids: Sequence[int], verified: StepOutput) -> None:
        self._hidden = verified.hidden
        self._next_embeds = self._embed(token_ids[1:])


class Eagle3Proposer(_ProposerBase):
    """An EAGLE-3 draft's chain of K steps, as vLLM's EAGLE-3 proposer runs it.

    Draft slot *t* reads the embedding of token *t + 1* (vLLM's token ids: at audio frames the audio
    placeholder, as in training) and the fused taps of target position *t* (``fc`` of the three), at
    RoPE position *t*. Every verified position with a known next token has a slot; the newest waits for
    the bonus, and its output proposes ``d_1``. Step *k* appends a slot reading ``d_k`` and the previous
    step's output hidden state (pre-final-norm), proposing ``d_{k+1}``; those slots are dropped after
    the round, as vLLM overwrites them. The draft's outputs are over its vocabulary and map to target
    ids through ``d2t``.

    Each step runs the draft over all its slots (nemo_automodel's draft has no incremental cache):
    exact, and O(K * context) per round — a reference, not a fast path.
    """

    def __init__(self, draft: nn.Module, target: FrozenTarget, num_speculative_tokens: int):
        from dflash_train.draft.eagle3 import selected_tokens

        super().__init__(target, num_speculative_tokens)
        self.draft = draft.eval()
        self._target_ids = selected_tokens(draft)[0].tolist()  # draft output id -> target token id
        self._next_tokens: Optional[torch.Tensor] = None  # token t + 1 of every slot but the newest
        self._context: Optional[torch.Tensor] = None  # fc(taps at t) of every slot [n, H]

    def start(self, prompt_embeds: torch.Tensor, prefill: StepOutput, prompt_ids: Optional[torch.Tensor] = None) -> None:
        if prompt_ids is None:
            raise ValueError("an EAGLE-3 draft reads the prompt's token ids: pass prompt_ids to speculative_decode")
        device = self.draft.model.fc.weight.device
        self._next_tokens = prompt_ids[1:].to(device)
        self._context = self._project(prefill.features)

    @torch.no_grad()
    def _project(self, features: torch.Tensor) -> torch.Tensor:
        return self.draft.project_hidden_states(features.to(self.draft.model.fc.weight.dtype))

    @torch.no_grad()
    def propose(self, bonus: int, position: int) -> list[int]:
        tokens = torch.cat([self._next_tokens, self._next_tokens.new_tensor([bonus])])
        hidden = self._context
        if tokens.shape[0] != position:
            raise RuntimeError(f"the draft holds {tokens.shape[0]} slots for a bonus at position {position}")
        drafts: list[int] = []
        while True:
            slots = tokens.shape[0]
            out = self.draft(
                input_ids=tokens[None],
                projected_hidden_states=hidden[None],
                attention_mask=torch.ones(1, slots, dtype=torch.long, device=tokens.device),
                position_ids=torch.arange(slots, device=tokens.device)[None],
            )[0, -1:]
            drafts.append(self._target_ids[int(self.draft.compute_logits(out).argmax(dim=-1))])
            if len(drafts) == self.num_speculative_tokens:
                return drafts
            tokens = torch.cat([tokens, tokens.new_tensor(drafts[-1:])])
            hidden = torch.cat([hidden, out])

    def extend(self, token_ids: Sequence[int], verified: StepOutput) -> None:
        self._next_tokens = torch.cat([self._next_tokens, self._next_tokens.new_tensor(list(token_ids))])
        self._context = torch.cat([self._context, self._project(verified.features)])


def proposer_for(draft: nn.Module, target: FrozenTarget, num_speculative_tokens: int) -> tuple[Proposer, list[int]]:
    """The proposer decoding with ``draft`` (an MTP step, an EAGLE-3 draft, or a DFlash / DFlash2 draft in its
    export form) and the target blocks its session must tap for it."""
    from dflash_train.draft.eagle3 import Eagle3Draft, draft_taps
    from dflash_train.draft.mtp import MTPStep

    if isinstance(draft, MTPStep):
        return MTPProposer(draft, target, num_speculative_tokens), []
    if isinstance(draft, Eagle3Draft):
        return Eagle3Proposer(draft, target, num_speculative_tokens), sorted(draft_taps(draft))  # vLLM's order
    return DraftProposer(draft, target, num_speculative_tokens), list(draft.target_layer_ids)
