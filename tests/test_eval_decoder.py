"""The reference speculative decoder on the tiny real SALM and real speech.

Greedy equivalence, counters that explain the MAL, an oracle reaching K + 1, an untrained
draft near 1, a trained one above it, and a draft cache that holds verified context only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import compose, tiny_run_overrides

from dflash_train.config.schema import InputConfig
from dflash_train.data.collate import collate_padded
from dflash_train.data.prompt import build_prompt_format
from dflash_train.draft import DraftSpec, build_draft, write_export
from dflash_train.evaluate import (
    AcceptanceCounters,
    DraftProposer,
    StopRule,
    TargetSession,
    greedy_decode,
    load_draft,
    prompt_embeddings,
    read_requests,
    speculative_decode,
)
from dflash_train.evaluate.loading import default_stop_token_ids

K = 3  # block size 4
MAX_NEW = 20
TAPS = (1, 3)
MASK = 320


def _spec(variant: str):
    from dflash_train.config import validate_config

    overrides = tiny_run_overrides("unused") + [f"dflash={variant}", "dflash.block_size=4"]
    if variant == "dflash2":
        overrides += ["dflash.selector_rank=16", "dflash.selector_top_k=8"]
    cfg = validate_config(compose("dflash", overrides)).run.dflash
    return DraftSpec(cfg, TAPS, MASK, 6)


def untrained_export(target, out_dir, variant: str = "dflash"):
    """A freshly initialised draft for ``target``, written in the export format vLLM loads."""
    torch.manual_seed(0)
    draft = build_draft(target.salm.llm.config, _spec(variant), "sdpa")
    return write_export(out_dir, draft.config, draft.state_dict())


@pytest.fixture(scope="module")
def fmt(tiny_target):
    return build_prompt_format("qwen", tiny_target.tokenizer, "<|audio|>")


@pytest.fixture(scope="module")
def requests(tiny_target, fmt, demo_data, audio_estimator):
    """Real prompts (system/context/audio turn) of the demo validation cuts, with their audio spliced in."""
    _, val = demo_data
    inp = InputConfig(type="lhotse_as_conversation", cuts_path=str(val))
    found = list(read_requests(inp, fmt, audio_estimator))
    assert len(found) == 4 and all(hasattr(r, "prompt") for r in found)
    return [(r, prompt_embeddings(tiny_target, r.prompt)) for r in found]


@pytest.fixture(scope="module")
def rule(fmt):
    return StopRule(MAX_NEW, frozenset(default_stop_token_ids(fmt)))


@pytest.fixture(scope="module")
def greedy(tiny_target, requests, rule):
    """Target-only greedy outputs: the reference every speculative run must reproduce."""
    return [greedy_decode(TargetSession(tiny_target), embeds, rule) for _, embeds in requests]


class TargetOracle:
    """Proposals made by the target itself through the proposer interface: what verification will accept."""

    def __init__(self, target, k: int, wrong_at=None):
        self.target = target
        self.num_speculative_tokens = k
        self.wrong_at = wrong_at  # round -> proposal index made wrong on purpose (None: all right)
        self.rounds = 0

    def start(self, prompt_embeds, prefill, prompt_ids=None):
        self.session = TargetSession(self.target)
        self.session.prefill(prompt_embeds)

    def propose(self, bonus, position):
        assert self.session.length == position
        tokens, token = [], bonus
        for _ in range(self.num_speculative_tokens):
            token = int(self.session.extend([token]).logits[-1].argmax())
            tokens.append(token)
        self.session.crop(position)
        wrong = self.wrong_at(self.rounds) if self.wrong_at else None
        if wrong is not None:
            tokens[wrong] = (tokens[wrong] + 1) % self.target.vocab_size
        self.rounds += 1
        return tokens

    def extend(self, token_ids, verified):
        self.session.extend(token_ids)


def _check_bookkeeping(decoded, k, max_new):
    """Tokens = prefill bonus + (accepted + 1) per round, truncated inside the last round only."""
    rounds = decoded.accepted_per_round
    before_last = 1 + sum(a + 1 for a in rounds[:-1])
    assert before_last < len(decoded.token_ids) <= 1 + sum(a + 1 for a in rounds)
    assert all(0 <= a <= k for a in rounds)
    assert decoded.finish_reason == ("length" if len(decoded.token_ids) == max_new else "stop")


class RecordingProposer(DraftProposer):
    """The real proposer, keeping each round's bonus position and proposals."""

    def start(self, prompt_embeds, prefill, prompt_ids=None):
        super().start(prompt_embeds, prefill)
        self.prompt_length, self.proposals = prompt_embeds.shape[1], []

    def propose(self, bonus, position):
        tokens = super().propose(bonus, position)
        self.proposals.append((position - self.prompt_length, tokens))
        return tokens


