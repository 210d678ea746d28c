"""Training MTP heads (``dflash=mtp``): the batched chain objective against cached decoding, the
target inputs it reads, config rules, the export into the target's directory, resume and warm start.

The serving side (vLLM's tokens and counters on the demo's trained MTP export) is
``tests/vllm_serving/test_mtp.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (UTTERANCES, ResumeComparison, chatml_speech_batch, compose, free_port, run_launchers,
                      tiny_run_overrides, two_batch_data)
from safetensors.torch import load_file

from dflash_train.config import validate_config
from dflash_train.data.packing import document_layout
from dflash_train.draft.mtp import MTPStep, checkpoint_name
from dflash_train.draft.mtp_objective import MTPTrainerCore
from dflash_train.errors import ConfigError
from dflash_train.variants.base import decayed_step_weights
from dflash_train.variants.mtp import valid_anchor_mask

TEXTS = list(UTTERANCES.values())
BIN = Path(sys.executable).parent


def _random_step(pattern: str, hidden: int = 32) -> MTPStep:
    torch.manual_seed(0)
    step = MTPStep(hidden, 4, 2, 8, 1e-6, pattern).double()
    for param in step.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return step


def _cached_chain(step: MTPStep, hidden, embeds, start: int, anchor: int, depth: int) -> torch.Tensor:
    """What vLLM's proposer computes for anchor ``anchor`` of a document starting at ``start``: entries of
    positions start..anchor from the target's hidden states, then ``depth - 1`` steps on its own output."""
    cache = step.new_cache()
    out = step(embeds[start + 1 : anchor + 2], hidden[start : anchor + 1], cache)[-1:]
    outs = [out]
    for k in range(2, depth + 1):
        out = step(embeds[anchor + k : anchor + k + 1], out, cache)
        outs.append(out)
    return torch.cat(outs)


@pytest.mark.parametrize("depth, pattern", [(1, "*"), (3, "*"), (3, "**")])
def test_the_batched_objective_is_cached_decoding_chain_by_chain(depth, pattern):
    """Every (anchor, step) state of the one-pass objective equals the KV-cached decoding of that anchor,
    with two packed documents and padding in a row; the loss is Σ w·CE / Σ w over those chains."""
    step = _random_step(pattern)
    head = torch.nn.Linear(32, 50, bias=False).double()
    weights = [1.0, 0.6, 0.3][:depth]
    core = MTPTrainerCore(step, head, weights, num_anchors=1000)
    documents = torch.tensor([[0] * 9 + [1] * 8 + [-1] * 3, [0] * 18 + [-1] * 2])
    layout = document_layout(documents)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 20, 32, dtype=torch.double, generator=generator)
    embeds = torch.randn(2, 20, 32, dtype=torch.double, generator=generator)
    ids = torch.randint(0, 50, (2, 20), generator=generator)
    loss_mask = documents >= 0
    loss_mask[0, 9:12] = False  # the second document's prompt

    states, anchors, keep = core.draft_states(hidden, loss_mask, layout.doc_remaining, embeds)
    expected = valid_anchor_mask(loss_mask, layout.doc_remaining, depth)
    drawn = {(b, int(a)) for b in range(2) for a, k in zip(anchors[b], keep[b]) if k}
    assert drawn == {(int(b), int(a)) for b, a in expected.nonzero()}
    assert (0, 8 - depth - 1) in drawn and (0, 8 - depth) not in drawn  # the chain must end inside its document
    assert (0, 11) in drawn and (0, 10) not in drawn  # the bonus token (p + 1) must be supervised

    total, weight_sum = 0.0, 0.0
    for b, anchor in sorted(drawn):
        n = int(((anchors[b] == anchor) & keep[b]).nonzero())
        start = int((documents[b, : anchor + 1] != documents[b, anchor]).sum())
        reference = _cached_chain(step, hidden[b], embeds[b], start, anchor, depth)
        torch.testing.assert_close(states[b, n], reference, rtol=0, atol=1e-12)
        logits = head(reference).detach()
        for k in range(depth):
            label = ids[b, anchor + k + 2]
            if loss_mask[b, anchor + k + 2]:
                total += weights[k] * float(torch.nn.functional.cross_entropy(logits[k : k + 1], label[None]))
                weight_sum += weights[k]
    with torch.no_grad():
        metrics = core(ids, hidden, loss_mask.double(), doc_remaining=layout.doc_remaining, embeds=embeds)
    assert float(metrics.loss_weight) == pytest.approx(weight_sum, rel=1e-6)  # float32 weights
    assert float(metrics.loss) == pytest.approx(total / weight_sum, rel=1e-6)
    assert int(metrics.valid_blocks) == len(drawn) and int(metrics.step_tokens.sum()) == int(metrics.valid_tokens)


