"""The chunked LM head + cross-entropy (``dflash.loss_chunk_size``): equal to the full-logits loss it replaces.

``chunked_head_loss`` against cross-entropy written out here; each variant's chunked step against the same
step with ``loss_chunk_size=0`` (nemo_automodel's own loss for DFlash / DFlash2, the full-logits MTP loss):
loss, statistics and every draft gradient. The memory it saves is measured by
``benchmarks/loss_memory.py`` (docs/benchmarks.md), not here.

Distillation (``dflash.loss_kl_weight`` / ``loss_tv_weight`` / ``distill_*``): the chunked head's KL and TV
terms against the same quantities written out with torch's own functions, and each variant's step reading
the target's distribution at the right position. That check needs no second implementation of the index:
the target's distribution cut to its single likeliest token (``distill_top_k=1``) is one-hot at the
target's greedy token, which is what ``label_source=target_argmax`` writes as the label, so KL against it
is the cross-entropy of those labels, loss and gradient, when (and only when) the distribution is read at
the label's predecessor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import UTTERANCES, chatml_speech_batch, compose, relative_difference, tiny_run_overrides

from dflash_train.config import validate_config
from dflash_train.draft import DraftSpec
from dflash_train.draft.family import family_of
from dflash_train.loss.head import LossTerms, TeacherRows, chunked_head_loss, logits_at
from dflash_train.training.module import DFlashDraftModule, ModuleSettings

VOCAB, HIDDEN, TEACHER_ROWS = 97, 16, 40


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
    return head, hidden, targets, weights


def _transform(logits, multiplier, softcap):
    logits = logits * multiplier
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _direct(head, hidden, targets, weights, multiplier, softcap):
    logits = _transform(head(hidden), multiplier, softcap)
    nll = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view_as(weights)
    return (nll * weights).sum(), logits


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("multiplier, softcap", [(1.0, None), (0.5, 3.0)])
@pytest.mark.parametrize("bound", [None, "shape"])
def test_chunked_head_loss_equals_the_full_logits_computation(chunk, multiplier, softcap, bound):
    """Picking the supervised rows by their count read back, or into a host bound of slots (the trainer
    cores' way: the leftover slots run with zero weight and must not leak into loss, gradient or outputs)."""
    head, hidden, targets, weights = _case()
    expected, logits = _direct(head, hidden, targets, weights, multiplier, softcap)
    (expected_grad,) = torch.autograd.grad(expected, hidden)

    result = chunked_head_loss(
        hidden, head, targets, weights, chunk, top_k=5, multiplier=multiplier, softcap=softcap,
        max_positions=None if bound is None else weights.numel(),
    )
    (grad,) = torch.autograd.grad(2.0 * result.weighted_loss, hidden)  # the incoming gradient scales it

    torch.testing.assert_close(result.weighted_loss, expected, rtol=1e-5, atol=0)
    assert torch.equal(result.weighted_nll, result.weighted_loss.detach())  # cross-entropy alone: the same sum
    torch.testing.assert_close(grad, 2.0 * expected_grad, rtol=1e-5, atol=1e-6)
    assert (grad[weights == 0] == 0).all()  # unsupervised positions never reach the head
    used = weights > 0
    assert torch.equal(result.predictions[used], logits.argmax(dim=-1)[used])
    assert (result.predictions[~used] == -1).all()
    assert torch.equal(result.top_ids[used], logits.topk(5, dim=-1).indices[used])
    torch.testing.assert_close(
        logits_at(hidden, head, result.top_ids, multiplier, softcap)[used], logits.topk(5, dim=-1).values[used]
    )


def test_positions_choose_what_is_projected_even_at_weight_zero():
    """MTP counts a supervised step whose weight is 0 in its statistics: ``positions`` keeps it projected."""
    head, hidden, targets, weights = _case(1)
    positions = torch.ones_like(weights, dtype=torch.bool)
    result = chunked_head_loss(hidden, head, targets, weights, 4, positions=positions)
    assert torch.equal(result.predictions, head(hidden).argmax(dim=-1))


def test_a_trainable_head_is_refused():
    head, hidden, targets, weights = _case()
    head.requires_grad_(True)
    with pytest.raises(ValueError, match="must be frozen"):
        chunked_head_loss(hidden, head, targets, weights, 4)


def _module(tiny_salm_dir, tiny_target, variant: str, chunk: int, draft=None, extra: tuple = ()):
    overrides = tiny_run_overrides(tiny_salm_dir) + [f"dflash={variant}", f"dflash.loss_chunk_size={chunk}", *extra]
    if variant == "dflash2":
        overrides += ["dflash.selector_rank=16", f"dflash.selector_top_k={tiny_target.vocab_size // 8}"]
    cfg = validate_config(compose("dflash", overrides)).run.dflash
    layers = (1, 3) if variant != "mtp" else None
    spec = DraftSpec(cfg, layers, 320, tiny_target.num_layers)
    if draft is None:
        torch.manual_seed(0)
        draft = family_of(spec.variant).build_draft(tiny_target, spec, "sdpa")
    return DFlashDraftModule(tiny_target, draft, spec, ModuleSettings(layer_ids=list(layers or []))), draft


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "mtp"])
def test_each_variants_chunked_step_equals_its_full_logits_step(tiny_salm_dir, tiny_target, speech_batch, variant):
    """Same draft, batch and anchors: the chunked step's loss, statistics and every draft gradient equal the
    full-logits step's (FP32, ≤ 1e-5 relative)."""
    full, draft = _module(tiny_salm_dir, tiny_target, variant, 0)
    batch = chatml_speech_batch(tiny_target, speech_batch, list(UTTERANCES.values()))
    # with the loader's host copies: the chunked loss sizes its rows by the batch's supervised count
    inputs = full.prepare(batch.with_placements(tiny_target.audio_locator_tag_id))
    assert inputs.supervised_bound == int(batch.loss_mask.sum())
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for step in range(15):  # some right predictions, so that the statistics compare something
        optimizer.zero_grad()
        full.run_core(inputs, rng_key=step).loss.backward()
        optimizer.step()
    chunked, _ = _module(tiny_salm_dir, tiny_target, variant, 5, draft=copy.deepcopy(draft))

    results = []
    for module in (full, chunked):
        module.draft.zero_grad()
        metrics = module.run_core(inputs, rng_key=11)
        metrics.loss.backward()
        grads = {name: p.grad.clone() for name, p in module.draft.named_parameters() if p.grad is not None}
        results.append((metrics, grads))
    (expected, expected_grads), (metrics, grads) = results

    assert float(expected.valid_tokens) > 20 and 0 < float(expected.accuracy) < 1
    for field in type(expected).__dataclass_fields__:
        want, got = getattr(expected, field), getattr(metrics, field)
        if field == "loss":
            torch.testing.assert_close(got, want.detach().to(got.dtype), rtol=1e-5, atol=0)
        else:
            torch.testing.assert_close(got.detach().to(want.dtype), want.detach(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m, field=field: f"{field}: {m}")
    assert grads.keys() == expected_grads.keys() and len(grads) > 3
    worst = max((relative_difference(grad, expected_grads[name]), name) for name, grad in grads.items())
    print(f"{variant}: worst gradient difference {worst[0]:.1e} relative ({worst[1]})")
    assert worst[0] <= 1e-5, worst


def _weighted_module(tiny_salm_dir, tiny_target, variant: str, weights, draft):
    overrides = [] if weights is None else [f"dflash.step_loss_weights=[{','.join(map(str, weights))}]"]
    module, _ = _module(tiny_salm_dir, tiny_target, variant, 5, draft=draft, extra=overrides)
    return module


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "mtp"])
def test_step_loss_weights_weigh_each_draft_position(tiny_salm_dir, tiny_target, speech_batch, variant):
    """``dflash.step_loss_weights`` (w_k per draft position k): the default decay written out as a list gives
    the default step; and, from one-hot weightings on the same draft, batch and anchors (per-position mean
    CE L_k over M_k supervised positions), any w gives Σ w_k·L_k·M_k / Σ w_k·M_k (DFlash, MTP: the loss is
    that one weighted CE; DFlash2 adds its selector term, checked by the first half only)."""
    default, draft = _module(tiny_salm_dir, tiny_target, variant, 5)
    positions = default.spec.variant.draft_positions(default.spec.cfg)
    batch = chatml_speech_batch(tiny_target, speech_batch, list(UTTERANCES.values()))
    inputs = default.prepare(batch.with_placements(tiny_target.audio_locator_tag_id))

    def step(weights):
        module = default if weights == "default" else _weighted_module(tiny_salm_dir, tiny_target, variant, weights,
                                                                        draft)
        metrics = module.run_core(inputs, rng_key=11)
        return float(metrics.loss), float(metrics.loss_weight)

    decay = default.spec.variant.step_weights(default.spec.cfg)
    assert step(decay) == pytest.approx(step("default"), rel=1e-6)
    if variant == "dflash2":
        return
    per_position = [step([1.0 if j == k else 0.0 for j in range(positions)]) for k in range(positions)]
    assert all(count > 0 for _, count in per_position)
    mixed = [abs(0.5 + k * (-1) ** k) for k in range(positions)]  # 0.5, 0.5, 2.5, 2.5, 4.5, ...: not a decay
    expected = sum(w * loss * count for w, (loss, count) in zip(mixed, per_position)) / sum(
        w * count for w, (_, count) in zip(mixed, per_position))
    assert step(mixed)[0] == pytest.approx(expected, rel=1e-5)