def _accepted_against(reference, proposals) -> list[int]:
    """Accepted tokens per round, from the target-only output alone: the proposals' longest prefix that
    equals the reference continuation after the round's bonus. The last round may run past the end of
    the truncated reference, so only rounds that are decided inside it are returned."""
    accepted = []
    for bonus_index, tokens in proposals:
        following = reference[bonus_index + 1 : bonus_index + 1 + len(tokens)]
        matched = next((i for i, (a, b) in enumerate(zip(tokens, following)) if a != b), len(following))
        if matched == len(following) < len(tokens):
            break  # undecided: the reference ends inside this block
        accepted.append(matched)
    return accepted


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_untrained_draft_is_greedy_equal_with_mal_near_one(tiny_target, requests, greedy, rule, tmp_path, variant):
    draft = load_draft(str(untrained_export(tiny_target, tmp_path, variant)), tiny_target, "cpu", "float32")
    accepted_per_round = []
    for (request, embeds), reference in zip(requests, greedy):
        proposer = RecordingProposer(draft, tiny_target, K)
        out = speculative_decode(TargetSession(tiny_target, draft.target_layer_ids), proposer, embeds, rule)
        assert out.token_ids == reference.token_ids, f"{request.id}: speculation changed the greedy output"
        assert out.finish_reason == reference.finish_reason
        _check_bookkeeping(out, K, MAX_NEW)
        # what the decoder counted equals what comparing its proposals with the target-only output gives
        independent = _accepted_against(reference.token_ids, proposer.proposals)
        assert len(proposer.proposals) == len(out.accepted_per_round) and len(independent) >= len(proposer.proposals) - 1
        assert out.accepted_per_round[: len(independent)] == independent
        accepted_per_round += out.accepted_per_round
    pooled = AcceptanceCounters.from_rounds(K, accepted_per_round)
    assert pooled.proposed == K * pooled.rounds
    assert pooled.mal < 1.2, f"an untrained draft accepted too much: MAL {pooled.mal}"
    print(f"untrained tiny {variant} draft: pooled MAL {pooled.mal:.3f} over {pooled.rounds} rounds (K={K})")


def test_oracle_proposer_reaches_k_plus_one(tiny_target, requests, greedy, rule):
    for (request, embeds), reference in zip(requests, greedy):
        out = speculative_decode(TargetSession(tiny_target, TAPS), TargetOracle(tiny_target, K), embeds, rule)
        assert out.token_ids == reference.token_ids
        counters = AcceptanceCounters.from_rounds(K, out.accepted_per_round)
        assert counters.accepted == K * counters.rounds and counters.mal == K + 1
        assert [p.rate for p in counters.positions()] == [1.0] * K
        _check_bookkeeping(out, K, MAX_NEW)


def test_partial_acceptance_is_counted_exactly_and_stays_greedy_equal(tiny_target, requests, greedy, rule):
    """Round r proposes r % (K+1) right tokens, then a wrong one: every crop/extend path is exercised."""
    pattern = lambda r: r % (K + 1)  # noqa: E731
    for (request, embeds), reference in zip(requests, greedy):
        oracle = TargetOracle(tiny_target, K, wrong_at=lambda r: pattern(r) if pattern(r) < K else None)
        out = speculative_decode(TargetSession(tiny_target, TAPS), oracle, embeds, rule)
        assert out.token_ids == reference.token_ids
        assert out.accepted_per_round == [pattern(r) for r in range(len(out.accepted_per_round))]
        counters = AcceptanceCounters.from_rounds(K, out.accepted_per_round)
        assert counters.accepted_per_position[0] == sum(1 for a in out.accepted_per_round if a >= 1)


