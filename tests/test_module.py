"""The draft-training recipe end to end on the tiny real SALM (single process, CPU)."""

import json

import pytest
import torch
from conftest import UTTERANCES, chatml_speech_batch, compose, same_tensors, tiny_run_overrides
from listdata import ListDataModule
from safetensors.torch import load_file

from dflash_train.config import validate_config
from dflash_train.errors import ConfigError
from dflash_train.training.recipe import train

TEXTS = list(UTTERANCES.values())


def _recipe(salm_dir, run_dir, *extra, variant="dflash2"):
    overrides = tiny_run_overrides(salm_dir) + [
        f"dflash={variant}",
        "trainer=cpu",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "+trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false",
        "dflash.block_size=4",
        "dflash.num_anchors=512",
        "dflash.lr=3e-3",
        f"exp_manager.explicit_log_dir={run_dir}",
        "exp_manager.create_tensorboard_logger=false",
    ]
    if variant == "dflash2":
        overrides += ["dflash.selector_rank=16", "dflash.selector_top_k=8"]
    return validate_config(compose("dflash", overrides + list(extra)))


@pytest.fixture(scope="module")
def batches(tiny_target, speech_batch):
    train_batches = [chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)]
    val_batches = [chatml_speech_batch(tiny_target, speech_batch, TEXTS[::-1], repeat=2)]
    return train_batches, val_batches


def _factory(batches):
    return lambda run, target: ListDataModule(*batches)


def _csv_rows(run_dir):
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _series(rows, key):
    return [float(r[key]) for r in rows if r.get(key)]


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_training_lowers_loss_exports_and_keeps_target_frozen(tiny_salm_dir, tiny_target, batches, tmp_path, variant):
    used = {}

    def factory(run, target):  # called with the target the run loaded and trains against
        used["target"], used["before"] = target, {k: v.clone() for k, v in target.state_dict().items()}
        return ListDataModule(*batches)

    validated = _recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=12", "trainer.val_check_interval=12", "dflash.lr=1e-2",
                        "dflash.label_source=ground_truth",
                        variant=variant)
    summary = train(validated, factory)

    assert summary.steps == 12
    losses = _series(_csv_rows(tmp_path), "train/dflash_loss")
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses
    assert summary.val_accept_len is not None and summary.val_accept_len > 1.02  # 1.0 = nothing accepted; measured 1.055-1.061
    # the target the run used is bit-identical to its checkpoint (a separate load) after training, never checkpointed
    after, on_disk = used["target"].state_dict(), tiny_target.state_dict()
    assert after.keys() == used["before"].keys() == on_disk.keys() and len(after) > 10
    assert same_tensors(after, used["before"]) and same_tensors(after, on_disk)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["state_dict"] and all(k.startswith("core.draft_model.") for k in ckpt["state_dict"])
    # export: vLLM names, no prefix, no embeddings / head, strict reload done by the recipe
    export = summary.export_dir
    assert export == tmp_path / "export"
    config = json.loads((export / "config.json").read_text())
    arch = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[variant]
    assert config["architectures"] == [arch] and config["model_type"] == "qwen3" and config["is_causal"] is False
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2 and config["num_target_layers"] == 6
    assert config["dflash_config"]["target_layer_ids"] == [1, 3] and config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == 320
    assert "eagle_aux_hidden_state_layer_ids" not in config
    weights = load_file(str(export / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 128)
    assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= set(weights)
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in weights)
    trained = {k.removeprefix("core.draft_model."): v for k, v in ckpt["state_dict"].items()}
    assert same_tensors(weights, trained)


def test_projection_only_trains_exactly_fc(tiny_salm_dir, batches, tmp_path):
    first = train(_recipe(tiny_salm_dir, tmp_path / "base", "trainer.max_steps=2"), _factory(batches))
    before = load_file(str(first.export_dir / "model.safetensors"))
    validated = _recipe(
        tiny_salm_dir, tmp_path / "proj", "dflash.projection_only=true",
        f"dflash.init_from_pretrained={first.export_dir}", "trainer.max_steps=3",
    )
    summary = train(validated, _factory(batches))
    after = load_file(str(summary.export_dir / "model.safetensors"))
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == ["fc.weight"]


