"""The narrow interface the draft trainer, the reference decoder and the data pipeline need from a
frozen target. :class:`~dflash_train.target.salm.SALMTarget` implements it for NeMo's SALM,
:class:`~dflash_train.target.causal_lm.CausalLMTarget` for a text-only causal LM; another speech
LLM implements the same members and nothing else needs to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Optional, Protocol, Sequence

import torch
from torch import nn

from dflash_train.data.batch import SpeechBatch
from dflash_train.target.splice import SplicedBatch


@dataclass
class TapOutput:
    """Tapped features ``[B, S, n_taps * H]`` (``None`` when no block was tapped) and, when asked
    for, the final post-norm hidden state ``[B, S, H]``."""

    features: Optional[torch.Tensor]
    last_hidden: Optional[torch.Tensor] = None


class FrozenTarget(Protocol):
    """What every caller uses from a target: nobody reaches past these members.

    Sizes and text: ``num_layers`` (decoder blocks, the tap ids' range), ``hidden_size``,
    ``vocab_size``, ``llm_config`` (the LLM's HF text config, which a draft is shaped after),
    ``tokenizer``, ``pad_id``, ``audio_locator_tag_id``. Audio: ``sampling_rate``,
    ``perception`` (NeMo's audio encoder + projection, ``None`` for a text-only target) and
    ``encoder_chunk_size_seconds``, which fix how many frames an audio becomes. Compute:
    the frozen embedding table and LM head, audio splicing, the tapped training forward
    (whose ``last_hidden`` is the final hidden state a next-token head such as MTP reads),
    and the cached incremental forward the reference decoder runs.
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    pad_id: int
    sampling_rate: int

    @property
    def llm_config(self) -> Any: ...

    @property
    def recurrent_block_ids(self) -> list[int]: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def audio_locator_tag_id(self) -> int: ...

    @property
    def perception(self) -> Optional[nn.Module]: ...

    @property
    def encoder_chunk_size_seconds(self) -> Optional[float]: ...

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def lm_head(self) -> nn.Module: ...

    def splice_batch(self, batch: SpeechBatch, mask_token_id: int) -> SplicedBatch: ...

    def perception_as_served(self, dtype: torch.dtype) -> ContextManager[Any]:
        """A block in which audio is encoded with the perception in serving's ``dtype`` (the trained-with
        perception left untouched); a target without audio has nothing to change."""

    def forward_taps(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        return_last_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> TapOutput: ...

    def new_cache(self) -> Any: ...

    def forward_cached(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any, layer_ids: Sequence[int] = ()
    ) -> TapOutput: ...
