"""A SpeechLM with a Nemotron-H language model, read from its checkpoint files (NeMo's layout).

NeMo's SpeechLMs with a Nemotron-H LLM (``SALMAutomodel`` and NeMo's SpeechLM MTP checkpoints) pair
NeMo's audio perception with a hybrid LLM of Mamba-2 (``M``), attention (``*``), MLP (``-``) and
MoE (``E``) blocks. NeMo 3.0's ``SALM`` class cannot build that backbone (it expects
``model.embed_tokens``) and ``SALMAutomodel`` builds it only on a GPU (nemo_automodel's Mamba
mixer needs the CUDA ``mamba_ssm`` kernels), so this target assembles the same model from the
directory: NeMo's ``AudioPerceptionModule`` from the config's ``perception`` block, Hugging Face's
``NemotronHForCausalLM`` from ``llm_backbone/config.json`` (PyTorch reference ops on CPU), the
tokenizer at the root, and the weights of ``model.safetensors``. Two name sets are read:

    NeMo / HF names                      SALMAutomodel's native names (nemo_automodel's modules)
    llm.model.embed_tokens.weight        the same                      (HF: model.embeddings.weight)
    llm.model.norm.weight                the same                      (HF: model.norm_f.weight)
    ...mixer.{A_log,D,dt_bias}           ...mixer._fp32_params.{A_log,D,dt_bias}
    ...experts.up_proj   [E, I, H]       ...experts.gate_and_up_projs [E, H, I]  (transposed)
    ...experts.down_proj [E, H, I]       ...experts.down_projs        [E, I, H]  (transposed)
    (none)                               ...._extra_state              (Transformer Engine's; dropped)
    llm.mtp.*                            MTP heads: not the target's (:mod:`dflash_train.draft.mtp`)

The mapping is exact (nemo_automodel's own NemotronH, built on CPU with a Mamba-free pattern,
gives the same logits as this target loaded from its state dict; tests/test_nemotron_h_target.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from dflash_train.constants import CONFIG_FILE, LLM_BACKBONE_DIR, MTP_WEIGHT_PREFIX, SAMPLE_RATE, WEIGHTS_FILE
from dflash_train.errors import ConfigError
from dflash_train.files import load_state_exactly, read_json_object
from dflash_train.target.audio import AudioLLM
from dflash_train.target.salm import rebuild_positional_tables

log = logging.getLogger(__name__)

NEMOTRON_H = "nemotron_h"
_NAME_ENDS = (  # (SALMAutomodel's native name end, HF's name end, whether the tensor is stored transposed)
    (".mixer._fp32_params.A_log", ".mixer.A_log", False),
    (".mixer._fp32_params.D", ".mixer.D", False),
    (".mixer._fp32_params.dt_bias", ".mixer.dt_bias", False),
    (".experts.gate_and_up_projs", ".experts.up_proj", True),
    (".experts.down_projs", ".experts.down_proj", True),
)
_WHOLE_NAMES = (("model.embed_tokens.weight", "model.embeddings.weight"), ("model.norm.weight", "model.norm_f.weight"))


def backbone_model_type(checkpoint: str | Path) -> str | None:
    """The model type of a SALM checkpoint's LLM backbone (``llm_backbone/config.json``), if it has one."""
    backbone = Path(checkpoint) / LLM_BACKBONE_DIR / CONFIG_FILE
    if not backbone.is_file():
        return None
    return read_json_object(backbone, "rewrite the checkpoint with dflash-export-target").get("model_type")


def _translated(name: str, tensor: torch.Tensor, to_hf: bool, layout: bool = True) -> tuple[str, torch.Tensor]:
    """One LLM tensor (name without ``llm.``) renamed between the two name sets (module docstring), in either
    direction; without ``layout`` only the renames that keep the tensor's layout apply."""
    for native, hf, transposed in _NAME_ENDS:
        source, target = (native, hf) if to_hf else (hf, native)
        if name.endswith(source) and (layout or not transposed):
            return name[: -len(source)] + target, tensor.transpose(1, 2) if transposed else tensor
    for native, hf in _WHOLE_NAMES if layout else ():
        if name == (native if to_hf else hf):
            return (hf if to_hf else native), tensor
    return name, tensor


def without_native_holders(name: str) -> str | None:
    """A checkpoint tensor's name without nemo_automodel's ``_fp32_params`` holder; ``None`` for Transformer
    Engine's ``_extra_state`` (no weight). Packed experts keep their names (their layout is the reader's)."""
    if name.endswith("._extra_state"):
        return None
    return _translated(name, torch.empty(0), to_hf=True, layout=False)[0]


