"""A text-only frozen target over any Hugging Face causal LM: draft training without NeMo.

The speech target (:class:`~dflash_train.target.salm.SALMTarget`) is an audio encoder in
front of exactly such an LLM; everything the draft trainer reads from it (embedding table,
LM head, tapped decoder blocks, the final hidden state) belongs to the LLM. Holding the LLM
alone gives the same training path on text batches, which is what the GPU check uses to
measure a target of realistic width from a stock PyTorch image.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from dflash_train.constants import SAMPLE_RATE
from dflash_train.data.batch import SpeechBatch
from dflash_train.target.llm import FrozenLLM
from dflash_train.target.splice import SplicedBatch


class CausalLMTarget(FrozenLLM):
    """A Hugging Face causal LM held frozen (eval mode always, no gradients), text batches only.

    It has no audio: no perception, and no token is an audio placeholder.
    """

    audio_locator_tag_id = -1
    sampling_rate = SAMPLE_RATE
    perception = None
    encoder_chunk_size_seconds = None

    def __init__(self, causal_lm: nn.Module, pad_id: int = 0, tokenizer=None):
        super().__init__()
        self.llm = causal_lm
        self.pad_id = int(pad_id)
        self.tokenizer = tokenizer
        self.freeze()

    @property
    def causal_lm(self) -> nn.Module:
        return self.llm

    @contextmanager
    def perception_as_served(self, dtype: torch.dtype) -> Iterator["CausalLMTarget"]:
        """No perception: text is embedded the same in training and serving."""
        yield self

    @torch.no_grad()
    def splice_batch(self, batch: SpeechBatch, mask_token_id: int) -> SplicedBatch:
        """Embed the text; a batch with audio is an error (this target has no audio encoder)."""
        if sum(batch.audios_per_row):
            raise ValueError(f"CausalLMTarget takes text batches only; got {sum(batch.audios_per_row)} audios")
        input_ids = batch.input_ids
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        attention_mask = positions[None, :] < batch.lengths.to(input_ids.device)[:, None]
        return SplicedBatch(
            inputs_embeds=self.embed_tokens(input_ids),
            input_ids=input_ids,
            loss_mask=batch.loss_mask & attention_mask,
            attention_mask=attention_mask,
            audio_mask=torch.zeros_like(attention_mask),
            lengths=batch.lengths,
            document_ids=batch.document_ids,
        )