def _teacher_rows(seed: int = 2) -> TeacherRows:
    """Target rows for :func:`_case`'s positions: random states, a random row for each position."""
    generator = torch.Generator().manual_seed(seed)
    return TeacherRows(torch.randn(TEACHER_ROWS, HIDDEN, generator=generator),
                       torch.randint(0, TEACHER_ROWS, (3, 5, 4), generator=generator))


def _direct_distillation(head, hidden, targets, weights, teacher, terms: LossTerms, multiplier, softcap):
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
    head, hidden, targets, weights = _case()
    teacher = _teacher_rows()
    expected, expected_ce = _direct_distillation(head, hidden, targets, weights, teacher, terms, multiplier, softcap)
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
    head, hidden, targets, weights = _case()
    with pytest.raises(ValueError, match="need the target's rows"):
        chunked_head_loss(hidden, head, targets, weights, 4, terms=LossTerms(ce=0.0, kl=1.0))


TOP1_KL = ("dflash.loss_ce_weight=0", "dflash.loss_kl_weight=1", "dflash.distill_top_k=1")


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "mtp"])
def test_top1_kl_to_the_target_is_cross_entropy_on_its_greedy_labels(tiny_salm_dir, tiny_target, speech_batch,
                                                                     variant):
    """Same draft, batch and anchors, ``label_source=target_argmax``: KL to the target's distribution cut to its
    top token equals the hard-label CE, loss, statistics and every draft gradient (a distribution read one
    position off, at the label's own position, gives another loss)."""
    ce_module, draft = _module(tiny_salm_dir, tiny_target, variant, 5)
    kl_module, _ = _module(tiny_salm_dir, tiny_target, variant, 5, draft=draft, extra=TOP1_KL)
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
    module, _ = _module(tiny_salm_dir, tiny_target, "dflash", 5, extra=TOP1_KL)
    features = torch.zeros(1, 1, 2 * tiny_target.hidden_size)
    placeholder = module.placeholder_inputs(module.filler_inputs(1, 4, features))
    assert placeholder.teacher_hidden.shape == (1, placeholder.input_ids.shape[1], tiny_target.hidden_size)
    metrics = module.run_core(placeholder, rng_key=1)
    assert torch.isfinite(metrics.loss)


