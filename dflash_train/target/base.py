"""The narrow interface the draft trainer needs from any frozen speech-LLM target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
from torch import nn

from dflash_train.data.batch import SpeechBatch
from dflash_train.target.splice import SplicedBatch


@dataclass
class TapOutput:
    """Tapped features ``[B, S, n_taps * H]`` and, when asked for, the final post-norm hidden state."""

    features: torch.Tensor
    last_hidden: Optional[torch.Tensor] = None


class FrozenTarget(Protocol):
    """What the training module uses from a target; another speech LLM implements the same members."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def lm_head(self) -> nn.Module: ...

    def splice_batch(self, batch: SpeechBatch, mask_token_id: int) -> SplicedBatch: ...

    def forward_taps(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        return_last_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> TapOutput: ...