class ContextRecomputingProposer(DraftProposer):
    """The same draft without a KV cache: each round re-reads every verified feature from position 0."""

    def start(self, prompt_embeds, prefill, prompt_ids=None):
        super().start(prompt_embeds, prefill)
        self.verified = prefill.features

    @torch.no_grad()
    def propose(self, bonus, position):
        assert self.verified.shape[0] == position, "the context must be exactly the verified tokens"
        k = self.num_speculative_tokens
        block = torch.tensor([[bonus] + [self.draft.mask_token_id] * k])
        hidden = self.draft(
            position_ids=torch.arange(0, position + k + 1)[None],
            noise_embedding=self.draft.embed_noise_block(self._embedder, block),
            target_hidden=self.verified[None],
            **self.variant.decode_forward_kwargs(k),
        )[:, 1:]
        logits = self.draft.compute_logits(hidden, self.target.lm_head).float()
        return self.variant.propose(self.draft, hidden, logits, bonus)

    def extend(self, token_ids, verified):
        self.verified = torch.cat([self.verified, verified.features])


@pytest.fixture(scope="module")
def trained_draft(tiny_salm_dir, tiny_target, requests, greedy, tmp_path_factory):
    """A DFlash draft trained on the target's own greedy replies to these prompts (offline labels in memory)."""
    from listdata import ListDataModule

    from dflash_train.config import validate_config
    from dflash_train.training.recipe import train

    examples = []
    for (request, _), reference in zip(requests, greedy):
        prompt = request.prompt
        ids = np.concatenate([prompt.input_ids, np.asarray(reference.token_ids, dtype=prompt.input_ids.dtype)])
        mask = np.concatenate([np.zeros(len(prompt.input_ids), bool), np.ones(len(reference.token_ids), bool)])
        examples.append(type(prompt)(**{**prompt.__dict__, "input_ids": ids, "loss_mask": mask}))
    batch = collate_padded(examples, tiny_target.pad_id, "train")
    run_dir = tmp_path_factory.mktemp("trained")
    overrides = tiny_run_overrides(tiny_salm_dir) + [
        "dflash=dflash", "trainer=cpu", "trainer.max_steps=60", "trainer.val_check_interval=60",
        "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        "dflash.block_size=4", "dflash.num_anchors=64", "dflash.lr=1e-2", "dflash.label_source=ground_truth",
        f"dflash.target_layer_ids={list(TAPS)}", f"dflash.mask_token_id={MASK}",
        f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false",
    ]
    summary = train(validate_config(compose("dflash", overrides)), lambda run, target: ListDataModule([batch], [batch]))
    return load_draft(str(summary.export_dir), tiny_target, "cpu", "float32")


def test_trained_draft_is_accepted_and_cache_holds_verified_context_only(tiny_target, requests, greedy, rule,
                                                                         trained_draft):
    total = AcceptanceCounters(K)
    for (request, embeds), reference in zip(requests, greedy):
        session = TargetSession(tiny_target, trained_draft.target_layer_ids)
        proposer = RecordingProposer(trained_draft, tiny_target, K)
        out = speculative_decode(session, proposer, embeds, rule)
        assert out.token_ids == reference.token_ids
        _check_bookkeeping(out, K, MAX_NEW)
        independent = _accepted_against(reference.token_ids, proposer.proposals)
        assert len(independent) >= len(out.accepted_per_round) - 1
        assert out.accepted_per_round[: len(independent)] == independent
        recomputed = speculative_decode(TargetSession(tiny_target, trained_draft.target_layer_ids),
                                        ContextRecomputingProposer(trained_draft, tiny_target, K), embeds, rule)
        assert recomputed.accepted_per_round == out.accepted_per_round
        total = total + AcceptanceCounters.from_rounds(K, out.accepted_per_round)
    print(f"trained tiny draft: pooled MAL {total.mal:.3f} over {total.rounds} rounds (K={K})")
    assert total.mal > 1.5, f"a draft trained on these very replies should be accepted: MAL {total.mal}"


