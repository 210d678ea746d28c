"""dflash-plan (dflash_train/plan/, dflash_train/cli/plan.py): the plan is checked, not trusted.

* its memory breakdown on fake tensors equals, category by category, the same step run for real on
  CPU with the module's own anchor draw (measured: identical to the byte), and its fixed categories
  equal the tensors' own sizes;
* the target's FLOPs equal the written transformer formula;
* one knob at a time moves the figures it should, in the right direction and by about the right size;
* DFlash and MTP plan as DFlash2 does; a run that does not fit gets the knob values that fit;
* the command plans a checkpoint whose weights file is absent, and refuses bad input in one line.

Every plan runs the tiny SALM (tests/conftest.py) at a small batch: a plan takes a few seconds on CPU.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import compose, load_salm_target, tiny_run_overrides

GIB = 2**30


def _overrides(salm_dir, run_dir, *extra: str) -> list[str]:
    """The recipe on the tiny SALM with a small worst batch: 2 rows of 256 positions, 5 s of audio each."""
    return [*tiny_run_overrides(salm_dir), f"exp_manager.explicit_log_dir={run_dir}",
            "data.train_ds.batch_tokens=512", "data.train_ds.max_tokens=256", "data.train_ds.max_duration=5",
            "dflash.num_anchors=64", *extra]


def _validated(salm_dir, run_dir, *extra: str):
    from dflash_train.config import validate_config

    return validate_config(compose("dflash", _overrides(salm_dir, run_dir, *extra)))


def _plan(salm_dir, run_dir, *extra: str, world: int = 2):
    from dflash_train.plan import plan_run

    return plan_run(_validated(salm_dir, run_dir, "trainer.strategy.name=fsdp2", *extra), "h100", world)


@pytest.fixture(scope="module")
def base_plan(tiny_salm_dir, tmp_path_factory):
    return _plan(tiny_salm_dir, tmp_path_factory.mktemp("plan_run"))


def _rounded_bytes(tensors) -> int:
    from dflash_train.plan.memory import BLOCK

    return sum(-(-t.untyped_storage().nbytes() // BLOCK) * BLOCK for t in tensors)


@pytest.mark.parametrize("world, strategy, family", [(1, "auto", "dflash2"), (2, "fsdp2", "dflash2"),
                                                     (2, "fsdp2", "eagle3")])
def test_plan_matches_the_real_step_on_cpu(world, strategy, family, tiny_salm_dir, tmp_path):
    """Fake and real steps, same recipe (one rank; two FSDP2 ranks, of which the real step runs rank 0 over the
    fake process group), every category within 1 % (measured: equal at one rank, 512 bytes apart of 64 MB at
    two); the real one draws its anchors with the module's own draw, the plan with its worst-case stand-in.
    EAGLE-3 (no anchors; its rotary table sized by the plan, read from the positions by the real step) too.

    The real step gets a freshly loaded target, as a launch does: the session's shared one may have grown its
    Conformer positional tables on another test's long audio (NeMo extends them in place)."""
    from dflash_train.plan import measure_step, plan_run
    from dflash_train.plan.fake import build_run, fake_world
    from dflash_train.target.load import check_target_for_run

    validated = _validated(tiny_salm_dir, tmp_path, f"trainer.strategy.name={strategy}", f"dflash={family}")
    plan = plan_run(validated, "h100", world)
    run, trainer_kwargs = validated
    with fake_world(world) as mesh:
        real = build_run(run, trainer_kwargs, check_target_for_run(run, world), mesh,
                         target=load_salm_target(tiny_salm_dir),
                         worst_anchors=False)
        memory = measure_step(real, world, None)
    module = real.module
    assert plan.memory_peak_bytes.keys() == memory.peak.keys()
    for category, measured in memory.peak.items():
        assert plan.memory_peak_bytes[category] == pytest.approx(measured, rel=0.01), category
    assert plan.peak_bytes == pytest.approx(sum(memory.peak.values()), rel=0.01)
    # the fixed categories are the tensors' own sizes: nothing double-counted, nothing left out
    target_tensors = list(module.target.parameters()) + list(module.target.buffers())
    assert plan.memory_peak_bytes["target_weights"] == _rounded_bytes(target_tensors)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.draft.parameters()]
    assert plan.memory_peak_bytes["draft_params"] == _rounded_bytes(local)
    trained = _rounded_bytes(p for p in local if p.requires_grad)  # EAGLE-3's copied embeddings are frozen
    assert 2 * trained <= plan.memory_peak_bytes["optimizer_state"] <= 2 * trained + 2**20  # AdamW's 2 moments
    assert plan.memory_peak_bytes["draft_activations"] > 0
    # the block drafts' chunked LM head + loss is its own phase; EAGLE-3's logits are its draft's forward
    assert (plan.memory_peak_bytes["loss_chunks"] > 0) == (family != "eagle3")


