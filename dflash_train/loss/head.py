"""The frozen target's LM head and the draft's loss (cross-entropy, distillation) in bounded memory.

A draft step supervises up to ``num_anchors × (block_size − 1)`` positions per row, each over the
target's whole vocabulary: at 512 anchors, block 8 and V = 151,936 the ``[positions, V]`` logits of one
row are 2.5 GB in FP32, and cross-entropy keeps about three such tensors alive (the logits, their
softmax, the gradient) — tens of GB for a batch, more than the draft's activations and the target
together. :func:`chunked_head_loss` never holds more than ``chunk_size`` rows of logits:

* only the supervised positions (weight > 0) go through the head, or, so that a training step never
  waits on the device for their count, a host bound of slots they are packed into (the trainer cores
  pass the batch's supervised tokens × positions per block: block position 0 never runs, the leftover
  slots run with zero weight);
* each chunk's logits are computed, reduced to its weighted NLL, argmax (and top-k when asked), and
  turned straight into the gradient with respect to the hidden states, ``(softmax − onehot) · w · W``;
  the chunk's logits are then freed, so backward is one multiplication by the incoming scalar
  gradient instead of a second pass over the vocabulary;
* distillation (:class:`LossTerms`) computes the target's own logits for the same chunk from its final
  hidden states (:class:`TeacherRows`, the rows the frozen forward already produced), so the target's
  distribution is never held beyond ``chunk_size`` rows either and needs no second target pass;
* positions given a *reverse* weight (the on-policy stage's first rejected position of a block) add the
  reverse KL ``τ²·KL(q_τ ‖ p_τ)`` there, from the same chunk of target logits.

The head is frozen (the target's): no gradient is produced for its weight, and a head that requires one
is refused. The optional output transform of some targets (``logits · multiplier``, then
``cap · tanh(logits / cap)``) is applied inside, with its derivative, so the loss is the one serving
scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LossTerms:
    """What the draft's loss minimises at each supervised position, weighted per position
    (docs/training.md, "Choose the loss"):

        ce · CE(q, label) + kl · τ² · KL(p_τ ‖ q_τ) + tv · TV(p_τ, q_τ)

    and, at positions the caller gives a reverse weight (:func:`chunked_head_loss`'s ``reverse_weights``),
    ``reverse_kl · τ² · KL(q_τ ‖ p_τ)``, the mode-seeking direction: it lowers the draft's probability
    wherever it exceeds the target's, above all on the token it wrongly proposed. ``q`` is the draft's next-token distribution, ``p`` the target's at the same prediction (its logits at
    the label's predecessor, the position whose greedy token the label is), both after the target's output
    transform; ``·_τ`` is the softmax at temperature τ, and with ``teacher_top_k = k > 0`` the target's
    distribution is restricted to its k most likely tokens and renormalised. τ² keeps the KL term's
    gradient the size of CE's as τ changes (Hinton et al.); TV is the total-variation distance
    ``½ Σ |p − q|``, whose complement is the acceptance probability of a sampled draft token.
    """

    ce: float = 1.0
    kl: float = 0.0
    tv: float = 0.0
    teacher_top_k: int = 0
    temperature: float = 1.0
    reverse_kl: float = 0.0

    def __post_init__(self):
        if min(self.ce, self.kl, self.tv) < 0 or self.ce + self.kl + self.tv <= 0:
            raise ValueError(f"loss weights ce={self.ce}, kl={self.kl}, tv={self.tv} must be >= 0, not all zero")
        if self.temperature <= 0 or self.teacher_top_k < 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 and teacher_top_k={self.teacher_top_k} >= 0")
        if self.reverse_kl < 0 or (self.reverse_kl and self.teacher_top_k):
            raise ValueError(f"reverse_kl={self.reverse_kl} must be >= 0, and 0 with teacher_top_k (log p is -inf "
                             "outside the top k)")

    @property
    def distills(self) -> bool:
        """Whether a term needs the target's distribution (and so its final hidden states)."""
        return self.kl > 0 or self.tv > 0 or self.reverse_kl > 0


CROSS_ENTROPY = LossTerms()
"""Hard cross-entropy alone: the default objective."""


@dataclass
class TeacherRows:
    """The target's final hidden states and, per draft position, which of them its distribution comes from.

    ``hidden [R, H]`` (a batch's ``[B, S, H]`` flattened), ``index`` the row of ``hidden`` for each position,
    shaped like the loss's targets: the predecessor of the position the label was read at.
    """

    hidden: torch.Tensor
    index: torch.Tensor


@dataclass
class HeadLoss:
    """What a draft objective needs from the head at its positions.

    ``weighted_loss`` is Σ w·loss over the positions for the :class:`LossTerms` (differentiable with respect
    to the hidden states); ``weighted_nll`` Σ w·CE against the labels (not differentiable; equal to
    ``weighted_loss`` for the default terms); ``predictions`` the argmax token at every position of the
    input's leading shape, ``-1`` where it was not projected; ``top_ids`` the ``top_k`` highest-scoring
    tokens there (zeros where not projected, or ``None``).
    """

    weighted_loss: torch.Tensor
    weighted_nll: torch.Tensor
    predictions: torch.Tensor
    top_ids: Optional[torch.Tensor]


def transformed_logits(raw: torch.Tensor, multiplier: float, softcap: Optional[float]) -> torch.Tensor:
    """The target's output transform on raw head outputs: ``× multiplier``, then ``cap · tanh(· / cap)``."""
    logits = raw * multiplier if multiplier != 1.0 else raw
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def distillation(
    student: torch.Tensor, teacher: torch.Tensor, terms: LossTerms, with_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per row of ``[rows, V]`` logits, ``kl · τ²·KL(p_τ ‖ q_τ) + tv · TV(p_τ, q_τ)`` (:class:`LossTerms`) and,
    with ``with_grad``, its gradient with respect to the student's logits:
    ``kl · τ (q_τ − p_τ) + tv / τ · q_τ ⊙ (g − ⟨q_τ, g⟩)`` with ``g = ½ sign(q_τ − p_τ)``."""
    tau = terms.temperature
    scaled = teacher / tau
    if terms.teacher_top_k:
        top = scaled.topk(terms.teacher_top_k, dim=-1)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(1, top.indices, top.values)
    p = scaled.softmax(dim=-1)  # zero outside the top k
    log_q = (student / tau).log_softmax(dim=-1)
    q = log_q.exp()
    loss = student.new_zeros(student.shape[0])
    grad = torch.zeros_like(student) if with_grad else None
    if terms.kl:
        loss += terms.kl * tau**2 * (torch.xlogy(p, p) - p * log_q).sum(dim=-1)
        if with_grad:
            grad += (terms.kl * tau) * (q - p)
    if terms.tv:
        difference = q - p
        loss += terms.tv * 0.5 * difference.abs().sum(dim=-1)
        if with_grad:
            half_sign = 0.5 * difference.sign_()
            grad += (terms.tv / tau) * q * (half_sign - (q * half_sign).sum(dim=-1, keepdim=True))
    return loss, grad


def reverse_kl(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, with_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per row of ``[rows, V]`` logits, ``τ²·KL(q_τ ‖ p_τ)`` and, with ``with_grad``, its gradient with respect
    to the student's logits, ``τ · q_τ ⊙ (f − ⟨q_τ, f⟩)`` with ``f = log q_τ − log p_τ``."""
    tau = temperature
    log_q = (student / tau).log_softmax(dim=-1)
    gap = log_q - (teacher / tau).log_softmax(dim=-1)
    q = log_q.exp()
    divergence = (q * gap).sum(dim=-1)
    grad = tau * q * (gap - divergence[:, None]) if with_grad else None
    return tau**2 * divergence, grad


class _ChunkedHeadLoss(torch.autograd.Function):
    """Σ w·loss(transform(h·Wᵀ + b), y[, teacher rows]) over rows of ``h``, chunk by chunk; see the module
    docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, reverse_weights, teacher, chunk_size, multiplier,
                softcap, top_k, terms, with_grad):
        compute = torch.promote_types(hidden.dtype, torch.float32)  # at least FP32, as autocast runs CE
        total = hidden.new_zeros((), dtype=compute)
        nll_total = hidden.new_zeros((), dtype=compute)
        predictions = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        top_ids = torch.empty(hidden.shape[0], top_k, dtype=torch.long, device=hidden.device) if top_k else None
        grad_hidden = torch.empty_like(hidden) if with_grad else None

        def head_logits(rows_hidden):
            return transformed_logits(F.linear(rows_hidden, weight, bias).to(compute), multiplier, softcap)

        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = head_logits(hidden[rows])
            log_norm = torch.logsumexp(logits, dim=-1)
            target = targets[rows]
            nll = log_norm - logits.gather(1, target[:, None]).squeeze(1)
            nll_total += (nll * row_weights[rows]).sum()
            predictions[rows] = logits.argmax(dim=-1)
            if top_k:
                top_ids[rows] = logits.topk(top_k, dim=-1).indices
            loss = terms.ce * nll if terms.ce else torch.zeros_like(nll)
            grad = reverse_grad = None
            teacher_logits = head_logits(teacher[rows]) if teacher is not None else None
            if terms.kl or terms.tv:
                loss_distill, grad = distillation(logits, teacher_logits, terms, with_grad)
                loss += loss_distill
            total += (loss * row_weights[rows]).sum()
            if reverse_weights is not None:
                loss_reverse, reverse_grad = reverse_kl(logits, teacher_logits, terms.temperature, with_grad)
                total += terms.reverse_kl * (loss_reverse * reverse_weights[rows]).sum()
            del teacher_logits
            if with_grad:
                slope = 1.0 - (logits / softcap) ** 2 if softcap is not None else None  # d softcap / d input
                if terms.ce:
                    softmax = logits.sub_(log_norm[:, None]).exp_()  # written over the logits
                    softmax.scatter_add_(1, target[:, None], torch.full_like(nll[:, None], -1.0))
                    grad = softmax.mul_(terms.ce) if grad is None else grad.add_(softmax, alpha=terms.ce)
                grad *= row_weights[rows, None]
                if reverse_grad is not None:
                    grad += reverse_grad * (terms.reverse_kl * reverse_weights[rows, None])
                if slope is not None:
                    grad *= slope
                if multiplier != 1.0:
                    grad *= multiplier
                grad_hidden[rows] = grad.to(weight.dtype) @ weight
            del logits, grad, reverse_grad
        ctx.save_for_backward(grad_hidden)
        outputs = (total, nll_total, predictions) + ((top_ids,) if top_k else ())
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_total, *_):
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is None:
            raise RuntimeError("chunked_head_loss ran without gradient tracking; its loss cannot be differentiated")
        return (grad_hidden * grad_total.to(grad_hidden.dtype),) + (None,) * 12


def chunked_head_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int,
    top_k: int = 0,
    multiplier: float = 1.0,
    softcap: Optional[float] = None,
    positions: Optional[torch.Tensor] = None,
    max_positions: Optional[int] = None,
    terms: LossTerms = CROSS_ENTROPY,
    teacher: Optional[TeacherRows] = None,
    reverse_weights: Optional[torch.Tensor] = None,
) -> HeadLoss:
    """Σ w·loss of the frozen ``head`` (an ``nn.Linear``, ``[V, H]``) at ``hidden [..., H]`` against
    ``targets [...]`` with ``weights [...]``, ``chunk_size`` rows of logits at a time (module docstring);
    the loss is :class:`LossTerms` ``terms`` (default: cross-entropy), whose distillation terms need the
    ``teacher`` rows. ``reverse_weights [...]`` (with ``terms.reverse_kl`` > 0) weigh the reverse KL per position.

    Only ``positions [...]`` (bool; default: a non-zero weight or reverse weight) go through the head. Picking exactly them
    costs one device-to-host read (their count). With ``max_positions`` (a host bound on their count)
    there is no read: they are packed into that many slots, and the slots left over run the head with
    zero weight (no loss, no gradient, their predictions discarded).
    """
    weight, bias = head.weight, getattr(head, "bias", None)
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("chunked_head_loss trains no head: the target's LM head must be frozen (requires_grad=False)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if terms.distills and teacher is None:
        raise ValueError("distillation terms (kl, tv, reverse_kl) need the target's rows (teacher)")
    if reverse_weights is not None and not terms.reverse_kl:
        raise ValueError("reverse_weights without a reverse_kl term in the loss terms would be ignored")
    leading = targets.shape
    flat_weights = weights.reshape(-1)
    total = flat_weights.numel()
    if positions is None:
        positions = flat_weights != 0 if reverse_weights is None else (flat_weights != 0) | (reverse_weights.reshape(-1) != 0)
    rows = true_indices(positions.reshape(-1), max_positions)
    source = rows.clamp(max=max(total - 1, 0))
    compute = torch.promote_types(weight.dtype, torch.float32)
    in_range = (rows < total) if max_positions is not None else None

    def picked_weights(values: torch.Tensor) -> torch.Tensor:
        picked_values = values.reshape(-1).index_select(0, source).to(compute)
        return picked_values * in_range if in_range is not None else picked_values

    row_weights = picked_weights(flat_weights)
    row_reverse_weights = picked_weights(reverse_weights) if reverse_weights is not None else None
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source).to(weight.dtype)
    teacher_rows = None
    if terms.distills:
        teacher_rows = teacher.hidden.index_select(0, teacher.index.reshape(-1).index_select(0, source)).to(weight.dtype)
    with_grad = torch.is_grad_enabled() and picked.requires_grad
    outputs = _ChunkedHeadLoss.apply(
        picked,
        weight,
        bias,
        targets.reshape(-1).index_select(0, source),
        row_weights,
        row_reverse_weights,
        teacher_rows,
        chunk_size,
        float(multiplier),
        softcap,
        top_k,
        terms,
        with_grad,
    )
    predictions = torch.full((total + 1,), -1, dtype=torch.long, device=hidden.device)
    predictions[rows] = outputs[2]
    top_ids = None
    if top_k:
        top_ids = torch.zeros((total + 1, top_k), dtype=torch.long, device=hidden.device)
        top_ids[rows] = outputs[3]
        top_ids = top_ids[:total].view(*leading, top_k)
    return HeadLoss(outputs[0], outputs[1], predictions[:total].view(leading), top_ids)


def true_indices(flags: torch.Tensor, bound: Optional[int] = None) -> torch.Tensor:
    """The indices of the true entries of the 1-D bool ``flags``: exactly (their count is read back from
    the device), or, with ``bound`` (a host bound on their count), in ``min(bound, len)`` slots with no
    read, the slots left over holding ``len(flags)``, one past the end, for the caller's scratch slot."""
    if bound is None:
        return flags.nonzero().squeeze(1)
    return torch.nonzero_static(flags, size=min(bound, flags.numel()), fill_value=flags.numel()).squeeze(1)


def position_bound(weights: torch.Tensor, anchor_bound: Optional[int]) -> int:
    """A host bound on the supervised positions of ``weights [..., anchors, positions per anchor]`` for
    ``max_positions``: every position, or ``anchor_bound`` anchors' worth when that is fewer. A batch's
    supervised-token count bounds its kept anchors (each is a distinct supervised position, or the
    position before one), so the rows of its padded blocks need not run the head."""
    total = weights.numel()
    return total if anchor_bound is None else min(total, anchor_bound * weights.shape[-1])


def logits_at(hidden: torch.Tensor, head: nn.Module, token_ids: torch.Tensor, multiplier: float = 1.0,
              softcap: Optional[float] = None) -> torch.Tensor:
    """The transformed logits of only ``token_ids [..., k]`` at ``hidden [..., H]`` (differentiable),
    without the other V − k: a gather of k head rows per position."""
    rows = F.embedding(token_ids, head.weight)  # [..., k, H]
    compute = torch.promote_types(head.weight.dtype, torch.float32)
    raw = torch.einsum("...h,...kh->...k", hidden.to(head.weight.dtype), rows).to(compute)
    if getattr(head, "bias", None) is not None:
        raw = raw + head.bias[token_ids].to(compute)
    return transformed_logits(raw, multiplier, softcap)