def test_warm_start_with_a_larger_block_keeps_every_weight(tiny_salm_dir, batches, tmp_path):
    from dflash_train.draft import load_export

    first = train(_recipe(tiny_salm_dir, tmp_path / "b4", "trainer.max_steps=2"), _factory(batches))
    reloaded = load_export(first.export_dir, overrides={"block_size": 8})
    assert reloaded.block_size == 8
    on_disk = load_file(str(first.export_dir / "model.safetensors"))
    state = reloaded.state_dict()
    assert same_tensors({k: state[k] for k in on_disk}, on_disk)
    validated = _recipe(tiny_salm_dir, tmp_path / "b8", "dflash.block_size=8",
                        f"dflash.init_from_pretrained={first.export_dir}", "trainer.max_steps=1")
    summary = train(validated, _factory(batches))
    assert json.loads((summary.export_dir / "config.json").read_text())["dflash_config"]["block_size"] == 8


def test_warm_start_with_other_taps_is_a_config_error(tiny_salm_dir, batches, tmp_path):
    first = train(_recipe(tiny_salm_dir, tmp_path / "a", "trainer.max_steps=1"), _factory(batches))
    validated = _recipe(tiny_salm_dir, tmp_path / "b", "dflash.target_layer_ids=[2,4]",
                        f"dflash.init_from_pretrained={first.export_dir}")
    with pytest.raises(ConfigError, match=r"trained with target_layer_ids=\[1, 3\] but this run uses \[2, 4\]"):
        train(validated, _factory(batches))


def test_flex_attention_on_cpu_fails_at_start(tiny_salm_dir, batches, tmp_path):
    validated = _recipe(tiny_salm_dir, tmp_path, "dflash.attention_backend=flex_attention")
    with pytest.raises(ConfigError, match="flex_attention needs a GPU"):
        train(validated, lambda run, target: pytest.fail("data built before the backend check"))


