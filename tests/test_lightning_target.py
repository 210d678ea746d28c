"""Nemotron 3.5 Lightning's structure at tiny width (``python -m dflash_train.testing.tiny_mtp_salm --preset
lightning``) end to end on CPU: the 52-block Mamba-2/MoE/attention pattern, top-6 routing plus a shared expert,
2 KV heads, MTP heads in the checkpoint, encoder chunks and the ``nemotron-nano-v3`` prompt format; the runbook's
taps [1, 5, 19, 29, 41, 51] are those blocks' outputs; DFlash2 trains through ``torchrun`` on two gloo ranks
sharing the experts (``trainer.strategy.ep_size=2``), MTP heads through ``python -m dflash_train`` and resume
exactly; both exports reload strictly and ``dflash-eval`` decodes greedy-equal with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Launch, compose, free_port, rank_log_lines, run_launcher, worst_difference
from safetensors.torch import load_file
from test_multiprocess_cli import _launch_command

from dflash_train.config import validate_config
from dflash_train.errors import ConfigError
from dflash_train.testing.tiny_mtp_salm import LIGHTNING_PATTERN, LIGHTNING_TAPS

BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
TAPS = "dflash.target_layer_ids=[1,5,19,29,41,51]"
SERVING = ["dflash.serving_val_samples=1", "dflash.serving_val_max_new_tokens=8"]  # one record: Mamba decodes slowly


@pytest.fixture(scope="module")
def lightning_dir(tmp_path_factory) -> Path:
    """The Lightning-shaped SpeechLM, written by the builder's command line."""
    from dflash_train.testing.tiny_mtp_salm import main

    out = tmp_path_factory.mktemp("lightning") / "target"
    assert main(["--out", str(out), "--preset", "lightning"]) == 0
    return out


@pytest.fixture(scope="module")
def lightning_target(lightning_dir):
    from dflash_train.config.schema import ModelConfig
    from dflash_train.target import open_speech_target

    return open_speech_target(ModelConfig(pretrained_name=str(lightning_dir)))


def _run(lightning_dir, demo_data, *extra: str):
    train_cuts, val_cuts = demo_data
    return validate_config(compose("demo", [
        "model=salm_automodel", f"model.pretrained_name={lightning_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}", f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        *extra,
    ])).run


def test_the_preset_writes_lightnings_blocks_experts_heads_prompt_and_encoder_chunks(lightning_dir, lightning_target,
                                                                                     speech_batch):
    from dflash_train.data.estimator import AudioTokenEstimator

    backbone = json.loads((lightning_dir / "llm_backbone" / "config.json").read_text())
    kinds = "".join({"linear_attention": "M", "moe": "E", "full_attention": "*"}[k]
                    for k in backbone["layers_block_type"])
    assert kinds == LIGHTNING_PATTERN and len(kinds) == 52
    assert (kinds.count("M"), kinds.count("E"), kinds.count("*")) == (23, 23, 6)
    assert (backbone["n_routed_experts"], backbone["num_experts_per_tok"], backbone["n_shared_experts"]) == (8, 6, 1)
    assert (backbone["num_attention_heads"], backbone["num_key_value_heads"]) == (8, 2)
    config = json.loads((lightning_dir / "config.json").read_text())
    assert config["prompt_format"] == "nemotron-nano-v3"
    assert config["mtp"] == {"enabled": True, "num_nextn_predict_layers": 2, "use_repeated_layer": True,
                             "hybrid_override_pattern": "*"}
    weights = load_file(str(lightning_dir / "model.safetensors"))
    assert any(name.startswith("llm.mtp.layers.0.") for name in weights)
    assert any(name.endswith("mixer._fp32_params.A_log") for name in weights)  # SALMAutomodel's native names
    assert lightning_target.num_layers == 52
    # encoder chunks: the longest utterance is encoded in 1 s chunks, and the data loader's estimate agrees
    audios, lens = speech_batch
    longest = int(lens.argmax())
    samples = int(lens[longest])
    estimator = AudioTokenEstimator.from_target(lightning_target)
    assert lightning_target.encoder_chunk_size_seconds == 1.0 and len(estimator.chunk_spans(samples)) > 1
    encoded = lightning_target.encode_audio(audios[longest:longest + 1, :samples], lens[longest:longest + 1])
    assert encoded[0].shape[0] == estimator.frames(samples)