@pytest.mark.parametrize("temperature, chunk, multiplier, softcap", [(1.0, 1, 1.0, None), (2.0, 7, 0.5, 3.0)])
def test_reverse_kl_rows_equal_the_direct_computation(temperature, chunk, multiplier, softcap):
    """The on-policy stage's reverse KL, ``τ²·KL(q_τ ‖ p_τ)`` at the positions given a reverse weight, next to CE at
    the others: loss and gradient against torch's ``kl_div`` with the roles swapped and autograd."""
    head, hidden, targets, weights = _case()
    teacher = _teacher_rows()
    generator = torch.Generator().manual_seed(5)
    reverse = torch.rand(weights.shape, generator=generator) * (weights == 0) * (torch.rand(weights.shape) > 0.5)
    terms = LossTerms(ce=1.0, temperature=temperature, reverse_kl=0.6)

    student = _transform(head(hidden), multiplier, softcap)
    teacher_logits = _transform(head(teacher.hidden[teacher.index]), multiplier, softcap)
    log_q = (student / temperature).log_softmax(dim=-1)
    log_p = (teacher_logits / temperature).log_softmax(dim=-1)
    backward_kl = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(dim=-1)  # KL(q ‖ p)
    ce = F.cross_entropy(student.flatten(0, -2), targets.flatten(), reduction="none").view_as(weights)
    expected = (ce * weights).sum() + 0.6 * temperature**2 * (backward_kl * reverse).sum()
    (expected_grad,) = torch.autograd.grad(expected, hidden)

    result = chunked_head_loss(hidden, head, targets, weights, chunk, multiplier=multiplier, softcap=softcap,
                               max_positions=weights.numel(), terms=terms, teacher=teacher, reverse_weights=reverse)
    (grad,) = torch.autograd.grad(result.weighted_loss, hidden)
    assert float(reverse.sum()) > 1 and float((reverse * weights).sum()) == 0
    torch.testing.assert_close(result.weighted_loss, expected, rtol=1e-5, atol=0)
    assert relative_difference(grad, expected_grad) <= 1e-5
    assert (grad[(weights == 0) & (reverse == 0)] == 0).all()
    with pytest.raises(ValueError, match="reverse_weights without a reverse_kl term"):
        chunked_head_loss(hidden, head, targets, weights, chunk, terms=LossTerms(), reverse_weights=reverse)
    with pytest.raises(ValueError, match="teacher_top_k"):
        LossTerms(reverse_kl=1.0, teacher_top_k=3)


