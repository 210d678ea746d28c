"""``dflash-export-target``: a SALM checkpoint becomes a directory vLLM's NeMo SALM config accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import same_tensors

from dflash_train.cli.export_target import main
from dflash_train.constants import AUDIO_LOCATOR_TAG, SALM_ARCHITECTURE
from dflash_train.target.vllm_export import EMBEDDED_ASR, TargetExportError, export_target, serve_command

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def exported(tiny_salm_dir, tmp_path_factory):
    return export_target(tiny_salm_dir, tmp_path_factory.mktemp("served") / "target")


def test_export_writes_what_vllm_reads(tiny_salm_dir, exported):
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == [SALM_ARCHITECTURE] and cfg["model_type"] == "nemo_speechlm"
    assert cfg["pretrained_llm"] == str(exported / "llm_backbone") and cfg["tokenizer_path"] == str(exported)
    assert cfg["pretrained_asr"] == EMBEDDED_ASR and cfg["pretrained_weights"] is False
    assert cfg["perception"] == json.loads((tiny_salm_dir / "config.json").read_text())["perception"]
    backbone = json.loads((exported / "llm_backbone" / "config.json").read_text())
    assert backbone["architectures"] == ["Qwen3ForCausalLM"]
    assert (exported / "model.safetensors").read_bytes() == (tiny_salm_dir / "model.safetensors").read_bytes()


def test_nemo_vllm_config_and_tokenizer_accept_the_export(exported):
    """NeMo's vLLM config class (what vLLM builds from config.json) loads it from any working directory."""
    from nemo.collections.speechlm2.vllm.salm.config import NeMoSpeechLMConfig
    from transformers import AutoTokenizer

    config = NeMoSpeechLMConfig(**json.loads((exported / "config.json").read_text()))
    assert config.llm_architectures == ["Qwen3ForCausalLM"] and config.text_config.num_hidden_layers == 6
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert len(tokenizer(AUDIO_LOCATOR_TAG, add_special_tokens=False)["input_ids"]) == 1


def test_nemo_loads_the_export_with_identical_weights(tiny_target, exported):
    from nemo.collections.speechlm2.models import SALM

    reloaded = SALM.from_pretrained(str(exported)).state_dict()
    original = tiny_target.salm.state_dict()
    assert same_tensors(reloaded, original)


def test_in_place_rerun_fixes_paths_after_a_move(exported, tmp_path):
    """Through the installed command: its output is the one line saying what it wrote (no transformers notice
    about the ``nemo_speechlm`` model type)."""
    moved = shutil.copytree(exported, tmp_path / "moved")
    assert json.loads((moved / "config.json").read_text())["pretrained_llm"] == str(exported / "llm_backbone")
    proc = subprocess.run([str(BIN / "dflash-export-target"), str(moved), str(moved)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "nemo_speechlm" not in proc.stdout + proc.stderr
    assert proc.stdout == f"dflash-export-target: wrote {moved}\n"
    assert json.loads((moved / "config.json").read_text())["pretrained_llm"] == str(moved / "llm_backbone")


def test_wrong_audio_tag_and_missing_weights_are_one_line_errors(exported, tmp_path, capsys):
    bad = shutil.copytree(exported, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "audio_locator_tag": "<audio>"}))
    with pytest.raises(TargetExportError, match="serves only '<\\|audio\\|>'"):
        export_target(bad, tmp_path / "out")
    (bad / "model.safetensors").unlink()
    assert main([str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-export-target: error:") and "model.safetensors" in err and "\n" not in err


def test_serve_command_uses_k_of_block_size_minus_one(exported, tmp_path, capsys):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": {"block_size": 8}}))
    assert main([str(exported), str(exported), "--draft", str(draft)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == serve_command(exported, draft, 7)
    assert line.startswith(f"vllm serve {exported} ") and '"num_speculative_tokens": 7' in line