def _moe_reference(weights: dict, block: int, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE block's output on tokens ``x`` computed here from the checkpoint (native names): sigmoid router,
    the ``top_k`` best experts weighted by their normalised scores, relu² experts; and the shared expert's part."""
    prefix = f"llm.model.layers.{block}.mixer."
    scores = torch.sigmoid(x @ weights[prefix + "gate.weight"].T)
    chosen = torch.topk(scores + weights[prefix + "gate.e_score_correction_bias"], top_k, dim=-1).indices
    gate = scores.gather(1, chosen)
    gate = gate / gate.sum(-1, keepdim=True)
    up, down = weights[prefix + "experts.gate_and_up_projs"], weights[prefix + "experts.down_projs"]  # [E,H,I], [E,I,H]
    routed = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(top_k):
            e = int(chosen[token, slot])
            routed[token] += gate[token, slot] * torch.relu(x[token] @ up[e]).square() @ down[e]
    shared = torch.relu(x @ weights[prefix + "shared_experts.up_proj.weight"].T).square()
    return routed, shared @ weights[prefix + "shared_experts.down_proj.weight"].T


def test_every_moe_block_routes_each_token_to_six_of_eight_experts_plus_the_shared_one(lightning_dir, lightning_target):
    """The loaded blocks compute top-6 routing plus the shared expert, as computed here from the checkpoint; both
    parts matter (top-8 or no shared expert is far from the block's output)."""
    weights = load_file(str(lightning_dir / "model.safetensors"))
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    blocks = [i for i, kind in enumerate(LIGHTNING_PATTERN) if kind == "E"]
    assert len(blocks) == 23
    for block in blocks:
        with torch.no_grad():
            ours = lightning_target.llm.model.layers[block].mixer(x[None])[0]
        routed, shared = _moe_reference(weights, block, x, top_k=6)
        every, _ = _moe_reference(weights, block, x, top_k=8)
        scale = ours.abs().max().item()
        assert (ours - routed - shared).abs().max().item() <= 1e-5 * scale, f"block {block}"
        assert (routed - every).abs().max().item() > 0.01 * scale, f"block {block}: top-6 routes like top-8"
        assert shared.abs().max().item() > 0.05 * scale, f"block {block}: the shared expert does nothing"


def test_the_runbooks_taps_are_the_outputs_of_blocks_1_5_19_29_41_51(lightning_dir, lightning_target, demo_data):
    from dflash_train.target.load import check_target_for_run

    run = _run(lightning_dir, demo_data, "dflash=dflash2", TAPS)
    assert run.data.prompt_format == "nemotron_nano_v3"
    assert check_target_for_run(run) == list(LIGHTNING_TAPS)
    with pytest.raises(ConfigError) as err:
        check_target_for_run(_run(lightning_dir, demo_data, "dflash=dflash2", "dflash.target_layer_ids=[1,5,52]"))
    assert "[52] outside the target's 52 decoder blocks" in str(err.value) and "\n" not in str(err.value)

    llm = lightning_target.llm
    embeds = llm.get_input_embeddings()(torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        taps = lightning_target.forward_taps(embeds, None, LIGHTNING_TAPS).features
        hidden = llm(inputs_embeds=embeds, output_hidden_states=True).hidden_states  # [i + 1]: block i; last normed
    assert taps.shape == (1, 24, 6 * 64)
    expected = [hidden[i + 1] for i in LIGHTNING_TAPS[:-1]]
    for tap, (i, want) in enumerate(zip(LIGHTNING_TAPS, expected)):
        assert torch.equal(taps[..., tap * 64:(tap + 1) * 64], want), f"tap of block {i}"
    with torch.no_grad():
        assert torch.allclose(llm.model.norm_f(taps[..., 5 * 64:]), hidden[-1], atol=1e-6), "tap of block 51"


@pytest.fixture(scope="module")
def dflash2_run(lightning_dir, demo_data, tmp_path_factory) -> Path:
    """The runbook's launch (``torchrun scripts/dflash_train.py``, the recipe's FSDP2 + DFlash2 + BF16 defaults)
    with the runbook's taps and the experts shared by two gloo ranks; 2 steps, serving validation at each."""
    train, val = demo_data
    root = tmp_path_factory.mktemp("lightning_dflash2")
    command = _launch_command(
        lightning_dir, root / "run", root / "exp", train, val,
        "model=salm_automodel", "trainer.strategy.ep_size=2", TAPS, "trainer.max_steps=2",
        "trainer.val_check_interval=1", "dflash.selector_rank=16", "dflash.selector_top_k=8", *SERVING,
    )
    proc = run_launcher(command, ENV, 900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root / "run"


def test_dflash2_with_the_runbooks_taps_trains_on_two_ranks_sharing_the_experts(dflash2_run, lightning_target):
    from dflash_train.evaluate.loading import load_draft

    sharded = rank_log_lines(dflash2_run, "target experts: 23 MoE blocks sharded over 2 ranks")
    assert [len(sharded.get(rank, [])) for rank in (0, 1)] == [1, 1]
    logged = (dflash2_run / "csv" / "metrics.csv").read_text().splitlines()
    header = logged[0].split(",")
    served = [row.split(",")[header.index("val/serving_rounds")] for row in logged[1:]]
    assert sum(1 for value in served if value and float(value) > 0) == 2  # each validation decoded its record
    draft = load_draft(str(dflash2_run / "export"), lightning_target, "cpu", "float32")  # strict
    assert list(draft.target_layer_ids) == list(LIGHTNING_TAPS)


def _start_cli(lightning_dir, demo_data, run_dir: Path, *extra: str) -> Launch:
    """``python -m dflash_train`` on the Lightning target, started; a rendezvous port of its own, for launches side
    by side."""
    train, val = demo_data
    return Launch(
        [sys.executable, "-m", "dflash_train", "--config-name=demo", "model=salm_automodel",
         f"model.pretrained_name={lightning_dir}", f"data.train_ds.input_cfg.0.cuts_path={train}",
         f"data.validation_ds.input_cfg.0.cuts_path={val}", "data.train_ds.bucket_estimate_samples=20",
         "trainer.precision=32-true", "trainer.limit_val_batches=1", "trainer.val_check_interval=2",
         "exp_manager.checkpoint_every_n_steps=2", "exp_manager.resume_if_exists=true",
         "+trainer.enable_progress_bar=false", f"exp_manager.explicit_log_dir={run_dir}", *SERVING, *extra],
        dict(ENV, MASTER_PORT=str(free_port())),
    )


def _finish_cli(launch: Launch) -> None:
    proc = launch.finish(900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


@pytest.fixture(scope="module")
def mtp_runs(lightning_dir, demo_data, tmp_path_factory) -> dict[str, Path]:
    """MTP heads through ``python -m dflash_train``: 4 steps straight, and beside it (one process each) 2 steps
    then resumed to 4."""
    root = tmp_path_factory.mktemp("lightning_mtp")
    runs = {"straight": root / "straight", "resumed": root / "resumed"}
    with _start_cli(lightning_dir, demo_data, runs["straight"], "dflash=mtp", "trainer.max_steps=4") as straight:
        _finish_cli(_start_cli(lightning_dir, demo_data, runs["resumed"], "dflash=mtp", "trainer.max_steps=2"))
        runs["at_stop"] = root / "at_stop.safetensors"
        runs["at_stop"].write_bytes((runs["resumed"] / "export" / "model.safetensors").read_bytes())
        _finish_cli(_start_cli(lightning_dir, demo_data, runs["resumed"], "dflash=mtp", "trainer.max_steps=4"))
        _finish_cli(straight)
    return runs


def test_mtp_heads_train_through_the_cli_resume_exactly_and_reload_strictly(mtp_runs, lightning_target):
    from dflash_train.evaluate.loading import load_mtp_heads

    def heads(path) -> dict:
        return {k: v for k, v in load_file(str(path)).items() if k.startswith("llm.mtp.")}

    logged = (mtp_runs["resumed"] / "csv" / "metrics.csv").read_text().splitlines()
    starts = [row.split(",")[logged[0].split(",").index("launch/start_step")] for row in logged[1:]]
    assert [float(value) for value in starts if value] == [2.0], "the second launch did not resume at step 2"
    straight, resumed = (heads(mtp_runs[k] / "export" / "model.safetensors") for k in ("straight", "resumed"))
    at_stop = heads(mtp_runs["at_stop"])
    assert straight and straight.keys() == resumed.keys()
    assert any(not torch.equal(straight[k], at_stop[k]) for k in straight), "the resumed steps did not train"
    worst = worst_difference(resumed, straight)
    assert worst <= 1e-6, f"resumed MTP heads differ from 4 straight steps by {worst}"
    _, count = load_mtp_heads(str(mtp_runs["straight"] / "export"), lightning_target, "cpu", "float32")
    assert count == 2


def test_dflash_eval_decodes_greedy_equal_with_both_exports(dflash2_run, mtp_runs, demo_data, tmp_path):
    """One ``dflash-eval`` on the MTP export (the target with its trained heads) with the DFlash2 draft beside."""
    report = tmp_path / "eval.json"
    proc = subprocess.run(
        [str(BIN / "dflash-eval"), "--target", str(mtp_runs["straight"] / "export"), "--mtp",
         "--draft", str(dflash2_run / "export"), "--cuts", str(demo_data[1]), "--limit", "1",
         "--max-new-tokens", "12", "-k", "2", "--prompt-format", "nemotron_nano_v3", "--json", str(report)],
        env=ENV, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    evaluated = json.loads(report.read_text())
    results = evaluated["drafts"]
    assert len(results) == 2
    # a target repeating one token would make greedy equality hold without any rollback of rejected proposals
    assert len(set(evaluated["samples"][0]["target"]["token_ids"])) > 2, "a degenerate target decode"
    for name, result in results.items():
        assert result["greedy_equal"] and result["acceptance"]["rounds"] > 0, name
