"""The EAGLE-3 draft and its trainer core: nemo_automodel's classes fed from the training module's inputs.

The draft is :class:`Eagle3Draft`, nemo_automodel's ``LlamaEagle3DraftModel`` shaped like the target's
LLM (one decoder layer, the target's width and heads), with the target's embedding table copied in and
frozen and a draft vocabulary of ``dflash.draft_vocab_size`` target tokens (``d2t`` / ``t2d``), those the
training data supervises most often (:func:`choose_draft_vocabulary`, on a fresh draft). :class:`Eagle3Core` is nemo_automodel's
``Eagle3TrainerModule`` behind the training module's core contract: it aligns the module's unshifted
rows to nemo_automodel's convention (slot *t* reads taps *t* and token *t + 1*, and learns the target's
distribution at *t + 1*) and returns the sums the module logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule
from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
from torch import nn
from transformers import LlamaConfig

from dflash_train.casting import cast_floating
from dflash_train.draft.anchors import anchor_coverage, documents_of
from dflash_train.variants.eagle3 import EAGLE3_TAPS

LLM_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "pad_token_id",
)
"""Keys of the target LLM's config the draft layer copies (those it has; the rest keep Llama's defaults)."""


class Eagle3Draft(LlamaEagle3DraftModel):
    """nemo_automodel's EAGLE-3 draft, with its decoder layers at ``layers`` as the training module shards them."""

    fsdp_forward_methods = ("project_hidden_states", "compute_logits")
    """Methods the trainer core calls on the root outside its forward: under FSDP2 each gathers the root's
    parameters (``fc``, ``norm``, ``lm_head``) as a forward does."""

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers


def draft_config(llm_config, draft_vocab_size: Optional[int], layer_ids, ttt_steps: int) -> LlamaConfig:
    """The draft's config from the target LLM's ``llm_config``: its sizes, the target's full vocabulary for
    the embedding table, ``draft_vocab_size`` outputs (all of it when null or not smaller), eager attention,
    and the tapped target blocks ``layer_ids`` in vLLM's numbering (``eagle_aux_hidden_state_layer_ids``: the
    output of block *t* is vLLM's aux id *t + 1*), so the draft carries its contract with the target."""
    text = llm_config.get_text_config()
    vocab = text.vocab_size
    draft_vocab = vocab if draft_vocab_size is None else min(draft_vocab_size, vocab)
    shared = {key: getattr(text, key) for key in LLM_KEYS if getattr(text, key, None) is not None}
    return LlamaConfig(
        **shared, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=text.hidden_size,
        num_hidden_layers=1, num_aux_hidden_states=EAGLE3_TAPS, tie_word_embeddings=False,
        attn_implementation="eager", architectures=["LlamaEagle3DraftModel"],
        eagle_aux_hidden_state_layer_ids=[int(t) + 1 for t in layer_ids], ttt_steps=ttt_steps,
    )


def draft_taps(draft: LlamaEagle3DraftModel) -> list[int]:
    """The target blocks whose outputs ``draft`` reads (from its config's vLLM aux ids)."""
    return [t - 1 for t in draft.config.eagle_aux_hidden_state_layer_ids]


def build_eagle3_draft(target, draft_vocab_size: Optional[int], layer_ids, ttt_steps: int,
                       dtype: torch.dtype) -> Eagle3Draft:
    """A fresh draft for ``target`` tapping blocks ``layer_ids``, in ``dtype``: the target's embeddings copied and
    frozen (EAGLE-3's default) and the first ``draft_vocab_size`` token ids as its output vocabulary until
    :func:`choose_draft_vocabulary` fits it to the training data."""
    draft = Eagle3Draft(draft_config(target.llm_config, draft_vocab_size, layer_ids, ttt_steps))
    draft.set_vocab_mapping(torch.arange(draft.draft_vocab_size))
    draft.copy_embeddings_from_target(target.embed_tokens)
    draft.freeze_embeddings()
    cast_floating(draft, dtype)  # not draft.to(dtype): dflash-plan builds it under fake tensors
    return draft


def choose_draft_vocabulary(draft: LlamaEagle3DraftModel, examples: Iterable[dict]) -> None:
    """Make the draft's output vocabulary the ``draft_vocab_size`` target tokens most often supervised in
    ``examples`` (``{"input_ids", "loss_mask"}``: the same on every rank), by nemo_automodel's selection (most
    frequent first, then unseen ids to fill it); a no-op when the vocabulary is not reduced."""
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_token_mapping

    vocab = draft.model.embed_tokens.num_embeddings
    if draft.draft_vocab_size >= vocab:
        return
    ids, _ = build_eagle3_token_mapping(examples, target_vocab_size=vocab, draft_vocab_size=draft.draft_vocab_size)
    draft.set_vocab_mapping(ids.to(draft.d2t.device))


