"""What every frozen target shares: a Hugging Face causal LM whose decoder blocks are tapped."""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from dflash_train.target.base import TapOutput
from dflash_train.target.expert_parallel import ForwardLockstep, expert_parallel_mesh, shard_experts
from dflash_train.target.taps import record_taps, tap_decoder, tap_documents_apart

log = logging.getLogger(__name__)

RECURRENT = "linear_attention"
"""HF's ``block_type`` of a decoder block with a recurrent state (Nemotron-H's Mamba-2 blocks among them)."""


class FrozenLLM(nn.Module):
    """Base of the targets: frozen (no gradients, eval mode always), read through its causal LM.

    A subclass registers its model as a submodule, calls :meth:`freeze`, and says where the
    causal LM is (:attr:`causal_lm`) and how text becomes LLM inputs (``splice_batch``);
    depth, width, LM head and the tapped forward are the LLM's.
    """

    _lockstep: ForwardLockstep | None = None  # set when the experts are sharded (shard_experts)

    def freeze(self) -> None:
        """No parameter requires grad; eval mode."""
        for param in self.parameters():
            param.requires_grad_(False)
        self.train(False)

    def train(self, mode: bool = True) -> "FrozenLLM":
        """Stay in eval mode whatever the caller asks (Lightning calls ``train()`` on every fit)."""
        return super().train(False)

    @property
    def causal_lm(self) -> nn.Module:
        raise NotImplementedError

    def shard_experts(self, ep_size: int, device: torch.device | None = None) -> None:
        """Shard the routed experts of the MoE blocks over groups of ``ep_size`` ranks onto ``device`` (default:
        where the target is; the process group is up; :mod:`~dflash_train.target.expert_parallel`); every later
        forward is a collective of the group. Called before the target moves to the device, so the device never
        holds more than one block's experts beside this rank's share of the others."""
        device = device if device is not None else self.embed_tokens.weight.device
        mesh = expert_parallel_mesh(ep_size, device.type)
        blocks = shard_experts(self.causal_lm, mesh)
        self._lockstep = ForwardLockstep(self.decoder, mesh.get_group(), self.hidden_size)
        log.info(
            "target experts: %d MoE blocks sharded over %d ranks (expert group of rank %d: %s; %d of %d experts here)",
            blocks, ep_size, torch.distributed.get_rank(), mesh.mesh.tolist(),
            int(self.llm_config.n_routed_experts) // ep_size, int(self.llm_config.n_routed_experts),
        )

    @property
    def experts_sharded(self) -> bool:
        """Whether :meth:`shard_experts` ran: forwards are collectives of the expert group."""
        return self._lockstep is not None

    @contextmanager
    def uneven_forwards(self) -> Iterator[None]:
        """A phase in which ranks may run different numbers of forwards (decoding their own records): with sharded
        experts the ranks of a group are kept in step (:class:`~dflash_train.target.expert_parallel.ForwardLockstep`);
        otherwise nothing to do."""
        if self._lockstep is None:
            yield
            return
        with self._lockstep.uneven():
            yield

    @property
    def llm_config(self):
        return self.causal_lm.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.llm_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.num_embeddings)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.causal_lm.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.causal_lm.lm_head

    @property
    def decoder(self) -> nn.Module:
        return self.causal_lm.get_decoder()

    @property
    def recurrent_block_ids(self) -> list[int]:
        """Decoder blocks that carry a recurrent state along the sequence (Mamba-2, linear attention).

        Their state cannot be fenced by an attention mask (packed documents) nor cropped like a KV
        cache (rejected proposals); :meth:`forward_taps` and the reference decoder's session treat them.
        """
        return [i for i, layer in enumerate(self.decoder_layers) if getattr(layer, "block_type", None) == RECURRENT]

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.decoder.layers

    def new_cache(self) -> Any:
        """An empty KV cache for :meth:`forward_cached`."""
        from transformers import DynamicCache

        return DynamicCache(config=self.llm_config)

    @torch.no_grad()
    def forward_cached(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any, layer_ids: Sequence[int] = ()
    ) -> TapOutput:
        """Extend ``cache`` by ``inputs_embeds`` at ``position_ids``: the tapped features of the new
        positions (``None`` without ``layer_ids``) and their final hidden state."""
        taps = record_taps(self.decoder_layers, layer_ids) if layer_ids else nullcontext()
        with taps as recorder:
            out = self.decoder(
                inputs_embeds=inputs_embeds,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            features = recorder.features() if recorder is not None else None
        return TapOutput(features, out.last_hidden_state)

    def forward_taps(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        return_last_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> TapOutput:
        """The outputs of decoder blocks ``layer_ids`` (see :func:`~dflash_train.target.taps.tap_decoder`).

        Packed rows (``document_ids``) of a target with recurrent blocks run each document in a row of
        its own (:func:`~dflash_train.target.taps.tap_documents_apart`): a document mask fences
        attention but not a Mamba block's state, which would run on from one document into the next.
        """
        if document_ids is not None and self.recurrent_block_ids:
            return tap_documents_apart(
                self.decoder, self.decoder_layers, inputs_embeds, document_ids, layer_ids, return_last_hidden
            )
        return tap_decoder(
            self.decoder,
            self.decoder_layers,
            inputs_embeds,
            attention_mask,
            layer_ids,
            return_last_hidden=return_last_hidden,
            position_ids=position_ids,
            document_ids=document_ids,
        )
