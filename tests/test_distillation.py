"""Distillation losses (``dflash.loss_kl_weight`` / ``loss_tv_weight`` / ``distill_*``): the chunked head's KL
and TV terms against the same quantities written out with torch's own functions, and each variant's step
reading the target's distribution at the right position.

The position check needs no second implementation of the index: the target's distribution cut to its single
likeliest token (``distill_top_k=1``) is one-hot at the target's greedy token, which is what
``label_source=target_argmax`` writes as the label, so KL against it is the cross-entropy of those labels,
loss and gradient, when (and only when) the distribution is read at the label's predecessor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import UTTERANCES, chatml_speech_batch, compose, relative_difference, tiny_run_overrides

from dflash_train.config import validate_config
from dflash_train.draft import DraftSpec
from dflash_train.draft.family import family_of
from dflash_train.loss.head import LossTerms, TeacherRows, chunked_head_loss
from dflash_train.training.module import DFlashDraftModule, ModuleSettings

VOCAB, HIDDEN, TEACHER_ROWS = 61, 12, 40


def _case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator))
        head.bias.copy_(torch.randn(VOCAB, generator=generator))
    head.requires_grad_(False)
    hidden = torch.randn(3, 5, 4, HIDDEN, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (3, 5, 4), generator=generator)
    weights = torch.rand(3, 5, 4, generator=generator) * (torch.rand(3, 5, 4, generator=generator) > 0.3)
    teacher = TeacherRows(torch.randn(TEACHER_ROWS, HIDDEN, generator=generator),
                          torch.randint(0, TEACHER_ROWS, (3, 5, 4), generator=generator))
    return head, hidden, targets, weights, teacher


def _transform(logits, multiplier, softcap):
    logits = logits * multiplier
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _direct(head, hidden, targets, weights, teacher, terms: LossTerms, multiplier, softcap):
    """Σ w·(ce·CE + kl·τ²·KL(p_τ‖q_τ) + tv·TV(p_τ, q_τ)) with torch's cross_entropy / kl_div and autograd."""
    student = _transform(head(hidden), multiplier, softcap)
    teacher_logits = _transform(head(teacher.hidden[teacher.index]), multiplier, softcap) / terms.temperature
    if terms.teacher_top_k:
        cut = teacher_logits.topk(terms.teacher_top_k, dim=-1)
        teacher_logits = torch.full_like(teacher_logits, float("-inf")).scatter(-1, cut.indices, cut.values)
    p = teacher_logits.softmax(dim=-1)
    log_q = (student / terms.temperature).log_softmax(dim=-1)
    ce = F.cross_entropy(student.flatten(0, -2), targets.flatten(), reduction="none").view_as(weights)
    kl = F.kl_div(log_q, p, reduction="none").sum(dim=-1)
    tv = 0.5 * (p - log_q.exp()).abs().sum(dim=-1)
    per_position = terms.ce * ce + terms.kl * terms.temperature**2 * kl + terms.tv * tv
    return (per_position * weights).sum(), (ce * weights).sum()