def test_target_flops_follow_the_transformer_formula(base_plan, tiny_salm_dir):
    """Target phase = 2·N·(layer matmul weights) + SDPA's 4·B·H·S²·d per layer + the label head on the supervised
    positions; exact up to 1 %."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_salm_dir / "llm_backbone")
    d, heads, kv, hd, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    rows, seq = base_plan.batch_rows, base_plan.row_positions
    layer_weights = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * inter
    linear = 2 * rows * seq * c.num_hidden_layers * layer_weights
    attention = 4 * rows * heads * seq * seq * hd * c.num_hidden_layers
    labels = 2 * base_plan.supervised_tokens * d * c.vocab_size  # the label head runs on supervised positions only
    assert base_plan.flops["target"] == pytest.approx(linear + attention + labels, rel=0.01)
    assert base_plan.flops["backward"] > base_plan.flops["draft_forward"]  # about twice the differentiated forward


def test_one_knob_at_a_time(base_plan, tiny_salm_dir, tmp_path):
    """Each knob moves what it should: anchors and batch_tokens grow the draft's activations (about in
    proportion), more ranks shrink the sharded state, a smaller loss chunk shrinks the loss buffers,
    checkpointing shrinks the activations; nothing else moves the wrong way."""
    base = base_plan.memory_peak_bytes
    anchors = _plan(tiny_salm_dir, tmp_path, "dflash.num_anchors=128").memory_peak_bytes
    assert 1.6 < anchors["draft_activations"] / base["draft_activations"] < 2.2
    tokens = _plan(tiny_salm_dir, tmp_path, "data.train_ds.batch_tokens=1024")
    assert tokens.batch_rows == 2 * base_plan.batch_rows
    assert 1.6 < tokens.memory_peak_bytes["draft_activations"] / base["draft_activations"] < 2.2
    assert 1.6 < tokens.flops["target"] / base_plan.flops["target"] < 2.2
    wider = _plan(tiny_salm_dir, tmp_path, world=4)
    assert 0.4 < wider.memory_peak_bytes["draft_params"] / base["draft_params"] < 0.65
    assert 0.4 < wider.memory_peak_bytes["optimizer_state"] / base["optimizer_state"] < 0.65
    assert wider.memory_peak_bytes["target_weights"] == base["target_weights"]
    chunk = _plan(tiny_salm_dir, tmp_path, "dflash.loss_chunk_size=64").memory_high_water_bytes
    assert chunk["loss_chunks"] < 0.6 * base_plan.memory_high_water_bytes["loss_chunks"]
    checkpointed = _plan(tiny_salm_dir, tmp_path, "dflash.gradient_checkpointing=true")
    assert checkpointed.memory_peak_bytes["draft_activations"] < 0.8 * base["draft_activations"]
    assert checkpointed.flops["backward"] > base_plan.flops["backward"]  # the forward runs again


@pytest.mark.parametrize("variant", ["dflash", "mtp"])
def test_every_variant_plans(variant, tiny_salm_dir, tmp_path):
    """DFlash and MTP plan too (DFlash2 is the recipe's default, planned above): their own anchor draws are
    replaced, the draft's memory and FLOPs are there, and each one's chunked LM head and loss are their own
    phase (the LM head's 2·V·H FLOPs per supervised position, forward)."""
    plan = _plan(tiny_salm_dir, tmp_path, f"dflash={variant}")
    assert plan.variant == variant
    assert plan.memory_peak_bytes["draft_params"] > 0 and plan.memory_peak_bytes["draft_activations"] > 0
    assert plan.flops["draft_forward"] > 0 and plan.flops["backward"] > 0 and plan.flops["loss"] > 0


def test_cli_plans_a_checkpoint_without_its_weights(tiny_salm_dir, tmp_path, capsys):
    from dflash_train.cli.plan import main

    target = tmp_path / "config_only"
    shutil.copytree(tiny_salm_dir, target, ignore=shutil.ignore_patterns("model.safetensors"))
    cuts = tmp_path / "cuts.jsonl"
    cuts.write_text('{"id": "utt-1"}\n')  # the launch's check reads no record
    out = tmp_path / "plan.json"
    overrides = [o for o in _overrides(target, tmp_path / "run") if not o.startswith("data.train_ds.input_cfg")]
    code = main(["--gpu", "h200", "--gpus-per-node", "2", "--nodes", "1", "--json", str(out),
                 f"data.train_ds.input_cfg=[{{type: lhotse_as_conversation, cuts_path: {cuts}}}]", *overrides])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fits" in printed and "bound (not a measurement)" in printed
    plan = json.loads(out.read_text())
    assert plan["world_size"] == 2 and plan["fits"] and plan["gpu"] == "h200"
    assert plan["needed_bytes"] == plan["peak_bytes"] + plan["allowance_bytes"]
    assert set(plan["flops"]) >= {"perception", "target", "draft_forward", "loss", "backward"}


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h100", "--gpus-per-node", "0"], "--gpus-per-node=0"),
    (["--gpu", "h100", "dflash.num_anchor=3"], "did you mean 'num_anchors'"),
    (["--gpu", "h100", "--config-dir", "/nonexistent"], "--config-dir=/nonexistent is not a directory"),
])
def test_bad_input_is_one_line_before_any_build(argv, message, capsys):
    from dflash_train.cli.plan import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-plan: error:") and message in err[0]


