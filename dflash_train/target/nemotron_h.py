"""A SpeechLM with a Nemotron-H language model, read from its checkpoint files (NeMo's layout).

NeMo's own SpeechLM MTP checkpoints pair NeMo's audio perception with a Nemotron-H LLM. NeMo 3.0's
``SALM`` class cannot build that backbone (it expects ``model.embed_tokens``), so this target
assembles the same model from the directory: NeMo's ``AudioPerceptionModule`` from the config's
``perception`` block, Hugging Face's ``NemotronHForCausalLM`` from ``llm_backbone/config.json``,
the tokenizer at the root, and the weights of ``model.safetensors`` under NeMo's names:

    perception.*                   the perception module
    llm.model.embed_tokens.weight  the embedding table   (HF: model.embeddings.weight)
    llm.model.layers.<i>.*         decoder blocks        (HF: model.layers.<i>.*)
    llm.model.norm.weight          the final norm        (HF: model.norm_f.weight)
    llm.lm_head.weight             the LM head
    llm.mtp.*                      MTP heads: not the target's (:mod:`dflash_train.draft.mtp`)

The reference decoder uses it for such a checkpoint; serving reads the same names (vLLM's loader,
through NeMo's hybrid backend).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_train.constants import CONFIG_FILE, LLM_BACKBONE_DIR, SAMPLE_RATE, WEIGHTS_FILE
from dflash_train.errors import ConfigError
from dflash_train.files import load_state_exactly, read_json_object
from dflash_train.target.audio import AudioLLM

NEMOTRON_H = "nemotron_h"


def backbone_model_type(checkpoint: str | Path) -> str | None:
    """The model type of a SALM checkpoint's LLM backbone (``llm_backbone/config.json``), if it has one."""
    backbone = Path(checkpoint) / LLM_BACKBONE_DIR / CONFIG_FILE
    if not backbone.is_file():
        return None
    return read_json_object(backbone, "rewrite the checkpoint with dflash-export-target").get("model_type")


def _hf_name(name: str) -> str | None:
    """The HF ``NemotronHForCausalLM`` name of a checkpoint tensor of the LLM (``None``: not the LLM's)."""
    if name == "llm.lm_head.weight":
        return "lm_head.weight"
    if name == "llm.model.embed_tokens.weight":
        return "model.embeddings.weight"
    if name == "llm.model.norm.weight":
        return "model.norm_f.weight"
    if name.startswith("llm.model."):
        return "model." + name[len("llm.model.") :]
    return None


class NemotronHSpeechLMTarget(AudioLLM):
    """NeMo's perception in front of a frozen Nemotron-H LLM (attention, MLP and Mamba blocks)."""

    def __init__(self, llm: nn.Module, perception: nn.Module, tokenizer, salm_config: dict):
        super().__init__()
        self.llm = llm
        self._perception = perception
        self._tokenizer = tokenizer
        self.salm_config = salm_config
        tag = salm_config["audio_locator_tag"]
        self._audio_locator_tag_id = int(tokenizer.convert_tokens_to_ids(tag))
        self.freeze()

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "NemotronHSpeechLMTarget":
        """Build and load the target of checkpoint directory ``path``; every mismatch is one line."""
        from nemo.collections.speechlm2.modules import AudioPerceptionModule
        from omegaconf import DictConfig
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoTokenizer, NemotronHForCausalLM

        path = Path(path)
        config = read_json_object(path / CONFIG_FILE, "point --target at a SpeechLM checkpoint directory")
        for key in ("perception", "audio_locator_tag"):
            if key not in config:
                raise ConfigError(f"{path / CONFIG_FILE} has no '{key}': it is not a SpeechLM checkpoint")
        backbone = AutoConfig.from_pretrained(path / LLM_BACKBONE_DIR)
        if backbone.model_type != NEMOTRON_H:
            raise ConfigError(f"{path} has a {backbone.model_type!r} backbone, not Nemotron-H: load it as a SALM")
        weights = load_file(str(path / WEIGHTS_FILE))
        llm = NemotronHForCausalLM(backbone).to(torch.float32)
        llm_weights = {_hf_name(k): v for k, v in weights.items() if _hf_name(k) is not None}
        load_state_exactly(llm, llm_weights, path / WEIGHTS_FILE, "llm.*")
        perception = AudioPerceptionModule(DictConfig(config["perception"]))
        perception_weights = {k[len("perception.") :]: v for k, v in weights.items() if k.startswith("perception.")}
        load_state_exactly(perception, perception_weights, path / WEIGHTS_FILE, "perception.*")
        tokenizer = AutoTokenizer.from_pretrained(path)
        if config["audio_locator_tag"] not in tokenizer.get_vocab():
            raise ConfigError(f"the tokenizer of {path} has no {config['audio_locator_tag']!r} token")
        return cls(llm, perception, tokenizer, config)

    @property
    def causal_lm(self) -> nn.Module:
        return self.llm

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def perception(self) -> nn.Module:
        return self._perception

    @property
    def encoder_chunk_size_seconds(self) -> float | None:
        return self.salm_config.get("encoder_chunk_size_seconds")

    @property
    def sampling_rate(self) -> int:
        return int(self.salm_config["perception"].get("preprocessor", {}).get("sample_rate", SAMPLE_RATE))

    @property
    def audio_locator_tag_id(self) -> int:
        return self._audio_locator_tag_id

    @property
    def pad_id(self) -> int:
        return int(self._tokenizer.pad_token_id)