def test_the_accepted_prefix_ends_at_the_first_rejection():
    from dflash_train.variants.dflash import accepted_prefix

    targets = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    predictions = torch.tensor([[5, 6, 0, 8, 9], [0, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    supervised = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 1, 1]]).bool()
    accepted, first_rejection = accepted_prefix(predictions, targets, supervised)
    assert accepted.tolist() == [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    # row 2 ends unsupervised (the reply's end) and row 3 stops at an unsupervised position: no rejection there
    assert first_rejection.tolist() == [[0, 0, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


ON_POLICY = ("dflash.on_policy_from_step=0", "dflash.on_policy_reverse_kl_weight=0.7")


@pytest.mark.parametrize("variant, after", [("dflash", 0.0), ("dflash2", 0.0), ("dflash", 0.5)])
def test_the_on_policy_block_loss_is_the_run_loss_on_the_accepted_prefix_and_reverse_kl_at_the_rejection(
        tiny_salm_dir, tiny_target, speech_batch, variant, after):
    """Same draft, batch and anchors: the on-policy head's loss equals CE on each block's accepted prefix plus
    0.7·KL(q ‖ p) at its first rejected position (plus ``after`` × CE at every position not accepted), written
    out from the ordinary step's own predictions and the target's logits at the label's predecessor; the
    step's statistics (predictions, accept_len) are unchanged."""
    module, draft = _module(tiny_salm_dir, tiny_target, variant, 5,
                            extra=(*ON_POLICY, f"dflash.on_policy_after_rejection_weight={after}"))
    batch = chatml_speech_batch(tiny_target, speech_batch, list(UTTERANCES.values()))
    inputs = module.prepare(batch.with_placements(tiny_target.audio_locator_tag_id))
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for step in range(15):  # some accepted prefixes, so that both kinds of position are present
        optimizer.zero_grad()
        module.run_core(inputs, rng_key=step).loss.backward()
        optimizer.step()
    captured = {}
    core = module.core
    original = core.head_loss

    def capture(hidden, targets, weights, teacher, top_k=0):
        captured.update(hidden=hidden, targets=targets, weights=weights, teacher=teacher)
        return original(hidden, targets, weights, teacher, top_k)

    core.head_loss = capture
    ordinary = module.run_core(inputs, rng_key=5)
    ordinary_hidden = captured["hidden"]
    shaped = module.run_core(inputs, rng_key=5, on_policy=True)
    for field in ("loss_weight", "valid_tokens", "correct_tokens", "accept_len_sum"):
        assert torch.equal(getattr(shaped, field), getattr(ordinary, field)), field

    hidden, targets, weights, teacher = (captured[key] for key in ("hidden", "targets", "weights", "teacher"))
    assert torch.equal(hidden, ordinary_hidden)
    student = module.core.lm_head(hidden.detach()).float()
    teacher_logits = module.core.lm_head(teacher.hidden[teacher.index]).float()
    supervised = weights != 0
    match = (student.argmax(dim=-1) == targets) & supervised
    accepted = match.long().cumprod(dim=-1)
    reached = torch.cat([torch.ones_like(accepted[..., :1]), accepted[..., :-1]], dim=-1).bool()
    rejected = reached & supervised & ~match
    assert int(accepted.sum()) > 5 and int(rejected.sum()) > 5 and int((supervised & ~reached).sum()) > 5
    ce = F.cross_entropy(student.flatten(0, -2), targets.flatten(), reduction="none").view_as(weights)
    reverse = F.kl_div(teacher_logits.log_softmax(-1), student.log_softmax(-1), reduction="none",
                       log_target=True).sum(-1)
    expected = ((ce * (accepted + after * (1 - accepted)) + 0.7 * reverse * rejected) * weights).sum()
    block_loss = shaped.base_loss if variant == "dflash2" else shaped.loss
    torch.testing.assert_close(block_loss.detach() * (weights.sum() + 1e-6), expected, rtol=1e-4, atol=0)
