"""Training an MTP step on a frozen target: every draft position vLLM's MTP route serves, in one batched pass.

The contract (docs/training.md, "MTP heads"): for an anchor *p*, the last position whose
target hidden state the drafter has (the bonus token sits at *p + 1*), draft step *k*
(1 ≤ k ≤ D) reads

    x_k = eh_proj(cat[enorm(e_{p+k}), hnorm(h_k)])     h_1 = target final (post-norm) hidden state at p
                                                       h_k = the step's own output of step k - 1
    label_k = token_{p+k+1}                            (weighted w_k, supervised positions only)

where ``e_j`` is token *j*'s embedding (the audio frame's embedding at audio positions). In
every attention sublayer, step 1 of anchor *p* is the cached entry of position *p*: it attends
to the step-1 entries of positions ≤ p of its own document, as every verified position's entry
is made from the target's hidden state. Step *k ≥ 2* sits at position *p + k − 1* and attends
to those same step-1 entries (positions ≤ p) plus its own chain's steps 2..k, exactly the KV
cache vLLM's proposer holds while it drafts token *k*. Teacher forcing feeds the true token
*p + k* (a drafted token is only ever used after it was accepted, i.e. equal to it).

Step 1 runs over every position at once (causal within documents); steps 2..D run for up to
``num_anchors`` sampled anchors per row, each chain attending to the shared step-1 keys.
An anchor needs its bonus token supervised and D further tokens in its document, the
counterpart of DFlash's full-block rule (block size D + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from dflash_train.draft.anchors import anchor_coverage, documents_of, draw_anchors
from dflash_train.draft.mtp import MTPStep
from dflash_train.loss.head import CROSS_ENTROPY, HeadLoss, LossTerms, TeacherRows, chunked_head_loss, position_bound
from dflash_train.target.taps import document_attention_mask
from dflash_train.variants.mtp import valid_anchor_mask


@dataclass
class MTPStepMetrics:
    """One step's loss and additive statistics, with the fields the training module sums
    (the same names as nemo_automodel's DFlash metrics, so both log alike)."""

    loss: torch.Tensor
    loss_weight: torch.Tensor
    accuracy: torch.Tensor
    valid_tokens: torch.Tensor
    correct_tokens: torch.Tensor
    accept_len: torch.Tensor
    accept_len_sum: torch.Tensor
    valid_blocks: torch.Tensor
    step_correct: torch.Tensor  # [D] correct predictions per draft step
    step_tokens: torch.Tensor  # [D] supervised predictions per draft step


def gather_at(tensor: torch.Tensor, anchors: torch.Tensor, offset: int) -> torch.Tensor:
    """``tensor[b, anchors[b, n] + offset]`` for ``[B, S]`` or ``[B, S, H]`` tensors (clamped to the row)."""
    index = (anchors + offset).clamp(max=tensor.shape[1] - 1)
    if tensor.dim() == 2:
        return tensor.gather(1, index)
    return tensor.gather(1, index[..., None].expand(-1, -1, tensor.shape[-1]))


class MTPTrainerCore(nn.Module):
    """The MTP step and its training objective; the frozen target's LM head is held, never trained.

    ``forward`` takes the module's batch layout (labels substituted, the target's final hidden
    states as ``features``, the audio-fused token embeddings as ``embeds``) and returns
    :class:`MTPStepMetrics` whose ``loss`` is Σ w·loss / Σ w over every supervised draft step, the loss
    being ``terms`` (:class:`~dflash_train.loss.head.LossTerms`: cross-entropy by default; distillation
    learns the target's distribution at *p + k*, the predecessor of step *k*'s label, read from
    ``features``, which are the target's final hidden states).
    """

    def __init__(
        self,
        step: MTPStep,
        target_lm_head: nn.Module,
        step_weights: Sequence[float],
        num_anchors: int,
        loss_chunk_size: int = 0,
        per_document: bool = False,
        terms: LossTerms = CROSS_ENTROPY,
    ):
        super().__init__()
        self.loss_chunk_size = loss_chunk_size  # 0: full logits; else the chunked head (loss/head.py)
        if terms.distills and not loss_chunk_size:
            raise ValueError("distillation (kl / tv loss terms) needs the chunked head: loss_chunk_size > 0")
        self.terms = terms
        self.supervised_bound: int | None = None  # the batch's supervised tokens (host), set around a forward
        self.draft_model = step
        object.__setattr__(self, "lm_head", target_lm_head)  # not a submodule: not trained, not checkpointed
        self.step_weights = [float(w) for w in step_weights]
        self.num_anchors = num_anchors
        self.per_document = per_document  # dflash.anchor_budget: per_document (draft/anchors.py)
        self.weighted_ce: torch.Tensor | None = None  # Σ w·CE of the last forward (train/ce)
        self.anchor_coverage_sums: torch.Tensor | None = None  # of the last draw (draft/anchors.py)

    @property
    def num_steps(self) -> int:
        return len(self.step_weights)

    def sample_anchors(self, valid: torch.Tensor, documents: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``num_anchors`` valid positions per row (or per document of ``documents``, with a per-document
        budget), drawn uniformly (the caller seeds the draw), sorted; ``(anchors [B, A], keep [B, A])`` with
        unused slots at position 0 and ``keep`` false."""
        return draw_anchors(valid, self.num_anchors, documents if self.per_document and documents is not None else None)

    def draft_states(
        self, features: torch.Tensor, loss_mask: torch.Tensor, doc_remaining: torch.Tensor, embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(states [B, A, D, H], anchors [B, A], keep [B, A])``: the step's output at every draft step of
        every sampled anchor (module docstring), before the LM head."""
        step, depth = self.draft_model, self.num_steps
        batch = features.shape[0]
        gqa = dict(enable_gqa=step.layers[0].heads != step.layers[0].kv_heads)

        # step 1 at every position: entry i fuses token i+1's embedding with the target's hidden state i
        next_embeds = torch.cat([embeds[:, 1:], torch.zeros_like(embeds[:, :1])], dim=1)
        context: list[tuple[torch.Tensor, torch.Tensor]] = []
        documents = documents_of(doc_remaining)
        first_mask = document_attention_mask(documents)  # the target's own document masking

        def attend_first(i):
            def attention(q, k, v):
                context.append((k, v))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=first_mask, **gqa)

            return attention

        first = step(next_embeds, features.to(next_embeds.dtype), attention=attend_first)

        anchors, keep = self.sample_anchors(valid_anchor_mask(loss_mask, doc_remaining, depth), documents)
        # a chain at p predicts the tokens p + 2 .. p + D + 1 (p + 1 is the target's bonus token)
        self.anchor_coverage_sums = anchor_coverage(anchors + 1, keep, depth, loss_mask.bool(), documents)
        drawn = anchors.shape[1]
        outputs = [gather_at(first, anchors, 0)]
        sees_context = gather_at(first_mask[:, 0], anchors, 0)  # [B, A, S]: anchor p's row, entries j <= p of its document
        own_chain = torch.eye(drawn, dtype=torch.bool, device=features.device).expand(batch, -1, -1)
        chain: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in step.layers]
        for k in range(2, depth + 1):
            mask = torch.cat([sees_context] + [own_chain] * (k - 1), dim=-1)[:, None]

            def attend_chain(i, mask=mask):
                def attention(q, key, value):
                    chain[i].append((key, value))
                    keys = torch.cat([context[i][0]] + [kv[0] for kv in chain[i]], dim=2)
                    values = torch.cat([context[i][1]] + [kv[1] for kv in chain[i]], dim=2)
                    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **gqa)

                return attention

            outputs.append(step(gather_at(embeds, anchors, k), outputs[-1], attention=attend_chain))
        return torch.stack(outputs, dim=2), anchors, keep

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor,
                  teacher: TeacherRows | None) -> HeadLoss:
        """The chunked LM head and the run's loss over the chains' supervised positions (the step's one entry
        point to the head, as the block drafts' ``head_loss`` is: dflash-plan charges it to the loss phase)."""
        return chunked_head_loss(
            hidden, self.lm_head, labels, weights, self.loss_chunk_size, positions=supervised,
            max_positions=position_bound(supervised, self.supervised_bound), terms=self.terms, teacher=teacher,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
    ) -> MTPStepMetrics:
        """The loss and statistics of one batch (``position_ids`` / ``seq_lens`` are unused: the step has no
        rotary embedding, and documents come from ``doc_remaining``)."""
        if doc_remaining is None or embeds is None:
            raise ValueError("the MTP objective needs doc_remaining and the token embeddings (embeds)")
        depth = self.num_steps
        hidden, anchors, keep = self.draft_states(features, loss_mask, doc_remaining, embeds)
        labels = torch.stack([gather_at(input_ids, anchors, k + 1) for k in range(1, depth + 1)], dim=2)
        supervised = torch.stack([gather_at(loss_mask.bool(), anchors, k + 1) for k in range(1, depth + 1)], dim=2) & keep[..., None]
        weights = supervised.float() * torch.tensor(self.step_weights, device=hidden.device)
        weight = weights.sum()
        if self.loss_chunk_size:
            teacher = None
            if self.terms.distills:  # step k's label is token p + k + 1: the target's prediction at p + k
                rows = torch.arange(features.shape[0], device=features.device)[:, None, None] * features.shape[1]
                steps = torch.arange(1, depth + 1, device=features.device)
                index = rows + (anchors[..., None] + steps).clamp(max=features.shape[1] - 1)
                teacher = TeacherRows(features.reshape(-1, features.shape[-1]), index)
            head = self.head_loss(hidden, labels, weights, supervised, teacher)
            weighted_loss, predictions = head.weighted_loss, head.predictions
            self.weighted_ce = head.weighted_nll.detach()
        else:
            logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
            ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(weights)
            weighted_loss, predictions = (ce * weights).sum(), logits.argmax(dim=-1)
            self.weighted_ce = weighted_loss.detach()
        loss = weighted_loss / weight.clamp_min(1e-12)

        correct = (predictions == labels) & supervised
        prefix = (correct | ~supervised).long().cumprod(dim=2) * supervised.long()
        chains = supervised.any(dim=2)
        accept_sum = ((prefix.sum(dim=2) + 1.0) * chains).sum()
        tokens, hits = supervised.sum(), correct.sum()
        return MTPStepMetrics(
            loss=loss,
            loss_weight=weight.detach(),
            accuracy=(hits / tokens.clamp_min(1)).detach(),
            valid_tokens=tokens.detach(),
            correct_tokens=hits.detach(),
            accept_len=(accept_sum / chains.sum().clamp_min(1)).detach(),
            accept_len_sum=accept_sum.detach(),
            valid_blocks=chains.sum().detach(),
            step_correct=correct.sum(dim=(0, 1)).detach(),
            step_tokens=supervised.sum(dim=(0, 1)).detach(),
        )