@pytest.mark.parametrize(
    "terms",
    [
        LossTerms(ce=0.0, kl=1.0),
        LossTerms(ce=0.0, kl=1.0, temperature=2.0),
        LossTerms(ce=0.0, kl=1.0, teacher_top_k=3),
        LossTerms(ce=0.0, tv=1.0),
        LossTerms(ce=0.0, kl=1.0, tv=0.7, teacher_top_k=5, temperature=0.5),
        LossTerms(ce=0.3, kl=0.7),
    ],
    ids=["kl", "kl-temperature", "kl-top3", "tv", "kl+tv-top5-t0.5", "ce+kl"],
)
@pytest.mark.parametrize("chunk, multiplier, softcap", [(1, 1.0, None), (7, 0.5, 3.0)])
def test_chunked_distillation_equals_the_direct_computation(terms, chunk, multiplier, softcap):
    """Loss, hard-label CE and the gradient with respect to the draft's hidden states (FP32, ≤ 1e-5
    relative), with a host bound of slots, so that the leftover slots' zero weight is exercised too."""
    head, hidden, targets, weights, teacher = _case()
    expected, expected_ce = _direct(head, hidden, targets, weights, teacher, terms, multiplier, softcap)
    (expected_grad,) = torch.autograd.grad(expected, hidden)

    result = chunked_head_loss(hidden, head, targets, weights, chunk, multiplier=multiplier, softcap=softcap,
                               max_positions=weights.numel(), terms=terms, teacher=teacher)
    (grad,) = torch.autograd.grad(3.0 * result.weighted_loss, hidden)

    torch.testing.assert_close(result.weighted_loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(result.weighted_nll, expected_ce.detach(), rtol=1e-5, atol=0)
    # FP32 (q − p) cancels in single entries: the gradient is compared as a whole
    assert relative_difference(grad, 3.0 * expected_grad) <= 1e-5
    assert (grad[weights == 0] == 0).all()


def test_distillation_without_the_targets_rows_is_refused():
    head, hidden, targets, weights, _ = _case()
    with pytest.raises(ValueError, match="need the target's rows"):
        chunked_head_loss(hidden, head, targets, weights, 4, terms=LossTerms(ce=0.0, kl=1.0))


def _module(tiny_salm_dir, tiny_target, variant: str, extra: tuple = (), draft=None):
    overrides = tiny_run_overrides(tiny_salm_dir) + [f"dflash={variant}", "dflash.loss_chunk_size=5",
                                                 "dflash.label_source=target_argmax", *extra]
    if variant == "dflash2":
        overrides += ["dflash.selector_rank=16", f"dflash.selector_top_k={tiny_target.vocab_size // 8}"]
    cfg = validate_config(compose("dflash", overrides)).run.dflash
    layers = (1, 3) if variant != "mtp" else None
    spec = DraftSpec(cfg, layers, 320, tiny_target.num_layers)
    if draft is None:
        torch.manual_seed(0)
        draft = family_of(spec.variant).build_draft(tiny_target, spec, "sdpa")
    settings = ModuleSettings(layer_ids=list(layers or []), label_source=cfg.label_source)
    return DFlashDraftModule(tiny_target, draft, spec, settings), draft


TOP1_KL = ("dflash.loss_ce_weight=0", "dflash.loss_kl_weight=1", "dflash.distill_top_k=1")


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "mtp"])
def test_top1_kl_to_the_target_is_cross_entropy_on_its_greedy_labels(tiny_salm_dir, tiny_target, speech_batch,
                                                                     variant):
    """Same draft, batch and anchors, ``label_source=target_argmax``: KL to the target's distribution cut to its
    top token equals the hard-label CE, loss, statistics and every draft gradient (a distribution read one
    position off, at the label's own position, gives another loss)."""
    ce_module, draft = _module(tiny_salm_dir, tiny_target, variant)
    kl_module, _ = _module(tiny_salm_dir, tiny_target, variant, TOP1_KL, draft=draft)
    assert kl_module.distills and not ce_module.distills
    batch = chatml_speech_batch(tiny_target, speech_batch, list(UTTERANCES.values()))
    batch = batch.with_placements(tiny_target.audio_locator_tag_id)
    ce_inputs, kl_inputs = ce_module.prepare(batch), kl_module.prepare(batch)
    assert ce_inputs.teacher_hidden is None
    assert (kl_inputs.teacher_hidden is None) == (variant == "mtp")  # MTP's features are those states already

    results = []
    for module, inputs in ((ce_module, ce_inputs), (kl_module, kl_inputs)):
        draft.zero_grad()
        metrics = module.run_core(inputs, rng_key=5)
        metrics.loss.backward()
        results.append((metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (expected, expected_grads), (metrics, grads) = results

    assert float(expected.valid_tokens) > 20
    torch.testing.assert_close(metrics.loss.detach(), expected.loss.detach(), rtol=1e-5, atol=0)
    for field in ("loss_weight", "valid_tokens", "correct_tokens", "accept_len_sum"):
        assert torch.equal(getattr(metrics, field), getattr(expected, field)), field
    assert grads.keys() == expected_grads.keys() and len(grads) > 3
    worst = max((relative_difference(grad, expected_grads[name]), name) for name, grad in grads.items())
    assert worst[0] <= 1e-5, worst


def test_a_distilling_step_on_a_batch_without_anchors_runs_the_placeholder(tiny_salm_dir, tiny_target):
    """A rank whose batch holds no anchor runs a zero-weight placeholder forward: with distillation it needs
    target states too, and gets zero ones of the target's width."""
    module, _ = _module(tiny_salm_dir, tiny_target, "dflash", TOP1_KL)
    features = torch.zeros(1, 1, 2 * tiny_target.hidden_size)
    placeholder = module.placeholder_inputs(module.filler_inputs(1, 4, features))
    assert placeholder.teacher_hidden.shape == (1, placeholder.input_ids.shape[1], tiny_target.hidden_size)
    metrics = module.run_core(placeholder, rng_key=1)
    assert torch.isfinite(metrics.loss)