def selected_tokens(draft: LlamaEagle3DraftModel) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selected_token_ids [draft V], selected_token_mask [V])``: the target ids of the draft's outputs, read
    back from its ``d2t`` (``target = draft + d2t[draft]``), or every id when the vocabulary is not reduced."""
    vocab = draft.model.embed_tokens.num_embeddings
    ids = torch.arange(draft.draft_vocab_size)
    if draft.draft_vocab_size < vocab:
        ids = ids + draft.d2t.cpu()
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    return ids, mask


def packed_seq_lens(seq_lens: torch.Tensor, width: int) -> Optional[torch.Tensor]:
    """nemo_automodel's packing argument from the module's ``seq_lens`` ``[B, D]`` (document lengths, zero-padded)
    in rows of ``width``: each row's trailing padding folded into its last document, so a row sums to
    ``width``; ``None`` when rows hold one document each (the padding mask alone is then exact: rows are
    right-padded and attention is causal)."""
    if seq_lens.shape[1] < 2:
        return None
    documents = (seq_lens > 0).sum(dim=1, keepdim=True)
    last = (documents - 1).clamp_min(0)
    padding = width - seq_lens.sum(dim=1, keepdim=True)
    return seq_lens.scatter_add(1, last, padding)


def shift_left(tensor: torch.Tensor, steps: int) -> torch.Tensor:
    """``tensor[:, t + steps]`` at ``t``, zero (false) past the row's end."""
    return torch.cat([tensor[:, steps:], torch.zeros_like(tensor[:, :steps])], dim=1)


@dataclass
class Eagle3Metrics:
    """One step's loss and additive statistics under the names the training module sums (those of
    nemo_automodel's DFlash metrics), with nemo_automodel's per-depth chain counts."""

    loss: torch.Tensor
    loss_weight: torch.Tensor  # supervised chains: the step's loss is a mean over them
    accuracy: torch.Tensor
    valid_tokens: torch.Tensor  # supervised predictions over all TTT steps
    correct_tokens: torch.Tensor
    accept_len: torch.Tensor
    accept_len_sum: torch.Tensor  # Σ over chains of 1 + the greedy prefix the draft gets right
    valid_blocks: torch.Tensor  # chains: slots supervised at the first step
    step_prefix_hits: torch.Tensor  # [ttt_steps] chains right through depth k + 1
    step_valid: torch.Tensor  # [ttt_steps] chains supervised through depth k + 1


class Eagle3Core(Eagle3TrainerModule):
    """nemo_automodel's TTT trainer behind the training module's core call.

    ``forward(input_ids, features, loss_mask, position_ids, seq_lens, doc_remaining, teacher_hidden)`` takes the
    module's unshifted (possibly packed: attention stays inside each document) rows: token *t*, the taps' output at *t*, whether token *t* is supervised, and the target's
    final hidden state at *t*. Slot *t* then reads token *t + 1* and taps *t*, and learns the target's
    distribution at *t + 1* (over the draft vocabulary, where its top-1 is in it) when token *t + 2* is
    supervised and in the same document; later TTT steps walk on along the row. The target's LM head is held
    outside the module tree (frozen, never saved with the draft).

    ``audio_frames``: ``(frame id, served id)``: the module's rows carry ``frame id`` (the mask token) at audio
    frames, where vLLM's EAGLE-3 proposer, which takes no multimodal embeddings, feeds the draft the audio
    placeholder token ``served id``; the draft reads that token's embedding there, as served.
    """

    def __init__(self, draft: LlamaEagle3DraftModel, target_lm_head: nn.Module, ttt_steps: int,
                 audio_frames: Optional[tuple[int, int]] = None):
        ids, mask = selected_tokens(draft)
        super().__init__(draft, selected_token_ids=ids, selected_token_mask=mask, ttt_steps=ttt_steps)
        object.__setattr__(self, "target_lm_head", target_lm_head)
        self.audio_frames = audio_frames
        self.anchor_coverage_sums: Optional[torch.Tensor] = None
        self.supervised_bound: Optional[int] = None  # set by the module; every slot is trained, so unused
        self.placeholder = False

    def forward(self, input_ids, features, loss_mask, position_ids=None, seq_lens=None, doc_remaining=None,
                teacher_hidden=None) -> Eagle3Metrics:
        if teacher_hidden is None or doc_remaining is None:
            raise ValueError("the eagle3 core needs doc_remaining and teacher_hidden (the target's final hidden states)")
        supervised = loss_mask.bool()
        with torch.no_grad():
            target_logits = shift_left(self.target_lm_head(teacher_hidden), 1)
        dtype = self.draft_model.model.fc.weight.dtype
        served_ids = input_ids
        if self.audio_frames is not None:
            frame, served = self.audio_frames
            served_ids = torch.where(input_ids == frame, served, input_ids)
        metrics = super().forward(
            shift_left(served_ids, 1), (doc_remaining >= 0).long(), shift_left(supervised, 2), features.to(dtype),
            target_logits, position_ids=position_ids, doc_remaining=doc_remaining - 1,
            seq_lens=None if seq_lens is None else packed_seq_lens(seq_lens, input_ids.shape[1]),
        )
        documents = documents_of(doc_remaining)
        slots = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        chains = shift_left(supervised, 2) & (doc_remaining >= 2)
        self.anchor_coverage_sums = anchor_coverage(slots + 1, chains, self.ttt_steps, supervised, documents)
        chains_total = metrics.step_valid[0].to(metrics.loss.dtype)
        accept_sum = chains_total + metrics.step_prefix_hits.sum()
        return Eagle3Metrics(
            loss=metrics.loss, loss_weight=chains_total, accuracy=metrics.accuracy, valid_tokens=metrics.valid_tokens,
            correct_tokens=metrics.accuracy * metrics.valid_tokens, accept_len=accept_sum / chains_total.clamp_min(1),
            accept_len_sum=accept_sum, valid_blocks=chains_total, step_prefix_hits=metrics.step_prefix_hits,
            step_valid=metrics.step_valid,
        )
