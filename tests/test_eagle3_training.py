"""Training an EAGLE-3 draft (``dflash=eagle3``): the core's alignment and figures against a hand computation,
config rules, resume, the vLLM-format export and its strict reload, and the real CLI on the demo recipe."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from conftest import ResumeComparison, compose, tiny_run_overrides, two_batch_data
from safetensors.torch import load_file
from transformers import LlamaConfig

from dflash_train.config import validate_config
from dflash_train.draft.eagle3 import Eagle3Core, Eagle3Draft
from dflash_train.draft.eagle3_export import load_eagle3_export
from dflash_train.draft.export import DraftExportError, load_export
from dflash_train.errors import ConfigError


def _tiny_draft(vocab: int = 12, draft_vocab: int = 8, hidden: int = 16) -> Eagle3Draft:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=hidden, num_hidden_layers=1,
                         attn_implementation="eager", eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    draft = Eagle3Draft(config).double()
    draft.set_vocab_mapping(torch.arange(draft_vocab))
    for name, param in draft.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(param, std=0.3)
    return draft


def test_the_core_learns_the_next_slots_target_distribution_by_hand():
    """One TTT step, computed slot by slot: slot t reads taps t and token t+1 and learns softmax of the target's
    logits at t+1 over the draft vocabulary, where token t+2 is supervised in t's document and the target's
    top-1 is a draft token; chains count every supervised slot, hits those whose argmax agrees."""
    draft, seq = _tiny_draft(), 10
    head = torch.nn.Linear(16, 12, bias=False).double()
    torch.nn.init.normal_(head.weight, std=2.0)
    core = Eagle3Core(draft, head, ttt_steps=1, audio_frames=(11, 10))
    ids = torch.randint(0, 10, (1, seq))
    ids[0, 1:3] = 11  # two audio frames (the mask token in the module's rows): served as the placeholder 10
    features, teacher = torch.randn(1, seq, 48).double(), torch.randn(1, seq, 16).double()
    loss_mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 0]]).bool()
    doc_remaining = torch.tensor([[8, 7, 6, 5, 4, 3, 2, 1, 0, -1]])
    positions = torch.tensor([list(range(9)) + [0]])
    metrics = core(ids, features, loss_mask.double(), position_ids=positions, doc_remaining=doc_remaining,
                   teacher_hidden=teacher)

    served = torch.where(ids == 11, 10, ids)
    next_ids = torch.cat([served[:, 1:], torch.zeros(1, 1, dtype=torch.long)], dim=1)
    with torch.no_grad():
        out = draft(input_ids=next_ids, projected_hidden_states=draft.project_hidden_states(features),
                    attention_mask=(doc_remaining >= 0).long(), position_ids=positions)
        logits, target = draft.compute_logits(out)[0], head(teacher)[0]
    ces, hits, chains = [], 0, 0
    for t in range(seq - 2):
        if not (loss_mask[0, t + 2] and doc_remaining[0, t] >= 2):
            continue
        chains += 1
        if target[t + 1].argmax() >= 8:  # the target's token is not a draft token: no supervision, a miss
            continue
        probs = target[t + 1, :8].softmax(-1)
        ces.append(-(probs * logits[t].log_softmax(-1)).sum())
        hits += int(logits[t].argmax() == probs.argmax())
    assert chains == 5 and len(ces) >= 2  # slots 2..6 (slot 7's token 9 is unsupervised)
    torch.testing.assert_close(metrics.loss, torch.stack(ces).mean())
    assert metrics.valid_blocks == chains and metrics.loss_weight == chains and metrics.valid_tokens == len(ces)
    assert metrics.accept_len_sum == chains + hits
    torch.testing.assert_close(metrics.accept_len, torch.tensor(1 + hits / chains, dtype=metrics.accept_len.dtype))
    assert metrics.accuracy * len(ces) == hits


def test_deeper_ttt_steps_count_prefix_hits_into_the_accept_length():
    """``accept_len_sum`` is chains + Σ_k chains right through depth k+1: its mean is 1 + the expected greedy
    prefix per chain; the loss backpropagates into the draft and not into the frozen embeddings."""
    draft = _tiny_draft()
    head = torch.nn.Linear(16, 12, bias=False).double()
    core = Eagle3Core(draft, head, ttt_steps=3)
    draft.freeze_embeddings()
    ids = torch.randint(0, 12, (2, 9))
    metrics = core(ids, torch.randn(2, 9, 48).double(), torch.ones(2, 9).double(),
                   position_ids=torch.arange(9).expand(2, 9), doc_remaining=(8 - torch.arange(9)).expand(2, 9),
                   teacher_hidden=torch.randn(2, 9, 16).double())
    assert metrics.step_valid.tolist() == [14, 12, 10]  # slots with token t+2+k in the row, both rows
    assert metrics.accept_len_sum == 14 + metrics.step_prefix_hits.sum()
    metrics.loss.backward()
    assert draft.model.fc.weight.grad.abs().sum() > 0 and draft.model.embed_tokens.weight.grad is None


def test_a_packed_row_trains_as_its_documents_apart():
    """Two documents packed in one row give the loss, chains and prefix hits of the same documents in two
    padded rows: attention, RoPE positions and the TTT chains all stay inside each document."""
    from dflash_train.data.packing import document_layout

    draft = _tiny_draft()
    head = torch.nn.Linear(16, 12, bias=False).double()
    torch.nn.init.normal_(head.weight, std=2.0)
    core = Eagle3Core(draft, head, ttt_steps=3)
    lengths, width = (7, 6), 15
    ids, features = torch.randint(0, 12, (1, width)), torch.randn(1, width, 48).double()
    teacher, loss_mask = torch.randn(1, width, 16).double(), torch.ones(1, width).double()
    loss_mask[0, [0, 7, 13, 14]] = 0  # each document's prompt token, and the padding
    packed = document_layout(torch.tensor([[0] * 7 + [1] * 6 + [-1] * 2]))
    together = core(ids, features, loss_mask, packed.position_ids, packed.seq_lens, packed.doc_remaining,
                    teacher_hidden=teacher)

    rows = torch.tensor([[0] * 7 + [-1] * 8, [0] * 6 + [-1] * 9])
    apart = document_layout(rows)

    def split(x):
        out = torch.zeros((2,) + x.shape[1:], dtype=x.dtype)
        out[0, :7], out[1, :6] = x[0, :7], x[0, 7:13]
        return out

    separate = core(split(ids), split(features), split(loss_mask), apart.position_ids, apart.seq_lens,
                    apart.doc_remaining, teacher_hidden=split(teacher))
    assert together.step_valid.tolist() == separate.step_valid.tolist() == [9, 7, 5]
    assert together.step_prefix_hits.tolist() == separate.step_prefix_hits.tolist()
    torch.testing.assert_close(together.loss, separate.loss)


def _eagle3_recipe(salm_dir, run_dir, *extra):
    overrides = [o for o in tiny_run_overrides(salm_dir) if not o.startswith("dflash.")] + [
        "dflash=eagle3",
        "trainer=cpu",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "+trainer.enable_progress_bar=false",
        "+trainer.enable_model_summary=false",
        "dflash.lr=3e-3",
        "dflash.ttt_steps=3",
        "dflash.draft_vocab_size=64",
        f"exp_manager.explicit_log_dir={run_dir}",
        "exp_manager.create_tensorboard_logger=false",
    ]
    return validate_config(compose("dflash", overrides + list(extra)))


@pytest.mark.parametrize(
    "override, message",
    [
        ("dflash.ttt_steps=0", "dflash.ttt_steps=0 must be >= 1"),
        ("dflash.target_layer_ids=[0,1]", "dflash.target_layer_ids=[0, 1]: EAGLE-3 fuses exactly 3 distinct"),
        ("dflash.block_size=4",
         "dflash.block_size is a DFlash key the eagle3 variant does not use; remove it (override ~dflash.block_size)"),
        ("dflash.target_layer_ids=[2,0,1]", "dflash.target_layer_ids=[2, 0, 1]: list them in ascending order"),
        ("dflash.attention_backend=flex_attention", "dflash.attention_backend=flex_attention: nemo_automodel's EAGLE-3"),
        ("dflash.draft_vocab_size=0", "dflash.draft_vocab_size=0 must be >= 1"),
        ("dflash.draft_vocab_samples=0", "dflash.draft_vocab_samples=0 must be >= 1"),
        ("+dflash.selector_rank=8", "config key 'dflash.selector_rank' belongs to variant dflash2"),
    ],
)
def test_eagle3_config_mistakes_fail_in_one_line(tiny_salm_dir, tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        _eagle3_recipe(tiny_salm_dir, tmp_path / "run", override)
    assert "\n" not in str(err.value)


def test_eagle3_resume_is_exact_and_the_export_is_vllms_eagle3_format(tiny_salm_dir, tiny_target, speech_batch,
                                                                      tmp_path):
    from dflash_train.training.recipe import setup_draft, setup_target, train

    factory = two_batch_data(tiny_target, speech_batch)

    def recipe(run_dir, steps):
        return _eagle3_recipe(tiny_salm_dir, run_dir, f"trainer.max_steps={steps}",
                              "exp_manager.checkpoint_every_n_steps=3")

    runs = ResumeComparison(lambda run_dir, steps: train(recipe(run_dir, steps), factory), tmp_path, 6, 3)
    assert runs.worst() <= 1e-6
    export = runs.straight.export_dir
    weights = load_file(str(export / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["d2t"].shape == (64,) and weights["lm_head.weight"].shape[0] == 64
    assert {"fc.weight", "norm.weight", "layers.0.self_attn.q_proj.weight", "t2d"} <= set(weights)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] == weights["t2d"].shape[0]
    assert len(config["eagle_aux_hidden_state_layer_ids"]) == 3 and config["target_hidden_size"] == config["hidden_size"]
    assert config["training_info"]["variant"] == "eagle3" and config["training_info"]["global_step"] == 6
    reloaded = load_eagle3_export(export)
    assert torch.equal(reloaded.lm_head.weight, weights["lm_head.weight"])

    # warm start: a fresh run seeded with the export starts from its weights; other taps are refused
    warm = _eagle3_recipe(tiny_salm_dir, tmp_path / "warm", f"dflash.init_from_pretrained={export}").run
    target, spec, _ = setup_target(warm)
    seeded = setup_draft(warm, target, spec, "sdpa")
    assert all(torch.equal(seeded.state_dict()["model." + k if not k.startswith(("lm_head", "d2t", "t2d")) else k], v)
               for k, v in weights.items())
    taps = [t - 1 for t in config["eagle_aux_hidden_state_layer_ids"]]
    other = sorted({0, 1, 2, 3} - set(taps))[:1] + taps[1:]
    wrong = _eagle3_recipe(tiny_salm_dir, tmp_path / "warm", f"dflash.init_from_pretrained={export}",
                           f"dflash.target_layer_ids=[{','.join(map(str, other))}]").run
    target, spec, _ = setup_target(wrong)
    with pytest.raises(ConfigError, match=re.escape(f"dflash.init_from_pretrained tapped target blocks {taps}")):
        setup_draft(wrong, target, spec, "sdpa")


def _supervised_counts(cuts_path, tokenizer) -> Counter:
    """Token counts of the answers in a cut manifest, tokenized here (each answer text and its end of turn)."""
    from lhotse import CutSet

    end = tokenizer.token_to_id("<|im_end|>")
    counts = Counter()
    for cut in CutSet.from_file(cuts_path):
        for supervision in cut.supervisions:
            counts.update(tokenizer.text_to_ids(supervision.text) + [end])
    return counts


def test_the_cli_trains_an_eagle3_draft_on_the_demo_recipe(tiny_salm_dir, tiny_target, demo_data, tmp_path):
    """The user's path: ``dflash-train --config-name=demo dflash=eagle3``, then ``dflash-eval --draft`` on the
    export. The end-of-run summary names the eagle3 serve line; the export reloads strictly; its draft
    vocabulary is the training answers' most frequent tokens (the end of turn among them), covering more of
    them than any other choice of its size; and the reference decoder decodes the export greedy-equal, at
    the MAL serving validation reported for the same step and records."""
    train_cuts, val_cuts = demo_data
    run_dir = tmp_path / "run"
    args = [
        "--config-name=demo", "dflash=eagle3", f"model.pretrained_name={tiny_salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}", f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20", "trainer.max_steps=4", "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1", "dflash.ttt_steps=3", "dflash.draft_vocab_size=24",
        "dflash.serving_val_samples=3", "dflash.serving_val_max_new_tokens=16",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]
    proc = subprocess.run([sys.executable, "-m", "dflash_train", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    export = run_dir / "export"
    assert f'"method": "eagle3", "model": "{export.resolve()}", "num_speculative_tokens": 3' in out, out[-3000:]
    draft = load_eagle3_export(export)
    with pytest.raises(DraftExportError, match="holds a draft of variant eagle3; this loader takes dflash and dflash2"):
        load_export(export)  # the block loader: one line, no traceback
    chosen = (torch.arange(24) + draft.d2t).tolist()
    counts = _supervised_counts(train_cuts, tiny_target.tokenizer)
    best = sum(count for _, count in counts.most_common(24))
    assert tiny_target.tokenizer.token_to_id("<|im_end|>") in chosen
    assert sum(counts[t] for t in chosen) >= 0.95 * best > 1.5 * sum(counts[t] for t in range(24)), (chosen, counts)
    losses = [float(x) for x in re.findall(r"final train loss ([0-9.]+)", out)]
    assert losses and all(l == l for l in losses), out[-3000:]
    report = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train.cli.eval", "--config-name=demo", "--draft", str(export), "--limit", "3",
         "--max-new-tokens", "16", "--json", str(report), f"model.pretrained_name={tiny_salm_dir}",
         f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(report.read_text())
    assert data["settings"]["num_speculative_tokens"] == 3  # the export's ttt_steps
    evaluated = data["drafts"]["draft"]
    assert evaluated["greedy_equal"] and evaluated["acceptance"]["rounds"] > 0, evaluated
    info = json.loads((export / "config.json").read_text())["training_info"]
    assert info["val_step"] == 4
    assert evaluated["acceptance"]["mal"] == pytest.approx(info["val_serving_mal"], abs=1e-9), (evaluated, info)
