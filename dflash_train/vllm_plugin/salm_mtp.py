"""vLLM's Nemotron-H MTP draft for a SpeechLM checkpoint, with the audio fused in (imported by vLLM only).

vLLM resolves :data:`dflash_train.vllm_plugin.mtp.MTP_ARCHITECTURE` to :class:`DFlashSpeechLMMTP`
lazily, for a draft config made by :func:`dflash_train.vllm_plugin.mtp.speechlm_mtp_hf_config_override`.
It is vLLM's ``NemotronHMTP`` (vLLM 0.32: ``model_executor/models/nemotron_h_mtp.py``) with two
changes:

- its input embeddings take the target's audio embeddings at the audio placeholder positions,
  as the target's do: vLLM hands a draft the target's multimodal embeddings only when the draft
  class says ``supports_multimodal_embeddings`` and takes them in ``embed_input_ids``; without
  that it drafts from the placeholder token's text embedding;
- it loads from the SpeechLM checkpoint (:func:`dflash_train.vllm_plugin.mtp.mtp_checkpoint_weights`).

The embedding table and LM head are the target's: vLLM's proposer shares both with every MTP draft.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.nemotron_h_mtp import NemotronHMTP
from vllm.model_executor.models.utils import _merge_multimodal_embeddings

from dflash_train.vllm_plugin.mtp import mtp_checkpoint_weights


class DFlashSpeechLMMTP(NemotronHMTP):
    """One Nemotron-H MTP step of a SpeechLM, repeated for every draft position, fed the target's audio."""

    supports_multimodal_embeddings = True

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings=None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the audio embeddings written over the placeholder positions."""
        embeddings = self.model.get_input_embeddings(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeddings
        if is_multimodal is None:
            raise ValueError("audio embeddings were passed to the MTP draft without their is_multimodal positions")
        return _merge_multimodal_embeddings(
            inputs_embeds=embeddings, multimodal_embeddings=multimodal_embeddings, is_multimodal=is_multimodal
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the MTP step (and the embedding vLLM then replaces by the target's) from a SpeechLM checkpoint."""
        modules_per_step = len(self.config.mtp_hybrid_override_pattern)
        return super().load_weights(mtp_checkpoint_weights(weights, int(self.config.vocab_size), modules_per_step))