def _text_llm(tiny_target):
    """A random Hugging Face Qwen3 causal LM of the tiny target's shape."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**tiny_target.llm_config.to_dict())).eval()


def test_every_target_implements_the_frozen_target_protocol(tiny_target):
    from dflash_train.target import FrozenTarget
    from dflash_train.target.causal_lm import CausalLMTarget

    members = {name for name in vars(FrozenTarget) if not name.startswith("_")} | set(FrozenTarget.__annotations__)
    assert {"splice_batch", "forward_taps", "forward_cached", "new_cache", "perception", "llm_config"} <= members
    text_only = CausalLMTarget(_text_llm(tiny_target), tiny_target.pad_id, tiny_target.tokenizer)
    for target in (tiny_target, text_only):
        missing = sorted(name for name in members if not hasattr(target, name))
        assert not missing, f"{type(target).__name__} lacks {missing}"


def test_a_text_only_target_decodes_through_the_protocol_like_hf_generate(tiny_target):
    """The reference decoder's session uses only FrozenTarget members: a CausalLMTarget must decode
    exactly what the same LLM's own greedy ``generate`` produces."""
    from dflash_train.target.causal_lm import CausalLMTarget

    llm = _text_llm(tiny_target)
    target = CausalLMTarget(llm, tiny_target.pad_id)
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3]])
    rule = StopRule(12, frozenset())
    ours = greedy_decode(TargetSession(target), target.embed_tokens(prompt), rule)
    theirs = llm.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == theirs[0, prompt.shape[1]:].tolist() and ours.finish_reason == "length"


def test_dflash2_rounds_propose_what_nemo_automodels_own_decoder_proposes(tiny_target):
    """A DFlash2 round of the reference decoder (the draft over K + 1 query positions with its in-block
    convolutions, the candidate walk from the bonus token, verified context only in the draft cache) proposes
    exactly what nemo_automodel's own ``Qwen3DFlash2DraftModel.spec_generate`` proposes, round by round, on a
    text-only target. The draft's convolutions and selector are moved off their identity start (where DFlash2
    equals DFlash), so a walk, a convolution block or a context that differs shows as a different proposal."""
    from nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2 import (
        CandidateSelector,
        GroupedDynamicCausalConv,
    )

    from dflash_train.target.causal_lm import CausalLMTarget

    llm = _text_llm(tiny_target)
    draft = build_draft(tiny_target.salm.llm.config, _spec("dflash2"), "sdpa").eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
                for parameter in module.parameters():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    walked: list[list[int]] = []
    walk = draft.candidate_selector.walk

    def recording_walk(*args, **kwargs):
        path, candidates, probs = walk(*args, **kwargs)
        walked.append(path[0].tolist())
        return path, candidates, probs

    draft.candidate_selector.walk = recording_walk
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 120, 64]])
    nemo_ids = draft.spec_generate(llm, prompt, max_new_tokens=MAX_NEW, stop_token_ids=None, temperature=0.0)
    nemo_rounds, walked = walked, []
    target = CausalLMTarget(llm, tiny_target.pad_id)
    ours = speculative_decode(TargetSession(target, draft.target_layer_ids), DraftProposer(draft, target, K),
                              target.embed_tokens(prompt), StopRule(MAX_NEW, frozenset()))
    assert ours.token_ids == nemo_ids[0, prompt.shape[1]:].tolist()
    assert len(walked) >= 3 and walked == nemo_rounds[:len(walked)], (walked, nemo_rounds)
    print(f"DFlash2 rounds {len(walked)}, accepted per round {ours.accepted_per_round}, proposals {walked}")