def test_num_anchors_caps_the_chains_per_row_and_the_draw_follows_the_seed():
    step = _random_step("*")
    core = MTPTrainerCore(step, torch.nn.Linear(32, 50, bias=False).double(), [1.0, 0.5], num_anchors=3)
    valid = torch.zeros(2, 30, dtype=torch.bool)
    valid[0, 4:20] = True
    valid[1, 7:9] = True
    torch.manual_seed(5)
    anchors, keep = core.sample_anchors(valid)
    torch.manual_seed(5)
    again, _ = core.sample_anchors(valid)
    assert anchors.shape == (2, 3) and keep.tolist() == [[True] * 3, [True, True, False]]
    assert torch.equal(anchors, again) and anchors[1, :2].tolist() == [7, 8]
    assert all(valid[0, a] for a in anchors[0]) and anchors[0].tolist() == sorted(anchors[0].tolist())


def test_step_weights_default_to_the_block_losss_decay():
    assert decayed_step_weights(3, 4.0) == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)])
    assert decayed_step_weights(2, 0.0) == [1.0, 1.0]


def test_parameter_names_are_nemos_mtp_layout():
    """Our step's parameters map onto the names NeMo's SpeechLM MTP checkpoints (and vLLM) use."""
    from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, _mtp_weights

    nemo = set(_mtp_weights(TinyMTPSpec(heads=3), torch.Generator().manual_seed(0)))
    ours = {checkpoint_name(name, 1) for name in MTPStep(64, 4, 2, 16, 1e-5, "*").state_dict()}
    assert ours == nemo
    two = {checkpoint_name(name, 2) for name in MTPStep(64, 4, 2, 16, 1e-5, "**").state_dict()}
    assert "llm.mtp.layers.0.eh_proj.weight" in two and "llm.mtp.layers.1.final_layernorm.weight" in two
    assert "llm.mtp.layers.1.mixer.q_proj.weight" in two and "llm.mtp.layers.1.norm.weight" in two


def _mtp_recipe(salm_dir, run_dir, *extra):
    overrides = [o for o in tiny_run_overrides(salm_dir) if not o.startswith("dflash.")] + [
        "dflash=mtp",
        "trainer=cpu",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "+trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false",
        "dflash.lr=3e-3",
        f"exp_manager.explicit_log_dir={run_dir}",
        "exp_manager.create_tensorboard_logger=false",
    ]
    return validate_config(compose("dflash", overrides + list(extra)))


