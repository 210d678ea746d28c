"""Expert parallelism of a frozen Nemotron-H target (``trainer.strategy.ep_size``): two gloo ranks share its
routed experts (nemo_automodel's ``GroupedExperts`` under its ``ExpertParallel`` style, the torch
dispatcher) and compute what the whole target computes; ranks that decode different numbers of
requests stay in step; a run trains as it does with whole experts on every rank."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import compose, rank_log_lines, run_launcher, tiny_run_overrides, worst_difference
from safetensors.torch import load_file
from test_multiprocess_cli import _launch_command

from dflash_train.config import validate_config
from dflash_train.errors import ConfigError
from dflash_train.target.expert_parallel import expert_parallel_problem
from dflash_train.target.salm import llm_config_for

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def _torchrun(script: str, *args, timeout: int = 600) -> None:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--standalone", str(HERE / script), *map(str, args)]
    proc = run_launcher(cmd, ENV, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_sharded_experts_compute_the_whole_targets_taps_and_decodes(tiny_hybrid_dir, tmp_path):
    """Different token counts per rank; rank 1 decodes three requests while rank 0 decodes one (a hang
    without the lockstep: the launcher's timeout fails the test)."""
    _torchrun("expert_parallel_worker.py", tmp_path, tiny_hybrid_dir, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        print(f"rank {rank}: taps differ by {result['tap_difference']:.3g} (scale {result['tap_scale']:.3g}), "
              f"final hidden by {result['hidden_difference']:.3g}; idle forwards {result['idle_forwards']}")
        assert result["local_experts"] == 2  # 4 experts over 2 ranks
        # FP32 summation order only (the routing weight applied before the down projection, outputs summed
        # over ranks): a wrong layout or a missing rank's experts moves the taps by the tap scale
        assert result["tap_difference"] <= 2e-6 * result["tap_scale"]
        assert result["hidden_difference"] <= 2e-6 * result["tap_scale"]
        assert result["decoded_sharded"] == result["decoded_whole"]
        assert len({t for d in result["decoded_whole"] for t in d["tokens"]}) > 3, "a degenerate decode"
    assert len(ranks[0]["decoded_whole"]) == 1 and len(ranks[1]["decoded_whole"]) == 3
    assert ranks[0]["idle_forwards"] > 0 and ranks[1]["idle_forwards"] == 0


def _dist_run(out: Path, target_dir, wavs, ep_size: int) -> dict:
    flags = ["--sgd", "0.5", "--steps", "2", "--unsupervised", "2,3",  # rank 1 has no anchor: its placeholder
             "--set", f"trainer.strategy.ep_size={ep_size}"]
    _torchrun("dist_train.py", out, target_dir, "fsdp2", "dflash2", *wavs, *flags)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}
    assert [ranks[r]["experts_sharded"] for r in range(2)] == [ep_size == 2] * 2
    return ranks


def test_a_run_with_sharded_experts_trains_like_whole_experts(tiny_hybrid_dir, speech_files, tmp_path):
    """The recipe's FSDP2 + DFlash2 on two ranks, one of them without any anchor: ep_size=2 gives the losses and
    the weights of ep_size=1."""
    wavs = [speech_files[name] for name in ("utt-short", "utt-mid", "utt-long", "utt-short")]
    whole = _dist_run(tmp_path / "whole", tiny_hybrid_dir, wavs, 1)
    sharded = _dist_run(tmp_path / "sharded", tiny_hybrid_dir, wavs, 2)
    assert sharded[0]["steps"] == whole[0]["steps"] == 2
    for key in ("train_loss", "val_loss"):
        assert sharded[0][key] == pytest.approx(whole[0][key], rel=1e-5), key
    weights = [load_file(str(run / "export" / "model.safetensors")) for run in (tmp_path / "sharded", tmp_path / "whole")]
    worst = worst_difference(*weights)
    print(f"ep_size=2 vs 1 after 2 SGD steps: loss {sharded[0]['train_loss']:.6f} vs {whole[0]['train_loss']:.6f}, "
          f"max |dw| = {worst:.3g}")
    assert worst < 1e-5


@pytest.mark.parametrize("ep_size, world, message", [
    (2, 3, "does not divide the 3 ranks"),
    (8, 8, "does not divide the target's 4 routed experts"),
    (0, 2, "must be >= 1"),
])
def test_an_expert_parallel_size_the_target_or_world_cannot_take_is_one_line(tiny_hybrid_dir, ep_size, world, message):
    problem = expert_parallel_problem(ep_size, world, llm_config_for(_model(tiny_hybrid_dir)))
    assert message in problem and "trainer.strategy.ep_size" in problem and "\n" not in problem


def test_a_target_without_moe_blocks_refuses_expert_parallelism_before_its_weights_load(tiny_salm_dir, monkeypatch):
    """Through the recipe's loader: the SALM (Qwen3, no MoE) with ep_size=2 is one line, and no weight is read."""
    from dflash_train.target import load
    from dflash_train.target.load import load_target_for_run

    monkeypatch.setattr(load, "open_speech_target", lambda *a: pytest.fail("the target's weights were loaded"))
    run = validate_config(compose("dflash", tiny_run_overrides(tiny_salm_dir) + ["trainer.strategy.ep_size=2"])).run
    with pytest.raises(ConfigError) as err:
        load_target_for_run(run, world_size=2)
    assert "has no MoE blocks to shard" in str(err.value) and "ep_size=1" in str(err.value)


def _model(target_dir):
    from dflash_train.config.schema import ModelConfig

    return ModelConfig(pretrained_name=str(target_dir))


def test_the_recipe_users_launch_trains_with_sharded_experts_through_the_cli(tiny_hybrid_dir, demo_data, tmp_path):
    """`torchrun ... scripts/dflash_train.py --config-name=demo model=salm_automodel trainer.strategy.ep_size=2` on
    the recipe's defaults (FSDP2, DFlash2, BF16, 2 shuffled loader workers) against the hybrid MoE target, with
    the phases where ranks decode different numbers of requests: serving validation of 3 records (2 on one
    rank, 1 on the other) and serving-aware anchors mined every other step."""
    train, val = demo_data
    run_dir = tmp_path / "run"
    command = _launch_command(
        tiny_hybrid_dir, run_dir, tmp_path / "exp", train, val,
        "model=salm_automodel", "trainer.strategy.ep_size=2", "trainer.max_steps=4", "trainer.val_check_interval=2",
        "dflash.selector_rank=16", "dflash.selector_top_k=8",
        "dflash.serving_val_samples=3", "dflash.serving_val_max_new_tokens=24",
        "dflash.serving_anchor_fraction=0.5", "dflash.serving_anchor_every=2",
    )
    proc = run_launcher(command, ENV, 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    logged = (run_dir / "csv" / "metrics.csv").read_text().splitlines()
    header = logged[0].split(",")
    served = [row.split(",")[header.index("val/serving_rounds")] for row in logged[1:]]
    assert sum(1 for value in served if value and float(value) > 0) == 2  # both validations decoded every record
    assert (run_dir / "export" / "model.safetensors").is_file()
    sharded = rank_log_lines(run_dir, "target experts: 2 MoE blocks sharded over 2 ranks")
    assert [len(sharded.get(rank, [])) for rank in (0, 1)] == [1, 1]
