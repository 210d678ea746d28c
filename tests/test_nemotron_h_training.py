"""DFlash, DFlash2, MTP and EAGLE-3 drafts trained against a Nemotron-H SpeechLM target (Mamba-2, attention, MLP and
MoE blocks, SALMAutomodel's native names) on real speech through the real data pipeline: a run config
that inherits the recipe with NeMo's ``salm_automodel`` model keys trains, exports, reloads strictly,
resumes exactly, and its export decodes greedy-equal on the Mamba target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ResumeComparison, compose
from transformers import Qwen3Config

from dflash_train.config import validate_config
from dflash_train.training.recipe import train

BIN = Path(sys.executable).parent
EAGLE3_TAPS_OF_8_BLOCKS = [1, 3, 5]  # low / middle / high, derived from the target's depth


def _hybrid_recipe(hybrid_dir, demo_data, run_dir, variant, *extra):
    train_cuts, val_cuts = demo_data
    return validate_config(compose("demo", [
        "model=salm_automodel",
        f"model.pretrained_name={hybrid_dir}",
        f"dflash={variant}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20",
        "trainer.precision=32-true",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        "+trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false",
        f"exp_manager.explicit_log_dir={run_dir}",
        *extra,
    ]))


@pytest.mark.parametrize("variant, extra", [
    ("dflash", ["data.train_ds.packing=true", "data.train_ds.batch_tokens=512", "data.train_ds.use_bucketing=false"]),
    ("dflash2", ["dflash.selector_rank=16", "dflash.selector_top_k=8"]),
    ("mtp", []),
    ("eagle3", ["dflash.draft_vocab_size=64", "dflash.ttt_steps=3"]),
])
def test_each_variant_trains_and_its_export_reloads_strictly(tiny_hybrid_dir, tiny_hybrid_target, demo_data, tmp_path,
                                                            variant, extra):
    from dflash_train.evaluate.loading import load_draft, load_mtp_heads

    validated = _hybrid_recipe(tiny_hybrid_dir, demo_data, tmp_path / "run", variant, *extra)
    assert validated.run.data.prompt_format == "nemotron_nano_v3"  # salm_automodel's prompt_format, NeMo's spelling
    summary = train(validated)
    assert summary.steps == 4 and summary.train_loss is not None and summary.val_loss is not None
    # the demo recipe's serving validation decoded on the Mamba target (the session's restore and replay)
    assert summary.val_serving_mal is not None and summary.val_serving_mal >= 1.0
    if variant == "mtp":
        step, heads = load_mtp_heads(str(summary.export_dir), tiny_hybrid_target, "cpu", "float32")
        assert heads == validated.run.dflash.num_nextn_predict_layers
        return
    draft = load_draft(str(summary.export_dir), tiny_hybrid_target, "cpu", "float32")
    if variant == "eagle3":
        from dflash_train.draft.eagle3 import draft_taps

        assert draft_taps(draft) == EAGLE3_TAPS_OF_8_BLOCKS and draft.draft_vocab_size == 64
        return
    assert list(draft.target_layer_ids) == [1, 5]  # the default taps of an 8-block target with a 2-layer draft
    config = json.loads((summary.export_dir / "config.json").read_text())
    ours = {"num_target_layers", "dflash_config", "training_info", "is_causal"}  # the draft's and the export's
    foreign = set(config) - set(Qwen3Config().to_dict()) - ours
    assert not foreign, f"the target's own keys reached the draft config: {sorted(foreign)}"


def test_dflash2_resumes_exactly_on_a_hybrid_target(tiny_hybrid_dir, demo_data, tmp_path):
    def run(run_dir, steps):
        return train(_hybrid_recipe(tiny_hybrid_dir, demo_data, run_dir, "dflash2", f"trainer.max_steps={steps}",
                                    "trainer.val_check_interval=2", "exp_manager.checkpoint_every_n_steps=2", "exp_manager.resume_if_exists=true",
                                    "dflash.selector_rank=16", "dflash.selector_top_k=8"))

    worst = ResumeComparison(run, tmp_path, 4, 2).worst()
    assert worst <= 1e-6, f"resumed weights differ by {worst}"


def test_a_run_config_inheriting_the_recipe_with_nemos_keys_trains_and_decodes_greedy_equal(
        tiny_hybrid_dir, demo_data, tmp_path):
    """The runbook's shape: a run config whose defaults are the recipe and NeMo's salm_automodel model keys
    (training-only keys included), through the real CLI; then dflash-eval on the Mamba target."""
    train_cuts, val_cuts = demo_data
    run_dir = tmp_path / "run"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my_nemotron_run.yaml").write_text(f"""
defaults:
  - demo
  - override /model: salm_automodel
  - _self_
model:
  pretrained_name: {tiny_hybrid_dir}
  pretrained_llm: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16
  freeze_params: ["^llm\\\\..+$"]
  optimizer: {{lr: 1.0e-4}}
  automodel_backend: {{dispatcher: torch}}
data:
  train_ds:
    input_cfg: [{{type: lhotse_as_conversation, cuts_path: {train_cuts}}}]
    bucket_estimate_samples: 20
  validation_ds:
    input_cfg: [{{type: lhotse_as_conversation, cuts_path: {val_cuts}, name: val}}]