def hf_llm_state(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LLM tensors of a SpeechLM checkpoint (``llm.*``, MTP heads left out) under HF ``NemotronHForCausalLM``
    names, from either name set (module docstring); Transformer Engine's ``_extra_state`` is dropped."""
    state = {}
    for name, tensor in weights.items():
        if name.startswith("llm.") and not name.startswith(MTP_WEIGHT_PREFIX) and not name.endswith("._extra_state"):
            hf_name, hf_tensor = _translated(name[len("llm.") :], tensor, to_hf=True)
            state[hf_name] = hf_tensor.contiguous()
    return state


def native_llm_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF ``NemotronHForCausalLM`` state dict under ``SALMAutomodel``'s native checkpoint names (``llm.*``);
    the inverse of :func:`hf_llm_state`, for writing checkpoints in that layout."""
    state = {}
    for name, tensor in hf_state.items():
        native_name, native_tensor = _translated(name, tensor, to_hf=False)
        state[f"llm.{native_name}"] = native_tensor.contiguous()
    return state


def _read_in_dtype(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of safetensors ``file``, floating ones cast to ``dtype`` one at a time as they are read (the
    host never holds the checkpoint in its stored precision beside the cast copy)."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return {key: _cast(f.get_tensor(key), dtype) for key in f.keys()}


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def mamba_implementation() -> str:
    """Which code runs the Mamba blocks: the CUDA kernels when ``mamba_ssm`` and ``causal_conv1d`` import,
    else HF's PyTorch reference ops (every CPU run)."""
    from importlib.util import find_spec

    if torch.cuda.is_available() and find_spec("mamba_ssm") and find_spec("causal_conv1d"):
        return "mamba_ssm + causal_conv1d CUDA kernels"
    return "PyTorch reference ops (HF transformers)"


class NemotronHSpeechLMTarget(AudioLLM):
    """NeMo's perception in front of a frozen Nemotron-H LLM (Mamba, attention, MLP and MoE blocks).

    ``tokenizer`` is NeMo's ``AutoTokenizer`` (the text side of the data pipeline reads it as it reads
    SALM's).
    """

    def __init__(self, llm: nn.Module, perception: nn.Module, tokenizer, salm_config: dict, source: Path):
        super().__init__()
        self.llm = llm
        self._perception = perception
        self._tokenizer = tokenizer
        self.salm_config = salm_config
        self.source = source
        tag = salm_config["audio_locator_tag"]
        self._audio_locator_tag_id = int(tokenizer.token_to_id(tag))
        self.freeze()

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "NemotronHSpeechLMTarget":
        """Build and load the target of checkpoint directory ``path`` in ``dtype``; every mismatch is one line.

        The modules are built without weights (accelerate's ``init_empty_weights``: parameters on the
        meta device, buffers real) and the checkpoint's tensors, cast to ``dtype`` as they are read,
        become the parameters: no FP32 copy and no random initialisation of a model whose every
        weight is about to be replaced (at 30 B parameters, 120 GB and minutes per rank)."""
        from accelerate import init_empty_weights
        from nemo.collections.speechlm2.modules import AudioPerceptionModule
        from omegaconf import DictConfig
        from nemo.collections.common.tokenizers import AutoTokenizer
        from transformers import AutoConfig, NemotronHForCausalLM

        path = Path(path)
        config = read_json_object(path / CONFIG_FILE, "point --target at a SpeechLM checkpoint directory")
        for key in ("perception", "audio_locator_tag"):
            if key not in config:
                raise ConfigError(f"{path / CONFIG_FILE} has no '{key}': it is not a SpeechLM checkpoint")
        backbone = AutoConfig.from_pretrained(path / LLM_BACKBONE_DIR)
        if backbone.model_type != NEMOTRON_H:
            raise ConfigError(f"{path} has a {backbone.model_type!r} backbone, not Nemotron-H: load it as a SALM")
        weights = _read_in_dtype(path / WEIGHTS_FILE, dtype)
        with init_empty_weights():
            llm = NemotronHForCausalLM(backbone)
            perception = AudioPerceptionModule(DictConfig(config["perception"]))
        # NeMo's tokenizer, built as SALM builds its own: the checkpoint's, with the audio tag as a special token
        tokenizer = AutoTokenizer(str(path), use_fast=True)
        tokenizer.add_special_tokens({"additional_special_tokens": [config["audio_locator_tag"]]})
        target = cls(llm, perception, tokenizer, config, path)
        target.load_speechlm_weights(weights, path / WEIGHTS_FILE, assign=True)
        rebuild_positional_tables(target, f"Nemotron-H SpeechLM checkpoint '{path}'",
                                  "report it with the checkpoint's config.json")
        log.info(
            "target: Nemotron-H SpeechLM %s (blocks %s); Mamba blocks run on %s",
            path,
            getattr(backbone, "hybrid_override_pattern", "?"),
            mamba_implementation(),
        )
        return target

    def load_speechlm_weights(self, weights: dict[str, torch.Tensor], source: str | Path, assign: bool = False) -> None:
        """Load a SpeechLM state dict strictly: ``perception.*`` and ``llm.*`` (either name set, MTP heads left out);
        ``assign``: the tensors become the parameters (modules built on the meta device)."""
        perception = {k[len("perception.") :]: v for k, v in weights.items() if k.startswith("perception.")}
        load_state_exactly(self._perception, perception, source, "perception.*", assign=assign)
        load_state_exactly(self.llm, hf_llm_state(weights), source, "llm.*", assign=assign)

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
    def audio_locator_tag(self) -> str:
        return self.salm_config["audio_locator_tag"]

    @property
    def sampling_rate(self) -> int:
        return int(self.salm_config["perception"].get("preprocessor", {}).get("sample_rate", SAMPLE_RATE))

    @property
    def audio_locator_tag_id(self) -> int:
        return self._audio_locator_tag_id

    @property
    def pad_id(self) -> int:
        """The pad id NeMo's SpeechLMs use (``get_pad_id``: the tokenizer's pad, else its unk)."""
        from nemo.collections.speechlm2.data.utils import get_pad_id

        return int(get_pad_id(self._tokenizer))