def test_fit_advice_names_the_first_value_of_each_knob_that_fits(base_plan):
    """A plan over the GPU's memory gets, per knob, the first halving that fits (planned by ``plan_with``);
    a fitting plan gets none."""
    from dataclasses import replace

    from dflash_train.plan.advice import fit_advice

    over = replace(base_plan, gpu_figures={**base_plan.gpu_figures, "memory_bytes": base_plan.needed_bytes - 1},
                   knobs={**base_plan.knobs, "num_anchors": 512, "batch_tokens": 4096, "gradient_checkpointing": False})
    fitting = {"dflash.num_anchors=128", "data.train_ds.batch_tokens=2048", "dflash.gradient_checkpointing=true"}
    tried = []

    def plan_with(override):
        tried.append(override)
        return base_plan if override in fitting else over

    advice = fit_advice(over, plan_with)
    assert [line.split(" ")[0] for line in advice] == ["dflash.num_anchors=128", "data.train_ds.batch_tokens=2048",
                                                       "dflash.gradient_checkpointing=true"]
    assert "dflash.num_anchors=64" not in tried  # a knob stops at its first fitting value
    assert fit_advice(base_plan, plan_with) == []


def _nemotron_h_plan(target_dir, run_dir, world: int, *extra: str, gpus_per_node: int = 8):
    from dflash_train.config import validate_config
    from dflash_train.plan import plan_run

    overrides = ["model=salm_automodel", *_overrides(target_dir, run_dir), "trainer.precision=bf16-flash",
                 "trainer.strategy.name=fsdp2", *extra]
    return plan_run(validate_config(compose("dflash", overrides)), "h100", world, gpus_per_node)