def test_the_module_feeds_the_final_hidden_state_and_audio_fused_embeddings(tiny_salm_dir, tiny_target, speech_batch,
                                                                               tmp_path):
    """``features`` is the target's final post-norm hidden state (HF's last ``hidden_states`` entry), ``embeds``
    the audio frames' embeddings at audio positions and the (label) tokens' embeddings elsewhere."""
    from dflash_train.training.recipe import setup_draft, setup_module, setup_target

    validated = _mtp_recipe(tiny_salm_dir, tmp_path / "run")
    run = validated.run
    target, spec, half = setup_target(run)
    draft = setup_draft(run, target, spec, "sdpa")
    module = setup_module(run, target, draft, spec, "sdpa", None, half, dict(validated.trainer_kwargs))
    batch = chatml_speech_batch(tiny_target, speech_batch, TEXTS)
    inputs = module.prepare(batch)
    spliced = target.splice_batch(batch, spec.mask_token_id)
    with torch.no_grad():
        out = target.causal_lm(
            inputs_embeds=spliced.inputs_embeds, attention_mask=spliced.attention_mask, output_hidden_states=True
        )
    real = spliced.attention_mask
    torch.testing.assert_close(inputs.features[real], out.hidden_states[-1][real], rtol=0, atol=1e-5)
    audio = spliced.audio_mask
    assert audio.any() and torch.equal(inputs.embeds[audio], spliced.inputs_embeds[audio])
    text = real & ~audio
    assert torch.equal(inputs.embeds[text], target.embed_tokens(inputs.input_ids)[text])
    assert not torch.equal(inputs.input_ids[spliced.loss_mask], spliced.input_ids[spliced.loss_mask]), (
        "target_argmax labels should differ from the reply somewhere (the embeddings follow the labels)"
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("dflash.use_repeated_layer=false", "dflash.use_repeated_layer=false trains distinct heads"),
        ("dflash.num_nextn_predict_layers=0", "dflash.num_nextn_predict_layers=0 must be >= 1"),
        ("dflash.hybrid_override_pattern=E", "dflash.hybrid_override_pattern='E': the trained MTP step"),
        ("dflash.step_loss_weights=[1.0]", "dflash.step_loss_weights=[1.0] must list 2 non-negative weights"),
        ("dflash.target_layer_ids=[1]",
         "dflash.target_layer_ids is a DFlash key the mtp variant does not use; remove it (override "
         "~dflash.target_layer_ids)"),
        ("dflash.block_size=4", "dflash.block_size is a DFlash key the mtp variant does not use"),
        ("+dflash.selector_rank=8", "config key 'dflash.selector_rank' belongs to variant dflash2"),
    ],
)
def test_mtp_config_mistakes_fail_in_one_line(tiny_salm_dir, tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _mtp_recipe(tiny_salm_dir, tmp_path / "run", override)


def test_mtp_resume_is_exact_and_the_export_is_the_target_plus_heads(tiny_salm_dir, tiny_target, speech_batch,
                                                                    tmp_path):
    from dflash_train.training.recipe import train

    factory = two_batch_data(tiny_target, speech_batch)

    def recipe(run_dir, steps):
        return _mtp_recipe(tiny_salm_dir, run_dir, f"trainer.max_steps={steps}", "exp_manager.checkpoint_every_n_steps=3",
                           "dflash.num_anchors=6", "dflash.num_nextn_predict_layers=3")

    runs = ResumeComparison(lambda run_dir, steps: train(recipe(run_dir, steps), factory), tmp_path, 6, 3)
    straight, a = runs.straight, runs.straight_weights
    heads = sorted(k for k in a if k.startswith("llm.mtp."))
    assert runs.worst(heads) <= 1e-6

    source = load_file(str(tiny_salm_dir / "model.safetensors"))
    assert set(a) - set(heads) == set(source) and all(torch.equal(a[k], source[k]) for k in source)
    config = json.loads((straight.export_dir / "config.json").read_text())
    assert config["mtp"] == {"enabled": True, "num_nextn_predict_layers": 3, "use_repeated_layer": True,
                             "hybrid_override_pattern": "*"}
    assert config["pretrained_llm"] == str((straight.export_dir / "llm_backbone").resolve())
    assert config["training_info"]["variant"] == "mtp" and config["training_info"]["global_step"] == 6
    step, stored_heads = MTPStep.from_checkpoint(straight.export_dir)
    assert stored_heads == 3 and sum(p.numel() for p in step.parameters()) > 0

    # warm start: a fresh run seeded with the export starts from its heads
    from dflash_train.training.recipe import setup_draft, setup_target

    warm = _mtp_recipe(tiny_salm_dir, tmp_path / "warm", f"dflash.init_from_pretrained={straight.export_dir}").run
    target, spec, _ = setup_target(warm)
    seeded = setup_draft(warm, target, spec, "sdpa")
    assert all(torch.equal(a[k], v) for k, v in seeded.checkpoint_state().items())
    wrong = _mtp_recipe(tiny_salm_dir, tmp_path / "warm", f"dflash.init_from_pretrained={straight.export_dir}",
                        "dflash.hybrid_override_pattern=**").run
    with pytest.raises(ConfigError, match=r"trained with hybrid_override_pattern='\*' but this run uses '\*\*'"):
        setup_draft(wrong, target, dataclasses.replace(spec, cfg=wrong.dflash), "sdpa")


@pytest.fixture(scope="module")
def cli_runs(tiny_salm_dir, demo_data, tmp_path_factory) -> dict:
    """``dflash=mtp`` through the real command lines, launched side by side: ``one`` is ``dflash-train
    --config-name=demo`` in one process (4 steps, a rendezvous port of its own), ``two`` is ``torchrun -m
    dflash_train`` on two FSDP2 ranks (3 steps). Per name: ``(working directory, CompletedProcess)``; each run's
    directory is ``run`` in its working directory."""
    train_cuts, val_cuts = demo_data
    cwds = {name: tmp_path_factory.mktemp(f"mtp_cli_{name}") for name in ("one", "two")}
    common = [
        "--config-name=demo", "dflash=mtp", f"model.pretrained_name={tiny_salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}", f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20", "trainer.limit_val_batches=1",
    ]
    commands = {
        "one": [str(BIN / "dflash-train"), *common, "trainer.max_steps=4", "trainer.val_check_interval=4",
                f"exp_manager.explicit_log_dir={cwds['one'] / 'run'}"],
        "two": [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dflash_train", *common,
                "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.devices=2",
                "trainer.strategy.name=fsdp2", f"exp_manager.explicit_log_dir={cwds['two'] / 'run'}"],
    }
    envs = [dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port())), dict(os.environ)]
    procs = run_launchers(list(commands.values()), envs, 900, cwds=list(cwds.values()))
    return {name: (cwds[name], proc) for name, proc in zip(commands, procs)}


