"""NeMo's SALM vLLM model with the EAGLE-3 interface DFlash needs (imported by vLLM only).

vLLM resolves :data:`dflash_train.vllm_plugin.SALM_ARCHITECTURE` to
:class:`DFlashSALMForConditionalGeneration` lazily, so this module (which imports vLLM and
NeMo) is loaded only when such a target is served. The class is NeMo 3.0.0's
``NeMoSpeechLMForConditionalGeneration`` plus three adaptations, each for the vLLM versions
stated on it:

- ``SupportsEagle3`` by delegating to the inner language model (any vLLM with DFlash), with a
  clear error when the backbone cannot return aux hidden states;
- the audio placeholder id as ``config.image_token_index``, where vLLM's speculative loader
  reads a multimodal target's placeholder id (vLLM 0.32: ``LLMBaseProposer.load_model``);
- NeMo's multimodal processor on vLLM >= 0.32's token-id API (see
  :class:`TokenIdAudioProcessor`); older vLLM keeps NeMo's processor unchanged;
- a checkpoint's MTP weights (``llm.mtp.*``) are left to the MTP draft
  (:mod:`dflash_train.vllm_plugin.salm_mtp`): NeMo 3.0.0 would hand them to the LLM loader;
- ``SALMAutomodel``'s native names (``mixer._fp32_params.*``, ``_extra_state``) are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import vllm
from nemo.collections.speechlm2.vllm.salm.audio import (
    NeMoSpeechLMDummyInputsBuilder,
    NeMoSpeechLMMultiModalProcessor,
    NeMoSpeechLMProcessingInfo,
)
from nemo.collections.speechlm2.vllm.salm.config import _AUDIO_PLACEHOLDER as AUDIO_PLACEHOLDER
from nemo.collections.speechlm2.vllm.salm.model import NeMoSpeechLMForConditionalGeneration
from packaging.version import Version
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate
from vllm.tokenizers.registry import cached_tokenizer_from_config

from dflash_train.constants import MTP_WEIGHT_PREFIX
from dflash_train.target.nemotron_h import without_native_holders
from dflash_train.vllm_plugin.backbone import require_aux_hidden_states

# vLLM 0.32 tokenizes prompts before multimodal processing (vLLM PRs #53093, #53275, #53610):
# ``_call_hf_processor`` receives only the multimodal data, and prompt updates are matched on
# token ids (``PromptUpdateDetails.select_text`` is gone). NeMo 3.0.0's processor predates this.
TOKEN_ID_PROCESSOR_API = Version("0.32")


def placeholder_token_id(tokenizer) -> int:
    """The id of the audio placeholder; a one-line error if the tokenizer lacks it."""
    vocab = tokenizer.get_vocab()
    if AUDIO_PLACEHOLDER not in vocab:
        raise ValueError(
            f"the SALM tokenizer has no {AUDIO_PLACEHOLDER!r} token; write the target with "
            "dflash-export-target from a checkpoint whose audio_locator_tag is that token"
        )
    return int(vocab[AUDIO_PLACEHOLDER])


class TokenIdAudioProcessor(NeMoSpeechLMMultiModalProcessor):
    """NeMo's SALM processor on vLLM >= 0.32: audio tensors in, token-id prompt updates out.

    vLLM has already tokenized the prompt (one placeholder token per audio); this processor
    only packs the audio and replaces each placeholder with as many placeholder tokens as the
    perception will emit frames (NeMo's own estimate, so prompt and embeddings agree).
    """

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        audios = [torch.as_tensor(audio, dtype=torch.float32).reshape(-1) for audio in hf_data.get("audio", [])]
        return BatchFeature(
            {
                "audio_signal": audios,
                "audio_signal_length": torch.tensor([audio.shape[-1] for audio in audios], dtype=torch.long),
            }
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptUpdate]:
        # The packed audio lengths, not ``mm_items``: when vLLM's multimodal processor cache already
        # holds an item (the same audio again, or the profiling run's dummy audio in a served
        # engine), ``mm_items`` lacks it and only the cached processor outputs are given.
        lengths = out_mm_kwargs.get_data().get("audio_signal_length")
        chunk_size_seconds = self.info._get_encoder_chunk_size_seconds()
        token_id = placeholder_token_id(self.info.get_tokenizer())

        def frames(item_idx: int) -> list[int]:
            return [token_id] * self.info._estimate_audio_tokens(int(lengths[item_idx]), chunk_size_seconds)

        return [PromptReplacement(modality="audio", target=[token_id], replacement=frames)]


def processor_for_vllm(vllm_version: str) -> type[NeMoSpeechLMMultiModalProcessor]:
    """The processor class for this vLLM: ours from the token-id API on, NeMo's before it."""
    if Version(Version(vllm_version).base_version) >= TOKEN_ID_PROCESSOR_API:
        return TokenIdAudioProcessor
    return NeMoSpeechLMMultiModalProcessor


@MULTIMODAL_REGISTRY.register_processor(
    processor_for_vllm(vllm.__version__),
    info=NeMoSpeechLMProcessingInfo,
    dummy_inputs=NeMoSpeechLMDummyInputsBuilder,
)
class DFlashSALMForConditionalGeneration(NeMoSpeechLMForConditionalGeneration, SupportsEagle3):
    """NeMo's SALM for vLLM, able to feed a DFlash / EAGLE-3 draft the target's hidden states."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        if tokenizer is not None:
            self.config.image_token_index = placeholder_token_id(tokenizer)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Make the LLM backbone also return the outputs of ``layers`` (vLLM's aux hidden states)."""
        require_aux_hidden_states(self.language_model).set_aux_hidden_state_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The backbone's default aux layers (used only when the draft config names none)."""
        return require_aux_hidden_states(self.language_model).get_eagle3_default_aux_hidden_state_layers()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """NeMo's loading of the SALM weights, without the MTP heads (the draft model loads those), and with
        ``SALMAutomodel``'s native names read: NeMo 3.0.0's mapper splits packed experts but does not know
        nemo_automodel's ``mixer._fp32_params`` holder nor Transformer Engine's ``_extra_state``."""
        return super().load_weights(
            (canonical, tensor)
            for name, tensor in weights
            if not name.startswith(MTP_WEIGHT_PREFIX) and (canonical := without_native_holders(name)) is not None
        )
