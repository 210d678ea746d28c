"""canary-qwen-2.5b's structure served by vLLM's CPU build: a tiny SALM with tied embeddings, a linear projection
and LoRA adapters on its LLM (``python -m dflash_train.testing.tiny_salm --tie-word-embeddings
--linear-projection --lora-rank 4 --lora-alpha 8``), written for vLLM by ``dflash-export-target`` (adapters
merged, scaling lora_alpha / r), served with a DFlash draft of its shape.

Greedy speculative output equals target-only output; the target-only tokens equal ``dflash-eval``'s reference
decoder on the LoRA checkpoint itself (PEFT applying the adapters, not the merge), and differ from the
adapter-free model's; vLLM's spec-decode counters equal the reference decoder's. Both sides run the LLM in
float32 (as tests/vllm_serving/test_reference_parity.py does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_untrained_export

from dflash_train.vllm_plugin.acceptance import first_mismatches

DTYPE = "float32"
REQUESTS = 4


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory) -> Path:
    from dflash_train.testing import tiny_salm

    out = tmp_path_factory.mktemp("lora") / "target"
    assert tiny_salm.main(["--out", str(out), "--tie-word-embeddings", "--linear-projection", "--lora-rank", "4",
                           "--lora-alpha", "8"]) == 0
    return out


@pytest.fixture(scope="module")
def adapter_free_checkpoint(lora_checkpoint, tmp_path_factory) -> Path:
    """The same SALM without its adapters: the base weights under the plain names, no lora block."""
    from dflash_train.testing.tiny_salm import without_adapters

    return without_adapters(lora_checkpoint, tmp_path_factory.mktemp("base") / "target")


@pytest.fixture(scope="module")
def lora_served(lora_checkpoint, tmp_path_factory) -> Path:
    from dflash_train.target.vllm_export import export_target

    return export_target(lora_checkpoint, tmp_path_factory.mktemp("served") / "target")


@pytest.fixture(scope="module")
def lora_draft(lora_served, tmp_path_factory) -> Path:
    """An untrained (seeded) DFlash draft of the demo draft's shape against the LoRA target."""
    return write_untrained_export(lora_served, "dflash", tmp_path_factory.mktemp("draft") / "export",
                                  demo_shape=False)


@pytest.fixture(scope="module")
def requests(lora_served, validation_cuts):
    from transformers import AutoTokenizer

    from dflash_train.vllm_plugin.serving import validation_requests

    return validation_requests(validation_cuts, AutoTokenizer.from_pretrained(lora_served), REQUESTS)


def _reference(target: Path, draft: Path, cuts: Path, max_tokens: int):
    """``dflash-eval``'s reference decoder on ``target`` with ``draft``, the first :data:`REQUESTS` utterances."""
    from dflash_train.config.schema import InputConfig
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import DRAFT, evaluate, prepare

    settings, loaded = prepare(TargetSource(checkpoint=str(target)), {DRAFT: str(draft)},
                               InputConfig(type="lhotse_as_conversation", cuts_path=str(cuts)),
                               max_new_tokens=max_tokens, dtype=DTYPE, device="cpu", limit=REQUESTS)
    report = evaluate(settings, loaded)
    assert not report.failures, report.failures
    return report


def test_vllm_serves_the_lora_target_with_its_adapters_applied(lora_checkpoint, adapter_free_checkpoint, lora_served,
                                                               lora_draft, requests, validation_cuts, max_tokens,
                                                               serving_reports):
    from dflash_train.evaluate.run import DRAFT
    from dflash_train.vllm_plugin.serving import serve

    target_only = serve(lora_served, requests, max_tokens, dtype=DTYPE)
    speculative = serve(lora_served, requests, max_tokens, draft=lora_draft, dtype=DTYPE)
    assert all(target_only.token_ids) and first_mismatches(target_only.token_ids, speculative.token_ids) == {}
    lora = _reference(lora_checkpoint, lora_draft, validation_cuts, max_tokens)
    assert first_mismatches(target_only.token_ids, [s.target.token_ids for s in lora.samples]) == {}
    assert first_mismatches(speculative.token_ids, [s.drafts[DRAFT].token_ids for s in lora.samples]) == {}
    base = _reference(adapter_free_checkpoint, lora_draft, validation_cuts, max_tokens)
    assert [s.target.token_ids for s in base.samples] != target_only.token_ids, "the adapters changed no token"
    reference, served = lora.counters(DRAFT), speculative.counters
    serving_reports.append(f"LoRA target {lora_served} (float32, untrained draft): reference decoder "
                           f"{reference.accepted} accepted / {reference.rounds} rounds; vLLM {served.accepted} / "
                           f"{served.rounds}")
    assert served.rounds > 0 and (reference.rounds, list(reference.accepted_per_position)) == (
        served.rounds, list(served.accepted_per_position))