def test_the_cli_trains_mtp_heads_and_dflash_eval_decodes_the_export(cli_runs, demo_data):
    """The user's path: ``dflash-train --config-name=demo dflash=mtp``, then ``dflash-eval --mtp`` on the export."""
    _, val_cuts = demo_data
    tmp_path, proc = cli_runs["one"]
    run_dir = tmp_path / "run"
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    export = run_dir / "export"
    assert f"serve: vllm serve {export.resolve()} --trust-remote-code --speculative-config " \
           '\'{"method": "mtp", "num_speculative_tokens": 2}\'' in out
    report = tmp_path / "eval.json"
    proc = subprocess.run(
        [str(BIN / "dflash-eval"), "--target", str(export), "--mtp", "--cuts", str(val_cuts), "--limit", "2",
         "--max-new-tokens", "12", "--json", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(report.read_text())
    assert data["settings"]["num_speculative_tokens"] == 2  # the trained head count
    assert data["settings"]["draft_training_steps"] == {"mtp": 4}  # the export's training_info, as a draft's
    assert re.search(r"^export at step +4$", proc.stdout, re.MULTILINE), proc.stdout
    assert data["drafts"]["mtp"]["greedy_equal"] and data["drafts"]["mtp"]["acceptance"]["rounds"] > 0


def test_torchrun_trains_mtp_heads_on_two_fsdp2_ranks(cli_runs):
    """Two gloo processes through the real CLI: the FSDP2-sharded step (every sublayer gathered as it runs)
    trains, gathers and exports once; the export reloads strictly. (DDP shares the module's code path and
    replicates instead of sharding; FSDP2 is the stricter of the two.)"""
    tmp_path, proc = cli_runs["two"]
    run_dir = tmp_path / "run"
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("steps: 3; final train loss") == 1 and "no final export" not in out  # rank 0's console line
    _, heads = MTPStep.from_checkpoint(run_dir / "export")  # strict: every step tensor present, none extra
    assert heads == 2 and "export: wrote" in out