def test_steps_without_anchor_are_skipped_but_counted(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    good = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    no_anchor = chatml_speech_batch(tiny_target, speech_batch, TEXTS)
    no_anchor.loss_mask[:] = False
    validated = _recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=4", "trainer.val_check_interval=4")
    summary = train(validated, lambda run, target: ListDataModule([good, no_anchor], [no_anchor]))
    assert summary.steps == 4
    rows = _csv_rows(tmp_path)
    assert _series(rows, "train/dflash_skipped_step") == [0.0, 1.0, 0.0, 1.0]
    assert max(_series(rows, "train/skipped/no_valid_anchor")) == 2.0
    assert _series(rows, "val_acc") == [0.0]


def test_target_argmax_labels_equal_full_logits_argmax(tiny_target, speech_batch):
    from dflash_train.training.target_labels import target_argmax_labels

    batch = chatml_speech_batch(tiny_target, speech_batch, TEXTS)
    spliced = tiny_target.splice_batch(batch, 320)
    out = tiny_target.forward_taps(spliced.inputs_embeds, spliced.attention_mask, [1], return_last_hidden=True)
    labels = target_argmax_labels(spliced.input_ids, spliced.loss_mask, out.last_hidden, tiny_target.lm_head,
                                  chunk_rows=7)
    with torch.no_grad():
        full = tiny_target.lm_head(out.last_hidden).argmax(-1)
    sup = spliced.loss_mask.clone()
    assert int(sup.sum()) > 20
    assert torch.equal(labels[:, 1:][sup[:, 1:]], full[:, :-1][sup[:, 1:]])
    assert torch.equal(labels[~sup], spliced.input_ids[~sup])


def test_skipped_steps_leave_weights_and_optimizer_untouched(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    good = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    no_anchor = chatml_speech_batch(tiny_target, speech_batch, TEXTS)
    no_anchor.loss_mask[:] = False
    one = train(_recipe(tiny_salm_dir, tmp_path / "one", "trainer.max_steps=1"),
                lambda run, target: ListDataModule([good], [good]))
    skipped = train(_recipe(tiny_salm_dir, tmp_path / "skip", "trainer.max_steps=3"),
                    lambda run, target: ListDataModule([good, no_anchor, no_anchor], [good]))
    assert skipped.steps == 3
    a = load_file(str(one.export_dir / "model.safetensors"))
    b = load_file(str(skipped.export_dir / "model.safetensors"))
    assert same_tensors(a, b)
    ckpt = torch.load(tmp_path / "skip" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    steps = {float(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}
    assert ckpt["global_step"] == 3 and steps == {1.0}


def test_custom_optimizer_and_gradient_clipping(tiny_salm_dir, batches, tmp_path):
    base = train(_recipe(tiny_salm_dir, tmp_path / "base", "trainer.max_steps=1"), _factory(batches))
    start = load_file(str(base.export_dir / "model.safetensors"))
    validated = _recipe(
        tiny_salm_dir, tmp_path / "sgd", "trainer.max_steps=1", "trainer.gradient_clip_val=0.001",
        "dflash.optimizer={_target_:torch.optim.SGD,lr:1.0}", f"dflash.init_from_pretrained={base.export_dir}",
        "exp_manager.checkpoint_every_n_steps=1",
    )
    summary = train(validated, _factory(batches))
    end = load_file(str(summary.export_dir / "model.safetensors"))
    update = torch.sqrt(sum(((end[k] - start[k]) ** 2).sum() for k in start)).item()
    assert 0 < update <= 0.001 * 1.0001, f"SGD(lr=1) step with clip 0.001 moved weights by {update}"
    ckpt = torch.load(tmp_path / "sgd" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    group = ckpt["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == 1.0 and "momentum" in group and "betas" not in group  # SGD, not the default AdamW


def test_interrupted_run_keeps_its_checkpoint_and_writes_no_export(tiny_salm_dir, batches, tmp_path, caplog):
    class InterruptedStream(ListDataModule):
        """Ctrl-C arrives while the third batch is fetched (prefetched during step 2)."""

        def train_dataloader(self):
            def stream():
                yield from self.train * 2
                raise KeyboardInterrupt

            return stream()

    validated = _recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=5", "exp_manager.checkpoint_every_n_steps=1")
    with caplog.at_level("ERROR"), pytest.raises(SystemExit):  # Lightning exits 1 after a graceful shutdown
        train(validated, lambda run, target: InterruptedStream(*batches))
    assert not (tmp_path / "export").exists()
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    step = ckpt["global_step"]  # Lightning prefetches one batch, so the interrupt lands before step 2 runs
    assert step == 1
    assert f"KeyboardInterrupt at step {step}: no final export was written" in caplog.text


SGD = "dflash.optimizer={_target_:torch.optim.SGD,lr:1.0}"


def _split_batches(target, speech_batch):
    """``(A, B, A+B)``: rows 0-1, row 2, and all three rows as one batch (unequal supervised weights)."""
    audios, lens = speech_batch
    a = chatml_speech_batch(target, (audios[:2], lens[:2]), TEXTS[:2], repeat=2)
    b = chatml_speech_batch(target, (audios[2:], lens[2:]), TEXTS[2:], repeat=2)
    both = chatml_speech_batch(target, speech_batch, TEXTS, repeat=2)
    assert int(a.loss_mask.sum()) != int(b.loss_mask.sum())
    return a, b, both


def _max_diff(x: dict, y: dict) -> float:
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def test_accumulating_two_batches_equals_one_step_on_both(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    """Σw·CE/Σw over the whole window, not the mean of per-micro-batch losses."""
    a, b, both = _split_batches(tiny_target, speech_batch)
    init = train(_recipe(tiny_salm_dir, tmp_path / "init", "trainer.max_steps=1", variant="dflash"),
                 lambda run, target: ListDataModule([both], [both]))
    start = f"dflash.init_from_pretrained={init.export_dir}"
    one = train(_recipe(tiny_salm_dir, tmp_path / "one", "trainer.max_steps=1", SGD, start, variant="dflash"),
                lambda run, target: ListDataModule([both], [both]))
    acc = train(_recipe(tiny_salm_dir, tmp_path / "acc", "trainer.max_steps=1", "trainer.accumulate_grad_batches=2",
                        SGD, start, variant="dflash"),
                lambda run, target: ListDataModule([a, b], [both]))
    ref = load_file(str(init.export_dir / "model.safetensors"))
    w_one, w_acc = load_file(str(one.export_dir / "model.safetensors")), load_file(str(acc.export_dir / "model.safetensors"))
    update = max((w_one[k] - ref[k]).abs().max().item() for k in ref)
    assert update > 1e-3  # the step moved the weights
    assert _max_diff(w_one, w_acc) < 1e-5 * max(1.0, update), (update, _max_diff(w_one, w_acc))


def test_a_window_whose_last_batch_has_no_anchor_keeps_the_gradients_before_it(tiny_salm_dir, tiny_target,
                                                                              speech_batch, tmp_path):
    good = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    no_anchor = chatml_speech_batch(tiny_target, speech_batch, TEXTS)
    no_anchor.loss_mask[:] = False
    one = train(_recipe(tiny_salm_dir, tmp_path / "one", "trainer.max_steps=1", SGD, variant="dflash"),
                lambda run, target: ListDataModule([good], [good]))
    acc = train(_recipe(tiny_salm_dir, tmp_path / "acc", "trainer.max_steps=1", "trainer.accumulate_grad_batches=2",
                        SGD, variant="dflash"),
                lambda run, target: ListDataModule([good, no_anchor], [good]))
    assert acc.steps == 1
    assert _max_diff(load_file(str(one.export_dir / "model.safetensors")),
                     load_file(str(acc.export_dir / "model.safetensors"))) < 1e-6


def test_the_scheduler_steps_on_skipped_steps_too(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    """The LR is a function of global_step: a skipped step advances both."""
    good = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    no_anchor = chatml_speech_batch(tiny_target, speech_batch, TEXTS)
    no_anchor.loss_mask[:] = False
    halve = "dflash.lr_scheduler={_target_:torch.optim.lr_scheduler.StepLR,step_size:1,gamma:0.5}"
    summary = train(_recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=3", "dflash.lr=0.004", halve,
                            "exp_manager.checkpoint_every_n_steps=1", variant="dflash"),
                    lambda run, target: ListDataModule([good, no_anchor, good], [good]))
    assert summary.steps == 3
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 3
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 3
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.004 / 8)


@pytest.mark.parametrize("precision", ["bf16-flash", "bf16-true"])
def test_bf16_training_on_cpu_feeds_attention_one_dtype(tiny_salm_dir, batches, tmp_path, monkeypatch, precision):
    """The BF16 path (target in BF16, draft under autocast or in BF16) runs with sdpa; q, k and v always agree."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        calls.append((query.dtype, key.dtype, value.dtype))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    summary = train(_recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=2", f"trainer.precision={precision}"),
                    _factory(batches))
    assert summary.steps == 2 and summary.export_dir is not None
    assert summary.train_loss is not None and torch.isfinite(torch.tensor(summary.train_loss))
    assert calls and all(q == k == v for q, k, v in calls), set(calls)
    assert {q for q, _, _ in calls} == {torch.bfloat16}


def test_gradient_checkpointing_recomputes_the_draft_layers_and_trains_the_same(tiny_salm_dir, batches, tmp_path,
                                                                                monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    calls = []
    forward = modeling_qwen3.Qwen3MLP.forward

    def counting(self, x):
        calls.append(torch.is_grad_enabled())
        return forward(self, x)

    monkeypatch.setattr(modeling_qwen3.Qwen3MLP, "forward", counting)
    runs = {}
    for checkpointing in (False, True):
        calls.clear()
        summary = train(_recipe(tiny_salm_dir, tmp_path / str(checkpointing), "trainer.max_steps=1", SGD,
                                f"dflash.gradient_checkpointing={checkpointing}", variant="dflash"), _factory(batches))
        runs[checkpointing] = (load_file(str(summary.export_dir / "model.safetensors")), list(calls))
    assert _max_diff(runs[False][0], runs[True][0]) < 1e-6
    # the draft's 2 MLPs run once more each, in backward, when their activations were not kept
    assert len(runs[True][1]) == len(runs[False][1]) + 2, (len(runs[True][1]), len(runs[False][1]))


def test_padding_the_draft_inputs_to_a_multiple_changes_no_loss_or_gradient(tiny_salm_dir, tiny_target, batches):
    """flex runs pad every batch to a multiple of 128 positions; the padding must be inert."""
    from dflash_train.draft import DraftSpec, build_draft
    from dflash_train.training.module import DFlashDraftModule, ModuleSettings, pad_to_multiple

    validated = _recipe(tiny_salm_dir, "unused", variant="dflash2")
    spec = DraftSpec(validated.run.dflash, (1, 3), 320, tiny_target.num_layers)
    torch.manual_seed(0)
    draft = build_draft(tiny_target.llm_config, spec, "sdpa")
    module = DFlashDraftModule(tiny_target, draft, spec, ModuleSettings(layer_ids=[1, 3]))
    inputs = module.prepare(batches[0][0])
    padded = pad_to_multiple(inputs, 128)
    assert inputs.input_ids.shape[1] % 128 and padded.input_ids.shape[1] % 128 == 0
    results = []
    for step_inputs in (inputs, padded):
        draft.zero_grad(set_to_none=True)
        metrics = module.run_core(step_inputs, rng_key=11)
        (metrics.loss * metrics.loss_weight).backward()
        results.append((metrics, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (pad, pad_grads) = results
    assert float(pad.loss_weight) == float(plain.loss_weight) > 0
    assert float(pad.loss) == pytest.approx(float(plain.loss), rel=1e-6)
    worst = max(((pad_grads[n] - plain_grads[n]).abs().max() / plain_grads[n].abs().max().clamp_min(1e-12)).item()
                for n in plain_grads)
    assert worst < 1e-5, worst


def test_rounding_the_anchor_count_up_changes_no_loss_or_gradient(tiny_salm_dir, tiny_target, batches):
    """flex runs round the anchors per batch up to a multiple; the added blocks must be inert."""
    from dflash_train.draft import DraftSpec, build_draft
    from dflash_train.draft.build import anchor_count_multiple
    from dflash_train.training.module import DFlashDraftModule, ModuleSettings

    validated = _recipe(tiny_salm_dir, "unused", variant="dflash2")
    spec = DraftSpec(validated.run.dflash, (1, 3), 320, tiny_target.num_layers)
    torch.manual_seed(0)
    draft = build_draft(tiny_target.llm_config, spec, "sdpa")
    results = []
    for stable in (False, True):
        module = DFlashDraftModule(tiny_target, draft, spec, ModuleSettings(layer_ids=[1, 3], stable_shapes=stable))
        inputs = module.prepare(batches[0][0])
        drawn = []
        sample = module.core._sample_anchor_positions
        module.core._sample_anchor_positions = lambda *a, **k: drawn.append(sample(*a, **k)) or drawn[-1]
        draft.zero_grad(set_to_none=True)
        metrics = module.run_core(inputs, rng_key=11)
        (metrics.loss * metrics.loss_weight).backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results.append((drawn[0], metrics, grads))
    (plain_anchors, plain, plain_grads), (round_anchors, rounded, round_grads) = results
    multiple = anchor_count_multiple(spec.cfg.block_size)
    assert plain_anchors[0].shape[1] % multiple, "the batch must draw a count the rounding changes"
    assert round_anchors[0].shape[1] % multiple == 0 and round_anchors[0].shape[1] > plain_anchors[0].shape[1]
    assert round_anchors[0].shape[1] >= min(2 * multiple, spec.cfg.num_anchors)  # never a single query tile
    width = plain_anchors[0].shape[1]
    assert torch.equal(round_anchors[0][:, :width], plain_anchors[0]) and not round_anchors[1][:, width:].any()
    assert float(rounded.loss_weight) == pytest.approx(float(plain.loss_weight), rel=1e-6) and float(plain.loss_weight) > 0
    assert float(rounded.loss) == pytest.approx(float(plain.loss), rel=1e-6)
    worst = max(((round_grads[n] - plain_grads[n]).abs().max() / plain_grads[n].abs().max().clamp_min(1e-12)).item()
                for n in plain_grads)
    assert worst < 1e-5, worst


def _poison_steps(monkeypatch, steps):
    """Make the loss (hence every gradient) NaN on the training steps ``steps``."""
    from dflash_train.training.module import DFlashDraftModule

    real = DFlashDraftModule.run_core

    def run_core(self, inputs, rng_key, *rest):
        metrics = real(self, inputs, rng_key, *rest)
        if self.training and self.global_step in steps:
            metrics.loss = metrics.loss * float("nan")
        return metrics

    monkeypatch.setattr(DFlashDraftModule, "run_core", run_core)


def test_a_step_with_a_nan_gradient_is_not_applied_and_counted(tiny_salm_dir, batches, tmp_path, monkeypatch):
    one = train(_recipe(tiny_salm_dir, tmp_path / "one", "trainer.max_steps=1", variant="dflash"), _factory(batches))
    _poison_steps(monkeypatch, {1})
    two = train(_recipe(tiny_salm_dir, tmp_path / "two", "trainer.max_steps=2", variant="dflash"), _factory(batches))
    assert two.steps == 2
    rows = _csv_rows(tmp_path / "two")
    assert _series(rows, "train/skipped/nonfinite") == [0.0, 1.0] and _series(rows, "train/dflash_skipped_step") == [0.0, 1.0]
    norms = _series(rows, "train/grad_norm")
    assert norms[0] > 0 and norms[1] != norms[1]  # the poisoned step has no norm (NaN)
    assert same_tensors(load_file(str(two.export_dir / "model.safetensors")),
                        load_file(str(one.export_dir / "model.safetensors")))


def test_too_many_nan_steps_in_a_row_stop_the_run_naming_the_limit(tiny_salm_dir, batches, tmp_path, monkeypatch):
    from dflash_train.errors import NonFiniteTrainingError

    _poison_steps(monkeypatch, {1, 2, 3, 4, 5})
    validated = _recipe(tiny_salm_dir, tmp_path, "dflash.nonfinite_step_limit=2", variant="dflash")
    with pytest.raises(NonFiniteTrainingError, match=r"2 optimizer steps in a row had a NaN or infinite gradient "
                                                     r"\(dflash.nonfinite_step_limit=2\)"):
        train(validated, _factory(batches))


def test_a_wandb_logger_records_the_run_offline(tiny_salm_dir, batches, tmp_path, monkeypatch):
    """exp_manager.create_wandb_logger through Lightning's WandbLogger, offline (no account, no network)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    validated = _recipe(tiny_salm_dir, tmp_path, "trainer.max_steps=2", "trainer.val_check_interval=2",
                        "exp_manager.create_wandb_logger=true",
                        "exp_manager.wandb_logger_kwargs={project: dflash_test, offline: true}", variant="dflash")
    train(validated, _factory(batches))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), "no offline W&B run was written"
    assert _series(_csv_rows(tmp_path), "train/dflash_loss"), "the other loggers still log"


def test_a_logger_whose_package_is_missing_is_named_before_training(tiny_salm_dir, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"exp_manager.create_mlflow_logger=true needs the mlflow package; pip install mlflow"):
        _recipe(tiny_salm_dir, tmp_path, "exp_manager.create_mlflow_logger=true")
