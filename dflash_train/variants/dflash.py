"""DFlash: a block-diffusion draft proposing a whole block per round from tapped target features."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_train.loss.head import CROSS_ENTROPY, HeadLoss, LossTerms, TeacherRows, chunked_head_loss, position_bound
from dflash_train.variants.base import DFlashConfig, DraftVariant, automodel_speculative_dflash


class ChunkedBlockLoss:
    """Mixin over one of nemo_automodel's block trainer cores: the same step with the LM head and the
    decayed block cross-entropy computed by :func:`chunked_head_loss`, so no ``[B, N·block, V]`` logits are
    held (``loss_chunk_size`` rows of them at a time). ``loss_chunk_size=0`` runs the library's own forward,
    which materialises them (the reference the chunked loss is tested against).

    The prologue (anchors, noise embeddings, the block mask), the labels and the statistics are the
    library's; the loss is its ``Σ w·CE / (Σ w + 1e-6)`` with ``w`` the decayed mask of the predicted
    positions (block position 0 and padded blocks are never projected), or ``Σ w·loss`` of the run's
    :class:`~dflash_train.loss.head.LossTerms`: distillation learns, at block position k, the target's
    distribution at ``anchor + k − 1`` (the predecessor of the label's position), read from the target's
    final hidden states passed as ``teacher_hidden``. A variant with more terms overrides :meth:`objective`.

    With ``on_policy`` set (by the training module, in the on-policy stage) the block loss is shaped by what
    serving accepts (:func:`accepted_prefix`): the run's terms on each block's accepted prefix, the reverse KL
    at its first rejected position, and the run's terms times ``after_rejection_weight`` at every position
    that is not accepted (0: nothing after the first rejection; 1: the ordinary loss there).
    """

    def __init__(self, *args, loss_chunk_size: int, loss_terms: LossTerms = CROSS_ENTROPY, **kwargs):
        super().__init__(*args, **kwargs)
        if loss_terms.distills and not loss_chunk_size:
            raise ValueError("distillation (kl / tv loss terms) needs the chunked head: loss_chunk_size > 0")
        self.loss_terms = loss_terms
        self.loss_chunk_size = loss_chunk_size
        self.supervised_bound: int | None = None  # the batch's supervised tokens (host), set around a forward
        self.position_weights: list[float] | None = None  # dflash.step_loss_weights (None: the library's decay)
        self.on_policy = False  # the on-policy stage's loss (set by the training module around a forward)
        self.after_rejection_weight = 0.0  # dflash.on_policy_after_rejection_weight
        self.weighted_ce: torch.Tensor | None = None  # Σ w·CE of the last forward at every supervised position

    def depth_weighted(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask [B, N, block−1]`` times the weight of predicted position k: ``dflash.step_loss_weights``
        when given, else the decay ``exp(−k / γ)`` (or the mask)."""
        if self.position_weights is not None:
            return mask * torch.tensor(self.position_weights, dtype=mask.dtype, device=mask.device)
        if self.loss_decay_gamma is None:
            return mask
        depth = torch.arange(mask.shape[-1], device=mask.device, dtype=mask.dtype)
        return mask * torch.exp(-depth / self.loss_decay_gamma)

    def output_transform(self) -> dict:
        """The target's output transform the draft applies in ``compute_logits`` (multiplier, soft-cap)."""
        return {
            "multiplier": getattr(self.draft_model, "output_multiplier", 1.0),
            "softcap": getattr(self.draft_model, "final_logit_softcapping", None),
        }

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, teacher: TeacherRows | None,
                  top_k: int = 0) -> HeadLoss:
        """The chunked head + the run's loss with the draft's output transform, sized on the host (no read-back).

        In the on-policy stage a first pass without gradient reads the draft's proposals at every position
        (its predictions, top-k, and the hard-label CE, which stay what the step reports), and a second pass
        computes the loss at the positions :func:`accepted_prefix` keeps: the run's terms on each block's
        accepted prefix (and, times ``after_rejection_weight``, elsewhere), ``reverse_kl`` at its first
        rejection. It is normalised by the same Σ w as the
        ordinary loss, so a kept position's gradient has the size it has off-policy.
        """
        bound = position_bound(weights, self.supervised_bound)
        if not self.on_policy:
            result = self._chunked_head(hidden, targets, weights, self.loss_terms, teacher, top_k, bound)
            self.weighted_ce = result.weighted_nll.detach()
            return result
        with torch.no_grad():
            seen = self._chunked_head(hidden.detach(), targets, weights, CROSS_ENTROPY, None, top_k, bound)
        accepted, first_rejection = accepted_prefix(seen.predictions, targets, weights != 0)
        reverse = weights * first_rejection if self.loss_terms.reverse_kl else None
        kept = accepted + self.after_rejection_weight * (1.0 - accepted)
        shaped = self._chunked_head(hidden, targets, weights * kept, self.loss_terms, teacher, 0, bound, reverse)
        self.weighted_ce = seen.weighted_nll.detach()
        return HeadLoss(shaped.weighted_loss, seen.weighted_nll, seen.predictions, seen.top_ids)

    def _chunked_head(self, hidden, targets, weights, terms, teacher, top_k, bound, reverse_weights=None) -> HeadLoss:
        return chunked_head_loss(
            hidden,
            self.lm_head,
            targets,
            weights,
            self.loss_chunk_size,
            top_k=top_k,
            max_positions=bound,
            terms=terms,
            teacher=teacher,
            reverse_weights=reverse_weights,
            **self.output_transform(),
        )

    def forward(self, input_ids, hidden_states, loss_mask, position_ids=None, seq_lens=None, doc_remaining=None,
                teacher_hidden=None):
        if not self.loss_chunk_size:
            return super().forward(input_ids, hidden_states, loss_mask, position_ids, seq_lens, doc_remaining)
        if self.loss_terms.distills and teacher_hidden is None:
            raise ValueError("distillation (kl / tv loss terms) needs the target's final hidden states (teacher_hidden)")
        bsz, seq_len = input_ids.shape
        anchors, keep, noise_embedding, full_position_ids, attention_mask, _ = self._prepare_block_inputs(
            input_ids, loss_mask, position_ids=position_ids, seq_lens=seq_lens, doc_remaining=doc_remaining
        )
        output_hidden = self.draft_model(
            position_ids=full_position_ids,
            noise_embedding=noise_embedding,
            target_hidden=hidden_states,
            attention_mask=attention_mask,
        )
        blocks = anchors.size(1)
        label_positions, target_ids, block_mask = self._build_block_targets(
            input_ids, loss_mask, anchors, keep, seq_len, doc_remaining=doc_remaining
        )
        # block position k predicts the token at anchor + k; position 0 (the anchor itself) is never a target
        hidden = output_hidden.view(bsz, blocks, self.block_size, -1)[:, :, 1:]
        teacher = None
        if self.loss_terms.distills:  # the target's own prediction of the token at anchor + k is made at anchor + k - 1
            rows = torch.arange(bsz, device=input_ids.device)[:, None, None] * seq_len
            predecessors = label_positions[:, :, 1:].clamp(max=seq_len - 1) - 1
            teacher = TeacherRows(teacher_hidden.reshape(bsz * seq_len, -1), rows + predecessors)
        return self.objective(hidden, target_ids, block_mask[:, :, 1:], teacher)

    def objective(self, hidden: torch.Tensor, target_ids: torch.Tensor, mask: torch.Tensor,
                  teacher: TeacherRows | None = None):
        """DFlash's step metrics from the predicted positions' hidden states ``[B, N, block−1, H]``, the blocks'
        labels ``[B, N, block]``, the supervised mask ``[B, N, block−1]`` and, when distilling, the target's
        rows for each predicted position."""
        dflash = automodel_speculative_dflash()
        targets = target_ids[:, :, 1:]
        weights = self.depth_weighted(mask)
        head = self.head_loss(hidden, targets, weights, teacher)
        loss_weight = weights.sum()
        with torch.no_grad():
            supervised = mask.bool()
            valid_tokens = mask.sum()
            correct_tokens = ((head.predictions == targets) & supervised).sum()
            accept_len, accept_len_sum, valid_blocks = dflash.core.compute_acceptance_stats(
                head.predictions, targets, supervised
            )
        return dflash.DFlashStepMetrics(
            loss=head.weighted_loss / (loss_weight + 1e-6),
            loss_weight=loss_weight.detach(),
            accuracy=correct_tokens / valid_tokens.clamp_min(1),
            valid_tokens=valid_tokens,
            correct_tokens=correct_tokens,
            accept_len=accept_len,
            accept_len_sum=accept_len_sum,
            valid_blocks=valid_blocks,
        )