trainer: {{max_steps: 3, val_check_interval: 3, limit_val_batches: 1}}
exp_manager: {{explicit_log_dir: {run_dir}}}
""")
    proc = subprocess.run(
        [str(BIN / "dflash-train"), f"--config-dir={tmp_path / 'conf'}", "--config-name=my_nemotron_run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "model.freeze_params/optimizer steer training the SpeechLM itself" in out
    assert "Nemotron-H SpeechLM" in out and "Mamba blocks run on PyTorch reference ops" in out
    report = tmp_path / "eval.json"
    proc = subprocess.run(
        [str(BIN / "dflash-eval"), "--target", str(tiny_hybrid_dir), "--draft", str(run_dir / "export"),
         "--cuts", str(val_cuts), "--limit", "1", "--max-new-tokens", "16", "--prompt-format", "nemotron_nano_v3",
         "--json", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = next(iter(json.loads(report.read_text())["drafts"].values()))
    assert result["greedy_equal"] and result["acceptance"]["rounds"] > 0


def _document_alone(batch, document: int, placeholder_id: int):
    """One document of a packed row as a row of its own (its tokens, its audios), as an unpacked batch holds it."""
    import torch

    from dflash_train.data.batch import SpeechBatch

    where = batch.document_ids[0] == document
    audios_before = int((batch.input_ids[0, batch.document_ids[0] < document] == placeholder_id).sum())
    count = int((batch.input_ids[0, where] == placeholder_id).sum())
    lens = batch.audio_lens[audios_before:audios_before + count]
    frames = batch.audio_frames[audios_before:audios_before + count] if batch.audio_frames is not None else None
    alone = SpeechBatch(
        input_ids=batch.input_ids[:, where], loss_mask=batch.loss_mask[:, where],
        lengths=torch.tensor([int(where.sum())]), audios=batch.audios[audios_before:audios_before + count],
        audio_lens=lens, audios_per_row=[count], sample_ids=[batch.sample_ids[0].split("+")[document]],
    )
    return alone.with_placements(placeholder_id, frames)


def test_the_training_steps_target_forward_sees_each_packed_document_alone(tiny_hybrid_dir, tiny_hybrid_target,
                                                                          demo_data, tmp_path):
    """Guards the per-document isolation of the training path on a Mamba target: ``DFlashDraftModule.prepare`` (what
    ``training_step`` runs first) on a packed row of the recipe's own data module gives every document the taps and
    target-argmax labels that document gets as a row of its own, to 2e-6 of the taps' scale (fp32 rounding: the
    audio encoder batched with the row's other audios moves the spliced embeddings by ~6e-7, measured ~9e-5 on a
    tap scale of ~105, every document alike). Without the per-document ids reaching the target forward
    (``document_ids=None``), Mamba state and attention run from one document into the next: measured, taps off by
    ~4.8 (5% of the scale, ~2e4 times the bound) in the second to fourth document and their labels changed."""
    import torch

    from dflash_train.draft import DraftSpec
    from dflash_train.draft.anchors import documents_of
    from dflash_train.target.taps import derive_target_layer_ids
    from dflash_train.training.recipe import build_datamodule, setup_draft, setup_module

    run = _hybrid_recipe(tiny_hybrid_dir, demo_data, tmp_path / "run", "dflash", "data.train_ds.packing=true",
                         "data.train_ds.batch_tokens=512", "data.train_ds.use_bucketing=false",
                         "dflash.serving_val_samples=0").run
    target = tiny_hybrid_target
    assert target.recurrent_block_ids  # Mamba blocks: a leak carries their state across documents
    layer_ids = derive_target_layer_ids(target.num_layers, run.dflash.draft_num_hidden_layers)
    spec = DraftSpec(run.dflash, tuple(layer_ids), target.default_mask_token_id(), target.num_layers)
    datamodule = build_datamodule(run, target)
    module = setup_module(run, target, setup_draft(run, target, spec, "sdpa"), spec, "sdpa", datamodule, None, {})
    batch = next(iter(datamodule.train_dataloader()))
    assert batch.max_documents >= 2, batch.sample_ids
    placeholder = datamodule.prompt_format.audio_locator_tag_id
    with torch.no_grad():
        packed = module.prepare(batch)
        documents = documents_of(packed.doc_remaining)[0]
        scale, worst, labels_differ = packed.features.abs().max().item(), {}, []
        for document in range(batch.max_documents):
            alone = module.prepare(_document_alone(batch, document, placeholder))
            here = documents == document
            assert int(here.sum()) == alone.features.shape[1]
            assert torch.equal(packed.loss_mask[0, here], alone.loss_mask[0])
            worst[document] = (packed.features[0, here] - alone.features[0]).abs().max().item()
            if not torch.equal(packed.input_ids[0, here], alone.input_ids[0]):
                labels_differ.append(document)
    print(f"prepare on a packed row of {batch.max_documents} documents vs each alone: |taps difference| {worst} "
          f"(tap scale {scale:.3g}); labels differ in documents {labels_differ}")
    assert max(worst.values()) <= 2e-6 * scale, (
        f"packed taps differ from each document alone by {worst} (scale {scale:.3g})")
    assert not labels_differ, f"target-argmax labels of documents {labels_differ} differ from each document alone"
