"""canary-qwen-2.5b's structure at tiny width: a NeMo SALM whose FastConformer reaches a Qwen3 LLM with tied
embeddings through one linear projection, with LoRA adapters on the LLM (PEFT, the config's ``lora`` block,
nonzero B factors so they change the outputs).

The project's target loader reproduces NeMo's own ``SALM.from_pretrained`` of it; DFlash2 and MTP train on it
through the real CLI and resume exactly; ``dflash-eval`` decodes greedy-equal with both; ``dflash-export-target``
writes it with the adapters merged (``W + lora_alpha / r · B @ A``), and the export decodes the LoRA model's
tokens, not the adapter-free model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import chatml_speech_batch, free_port, same_tensors
from safetensors.torch import load_file

from dflash_train.cli import eval as eval_cli
from dflash_train.cli.export_target import main as export_main
from dflash_train.config.schema import ModelConfig
from dflash_train.target import open_speech_target
from dflash_train.testing import tiny_salm

RANK, ALPHA = 4, 8  # scaling alpha / r = 2; the inverse, 0.5, is a different model
LORA_ARGS = ["--tie-word-embeddings", "--linear-projection", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA)]
STEPS, STOP = 4, 2
TAPS = [0, 2, 4]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """The canary-shaped tiny SALM, written by the builder's documented command line."""
    out = tmp_path_factory.mktemp("lora") / "target"
    assert tiny_salm.main(["--out", str(out), *LORA_ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def nemo_salm(lora_dir):
    """NeMo's own load of the checkpoint (FP32, PEFT installs the adapters from the config's lora block)."""
    from nemo.collections.speechlm2.models import SALM

    return SALM.from_pretrained(str(lora_dir)).eval()


def _train(lora_dir, demo_data, run_dir: Path, variant: str, steps: int) -> subprocess.Popen:
    """``python -m dflash_train --config-name=demo`` on the LoRA SALM, started (not awaited)."""
    train_cuts, val_cuts = demo_data
    args = [
        "--config-name=demo", f"dflash={variant}", f"model.pretrained_name={lora_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}", f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20", f"trainer.max_steps={steps}", f"trainer.val_check_interval={STOP}",
        "trainer.limit_val_batches=1", "+trainer.num_sanity_val_steps=0", "dflash.serving_val_samples=0",
        "exp_manager.resume_if_exists=true",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]
    # launches run two at a time: each gets its own rendezvous port (Lightning's own pick raced: EADDRINUSE)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "dflash_train", *args], cwd=run_dir.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every launch; each must exit 0. Their consoles, in order."""
    outs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-4000:]
    return outs


@pytest.fixture(scope="module")
def runs(lora_dir, demo_data, tmp_path_factory) -> dict[str, Path]:
    """DFlash2 and MTP, each straight to :data:`STEPS` and stopped at :data:`STOP` then resumed to it: three waves
    of two launches side by side (the run directories by name). A checkpoint is written at each validation, so
    validation runs every :data:`STOP` steps (teacher-forced only: serving validation is other tests' subject)."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {f"{v}-{kind}": root / f"{v}-{kind}" for v in ("dflash2", "mtp") for kind in ("straight", "resumed")}
    _finish([_train(lora_dir, demo_data, dirs[f"{v}-straight"], v, STEPS) for v in ("dflash2", "mtp")])
    _finish([_train(lora_dir, demo_data, dirs[f"{v}-resumed"], v, STOP) for v in ("dflash2", "mtp")])
    _finish([_train(lora_dir, demo_data, dirs[f"{v}-resumed"], v, STEPS) for v in ("dflash2", "mtp")])
    return dirs


def _evaluate(tmp_path: Path, name: str, *args: str) -> dict:
    """``dflash-eval`` on the first two validation utterances, 12 tokens each; its JSON report."""
    report = tmp_path / f"{name}.json"
    code = eval_cli.main([*args, "--limit", "2", "--max-new-tokens", "12", "--device", "cpu", "--json", str(report)])
    assert code == 0, f"dflash-eval {name} exited {code}"
    return json.loads(report.read_text())


def _target_tokens(report: dict) -> list[list[int]]:
    return [sample["target"]["token_ids"] for sample in report["samples"]]


def test_the_builder_writes_nemos_lora_salm_layout(lora_dir, nemo_salm):
    """Tied embeddings (stored once), the IdentityConnector adapter with one linear projection, PEFT's names, and
    a lora block NeMo installs as written."""
    from nemo.collections.speechlm2.modules.perception import IdentityConnector
    from peft import PeftModel

    cfg = json.loads((lora_dir / "config.json").read_text())
    assert cfg["lora"] == {"r": RANK, "lora_alpha": ALPHA, "target_modules": list(tiny_salm.LORA_TARGET_MODULES),
                           "lora_dropout": 0.0}
    names = set(load_file(str(lora_dir / "model.safetensors")))
    layer = "llm.base_model.model.model.layers.0.self_attn.q_proj"
    assert {f"{layer}.base_layer.weight", f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight"} <= names
    assert not any("lm_head" in name for name in names)  # tied: the embedding table only
    assert isinstance(nemo_salm.llm, PeftModel) and isinstance(nemo_salm.perception.modality_adapter, IdentityConnector)
    assert isinstance(nemo_salm.perception.proj, torch.nn.Linear)
    assert nemo_salm.perception.proj.weight.shape == (64, 32)  # encoder d_model 32 -> LLM hidden 64


def test_the_loader_reproduces_nemos_lora_salm_and_the_adapters_change_its_outputs(lora_dir, nemo_salm,
                                                                                    speech_batch):
    """Taps and logits of the project's target equal NeMo's ``SALM.from_pretrained`` on spliced speech rows; the
    adapter-free model (PEFT's ``disable_adapter``) is far from both.

    Measured: equal bit for bit (FP32); the adapters dominate this random tiny LLM: they move the logits by 1.34
    of their norm (max |change| 8.4 at logit scale 3.3) and change the greedy token at all 38 reply positions
    (a tied random LLM repeats its input token unless the adapters outweigh the embedding rows)."""
    target = open_speech_target(ModelConfig(pretrained_name=str(lora_dir)))
    assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()  # one tied tensor
    batch = chatml_speech_batch(target, speech_batch, ["hello world", "the draft proposes tokens", "a small model"])
    with torch.no_grad():
        spliced = target.splice_batch(batch, target.default_mask_token_id())
        ours = target.forward_taps(spliced.inputs_embeds, spliced.attention_mask, TAPS, return_last_hidden=True)
        ours_logits = target.lm_head(ours.last_hidden)
        theirs = nemo_salm.llm(inputs_embeds=spliced.inputs_embeds, attention_mask=spliced.attention_mask,
                               output_hidden_states=True)
        with nemo_salm.llm.disable_adapter():
            base_logits = nemo_salm.llm(inputs_embeds=spliced.inputs_embeds, attention_mask=spliced.attention_mask).logits
    rows = spliced.attention_mask
    theirs_taps = torch.cat([theirs.hidden_states[i + 1] for i in TAPS], dim=-1)
    assert torch.equal(ours.features[rows], theirs_taps[rows])
    assert torch.equal(ours_logits[rows], theirs.logits[rows])
    reply = spliced.loss_mask
    effect = (theirs.logits[reply] - base_logits[reply]).norm() / theirs.logits[reply].norm()
    changed = (theirs.logits[reply].argmax(-1) != base_logits[reply].argmax(-1)).float().mean()
    print(f"LoRA effect: {effect:.3f} of the logits' norm, max |change| "
          f"{(theirs.logits[reply] - base_logits[reply]).abs().max():.2f} at logit scale "
          f"{theirs.logits[reply].abs().max():.2f}; greedy token changed at {changed:.0%} of {int(reply.sum())} positions")
    assert effect > 0.3 and changed > 0.1


def test_dflash2_and_mtp_train_through_the_cli_and_resume_exactly(runs):
    """Weights of the run stopped at step 2 and resumed to 4 equal the straight 4-step run's, for both."""
    for variant in ("dflash2", "mtp"):
        straight = load_file(str(runs[f"{variant}-straight"] / "export" / "model.safetensors"))
        resumed = load_file(str(runs[f"{variant}-resumed"] / "export" / "model.safetensors"))
        assert same_tensors(straight, resumed), variant
        assert json.loads((runs[f"{variant}-resumed"] / "run_info.json").read_text())["start_step"] == STOP, variant


@pytest.fixture(scope="module")
def served_lora(lora_dir, tmp_path_factory) -> Path:
    """``dflash-export-target`` on the LoRA SALM."""
    served = tmp_path_factory.mktemp("served") / "target"
    assert export_main([str(lora_dir), str(served)]) == 0
    return served


def test_the_vllm_target_holds_the_adapters_merged_as_peft_merges_them(lora_dir, served_lora):
    """The export's LLM weights equal PEFT's ``merge_and_unload`` (``W + lora_alpha / r · B @ A``) bit for bit, under
    the plain names, and its config has no lora block (nothing would merge them twice): NeMo's vLLM config class
    reads it with ``lora`` None, so NeMo's plugin passes the weights through."""
    from nemo.collections.speechlm2.models import SALM
    from nemo.collections.speechlm2.vllm.salm.config import NeMoSpeechLMConfig

    cfg = json.loads((served_lora / "config.json").read_text())
    assert "lora" not in cfg and NeMoSpeechLMConfig(**cfg).lora is None
    merged = SALM.from_pretrained(str(lora_dir)).llm.merge_and_unload().state_dict()  # PEFT's own merge
    exported = load_file(str(served_lora / "model.safetensors"))
    assert same_tensors({k: v for k, v in exported.items() if k.startswith("llm.")},
                        {f"llm.{k}": v for k, v in merged.items() if k != "lm_head.weight"})  # tied: stored once


def test_the_exports_decode_greedy_equal_and_the_vllm_target_decodes_the_lora_models_tokens(
        lora_dir, served_lora, runs, demo_data, tmp_path):
    """``dflash-eval`` with the DFlash2 draft and with the MTP export's heads is greedy-equal; the vLLM-ready
    target's target-only tokens are the LoRA model's, and those are not the adapter-free model's."""
    _, val_cuts = demo_data
    draft = str(runs["dflash2-straight"] / "export")
    lora = _evaluate(tmp_path, "lora", "--target", str(lora_dir), "--draft", draft, "--cuts", str(val_cuts))
    assert all(result["greedy_equal"] for result in lora["drafts"].values())
    mtp = _evaluate(tmp_path, "mtp", "--target", str(runs["mtp-straight"] / "export"), "--mtp", "--cuts", str(val_cuts))
    assert mtp["drafts"]["mtp"]["greedy_equal"] and mtp["drafts"]["mtp"]["acceptance"]["rounds"] > 0

    tokens = _target_tokens(lora)
    assert _target_tokens(_evaluate(tmp_path, "served", "--target", str(served_lora), "--draft", draft,
                                    "--cuts", str(val_cuts))) == tokens
    base = _evaluate(tmp_path, "base", "--target", str(tiny_salm.without_adapters(lora_dir, tmp_path / "base")), "--draft", draft,
                     "--cuts", str(val_cuts))
    assert _target_tokens(base) != tokens
    print(f"target-only tokens, LoRA / merged export: {tokens}; adapter-free: {_target_tokens(base)}")


@pytest.mark.parametrize("key, value", [("use_dora", True), ("rank_pattern", {"q_proj": 2})])
def test_a_lora_one_scaling_cannot_merge_is_one_line_and_writes_nothing(lora_dir, tmp_path, key, value):
    import shutil

    from dflash_train.target.vllm_export import TargetExportError, export_target

    source = tmp_path / "source"
    shutil.copytree(lora_dir, source)
    cfg = json.loads((source / "config.json").read_text())
    cfg["lora"][key] = value
    (source / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetExportError, match=f"sets lora.{key}: dflash-export-target merges plain LoRA only"):
        export_target(source, tmp_path / "served")
    assert not (tmp_path / "served").exists()


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "-1"], "--lora-rank -1 is negative: give 0 (no LoRA) or a rank >= 1"),
    (["--lora-rank", "2", "--lora-target-modules", ","], "--lora-target-modules is empty"),
    (["--lora-rank", "2", "--lora-target-modules", "q_proj,qproj"],
     "--lora-target-modules names ['qproj'], not a linear layer of a Qwen3 block"),
])
def test_a_bad_lora_option_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        tiny_salm.main(["--out", str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2 and not (tmp_path / "out").exists()
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m dflash_train.testing.tiny_salm: error: ") and message in line