def accepted_prefix(predictions: torch.Tensor, targets: torch.Tensor, supervised: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted, first_rejection)`` float masks ``[..., positions]`` of blocks of proposals: the leading
    supervised positions whose proposal equals the label (what verification accepts), and the first
    supervised position after them whose proposal differs (where the round ends). Positions after a
    rejection, or after an unsupervised position, are in neither."""
    match = (predictions == targets) & supervised
    accepted = match.long().cumprod(dim=-1).bool()
    reached = F.pad(accepted, (1, 0), value=True)[..., :-1]
    first_rejection = reached & supervised & ~match
    return accepted.to(torch.float32), first_rejection.to(torch.float32)


def with_chunked_loss(mixin: type, core_cls: type) -> type:
    """``core_cls`` with ``mixin``'s chunked loss in front of its forward."""
    return type(f"Chunked{core_cls.__name__}", (mixin, core_cls), {})


class DFlash(DraftVariant):
    """The base method: argmax proposals, the decayed block cross-entropy, no extra keys."""

    name = "dflash"
    export_architecture = "DFlashDraftModel"
    architecture_aliases = ("Qwen3DFlashDraftModel", "DFlashQwen3DFlashDraftModel")

    def load_classes(self):
        dflash = automodel_speculative_dflash()
        return dflash.Qwen3DFlashDraftModel, with_chunked_loss(ChunkedBlockLoss, dflash.DFlashTrainerModule)

    def trainer_kwargs(self, cfg: DFlashConfig) -> dict:
        return {"loss_chunk_size": cfg.loss_chunk_size, "loss_terms": self.loss_terms(cfg)}


DFLASH = DFlash()