def _config_only(target_dir, tmp_path):
    copy = tmp_path / "config_only"
    shutil.copytree(target_dir, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    return copy


def test_expert_parallel_nemotron_h_target_plans_each_rank_with_its_share_of_the_experts(tiny_hybrid_dir, tmp_path):
    """The tiny Nemotron-H SpeechLM (Mamba-2, attention, MLP and 2 MoE blocks of 4 experts, top-2), its weights
    file removed, plans in BF16 without and with ``ep_size=2`` over 2 ranks. Against the backbone's config:

    * a rank holds half of every MoE block's routed experts: target weights lower by exactly half the experts'
      bytes (measured 65,536 B; a DTensor counted whole would show no difference);
    * the target's FLOPs are equal (the plan routes evenly: a rank's expert work is the mean of any routing;
      without EP, HF's grouped expert matmul is counted, which torch's FLOP table leaves out);
    * each MoE block all-reduces the group's ``ep_size × tokens × hidden`` FP32 outputs and all-gathers the
      group's activations (BF16), routing weights (FP32), expert ids (int64) and token mask."""
    target = _config_only(tiny_hybrid_dir, tmp_path)
    whole = _nemotron_h_plan(target, tmp_path / "run", 2)
    sharded = _nemotron_h_plan(target, tmp_path / "run", 2, "trainer.strategy.ep_size=2")
    llm = json.loads((target / "llm_backbone" / "config.json").read_text())
    blocks = llm["layers_block_type"].count("moe")
    hidden, inter, top_k = llm["hidden_size"], llm["moe_intermediate_size"], llm["num_experts_per_tok"]
    expert_bytes = blocks * llm["n_routed_experts"] * 2 * hidden * inter * 2
    assert whole.memory_peak_bytes["target_weights"] - sharded.memory_peak_bytes["target_weights"] == expert_bytes // 2
    assert whole.flops["target"] > 0 and sharded.flops["target"] == whole.flops["target"]
    gathered = 2 * sharded.batch_rows * sharded.row_positions  # the group's tokens
    added = {kind: sharded.collective_bytes.get(kind, 0) - whole.collective_bytes.get(kind, 0)
             for kind in ("all_reduce", "all_gather")}
    assert added == {"all_reduce": blocks * gathered * hidden * 4,
                     "all_gather": blocks * gathered * (hidden * 2 + top_k * 4 + top_k * 8 + 1)}
    assert whole.memory_peak_bytes["draft_activations"] > 0


def test_the_lightning_shaped_target_plans_with_encoder_chunks_and_expert_parallelism(tmp_path):
    """Nemotron 3.5 Lightning's structure (52 blocks: 23 Mamba-2, 23 MoE of 8 experts top-6, 6 attention; audio
    encoded in 1 s chunks; the runbook's six taps) plans at ``ep_size`` 2 over 4 ranks. Before, encoding in chunks
    read the perception's length of every chunk back to the host (NeMo's unpadding), which the plan could not run
    and a GPU step pays as a sync per chunk."""
    from dflash_train.testing.tiny_mtp_salm import LIGHTNING, LIGHTNING_TAPS, build_tiny_mtp_salm

    target = build_tiny_mtp_salm(tmp_path / "lightning", LIGHTNING)
    (target / "model.safetensors").unlink()
    taps = ",".join(map(str, LIGHTNING_TAPS))
    plan = _nemotron_h_plan(target, tmp_path / "run", 4, "trainer.strategy.ep_size=2",
                            f"dflash.target_layer_ids=[{taps}]", "dflash.draft_num_hidden_layers=6", gpus_per_node=2)
    assert plan.row_positions > 0 and plan.flops["perception"] > 0 and plan.flops["target"] > 0
    assert plan.collective_bytes["all_reduce"] > 0 and plan.memory_peak_bytes["draft_activations"] > 0
    # the experts' traffic runs inside each expert group of 2 consecutive ranks (one node: NVLink), the draft's
    # FSDP2 traffic over all 4 ranks (two nodes: the network); before, all of it was charged to the network
    from dflash_train.plan import GPUS

    groups, h100 = plan.collective_group_bytes, GPUS["h100"]
    assert set(groups) == {"2", "4"} and groups["2"] >= plan.collective_bytes["all_reduce"]
    assert plan.collective_seconds == pytest.approx(
        groups["2"] / 2 / h100.nvlink_bytes_per_s + groups["4"] * 3 / 4 / h100.network_bytes_per_s)


def test_the_demo_recipe_plans(tiny_salm_dir, tmp_path):
    """The demo recipe (DFlash, 32 anchors, rows of 160 positions, one CPU rank over DDP) plans as composed, on
    the tiny SALM: its ``max_duration`` (6 s, above every demo utterance) sizes the worst batch (the default 30 s
    is more positions than its rows hold): the shape dflash-smoke's plan column plans on a GPU."""
    from dflash_train.config import validate_config
    from dflash_train.plan import plan_run

    overrides = [f"model.pretrained_name={tiny_salm_dir}", "data.train_ds.input_cfg=[]",
                 f"exp_manager.explicit_log_dir={tmp_path / 'run'}"]
    plan = plan_run(validate_config(compose("demo", overrides)), "h100", 1, gpus_per_node=1)
    assert (plan.variant, plan.num_anchors, plan.knobs["strategy"]) == ("dflash", 32, "ddp")
    assert plan.batch_rows == 1024 // 160  # the demo's batch_tokens over its max_tokens
    assert plan.memory_peak_bytes["draft_activations"] > 0 and plan.flops["loss"] > 0
