"""Two gloo processes (DDP and FSDP2) match one process on the same global batch."""

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import run_launchers, worst_difference
from safetensors.torch import load_file

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def _launch(out: Path, salm_dir, strategy: str, variant: str, nproc: int, wavs, *flags: str,
            timeout: int = 600) -> dict:
    (metrics,) = _launch_side_by_side([(out, salm_dir, strategy, variant, nproc, wavs, *flags)], timeout=timeout)
    return metrics


def _launch_side_by_side(launches: list[tuple], timeout: int = 600) -> list[dict]:
    """Each ``(out, salm_dir, strategy, variant, nproc, wavs, *flags)`` of ``launches`` through torchrun, all
    started at once (independent runs: a one-process reference beside the run it is compared with uses the
    core the other leaves), then awaited: per launch, each rank's metrics."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    commands = [[str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--standalone",  # a free port of its own
                 str(HERE / "dist_train.py"), str(out), str(salm_dir), strategy, variant, *map(str, wavs), *flags]
                for out, salm_dir, strategy, variant, nproc, wavs, *flags in launches]
    results = []
    for launch, proc in zip(launches, run_launchers(commands, env, timeout)):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        out, nproc = launch[0], launch[4]
        results.append({r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)})
    return results


@pytest.fixture(scope="module")
def wavs(speech_files, tmp_path_factory):
    from dflash_train.testing.speech import synthesize

    extra = synthesize("every word it hears is written down", tmp_path_factory.mktemp("w") / "w4.wav")
    return [speech_files["utt-short"], speech_files["utt-mid"], speech_files["utt-long"], extra]


def _weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "export" / "model.safetensors"))


# Plain SGD, so the weights carry any error in the gradient's scale (AdamW would normalise it away).
# DFlash2 runs with the shipped selector weight (1.0): its mean is taken over every rank's rows
# (variants/dflash2.py), so two ranks train like one process. The tolerance, 1e-6 on weights of
# order 0.1-1 after two SGD steps, is FP32 summation order (ranks sum their halves, then gloo adds
# the two sums): measured 6e-8 (FSDP2, also with 2 accumulated micro-batches); with per-rank selector means
# the first step's loss already differs by 3.5e-4 relative (7.9629 vs 7.9657).
SGD = ("--sgd", "0.5", "--steps", "2")
VARIANT_FLAGS = {"dflash": (), "dflash2": (), "eagle3": ()}
# EAGLE-3's loss is nemo_automodel's: each TTT step a mean over the rank's own supervised slots, so N ranks
# (combined by their chains) are not exactly one process. Measured on this batch: train loss 2.9e-5 and
# validation loss 4.0e-5 relative, weights 1.1e-4 after 2 SGD steps at lr 0.5 (a rank's gradient left out of
# the reduction moves them by orders of magnitude more). (loss rel, weights abs):
MATCH_TOLERANCE = {"eagle3": (1e-4, 3e-4)}


NO_ANCHOR_FLAGS = ("--unsupervised", "2,3", "--sgd", "0.5", "--steps", "2")
WITHOUT_ANCHOR = "dflash, rows 2 and 3 unsupervised"


@pytest.fixture(scope="module")
def single(tiny_salm_dir, wavs, tmp_path_factory):
    """The one-process references, launched side by side: each variant with :data:`SGD`, and DFlash with
    :data:`NO_ANCHOR_FLAGS` (key :data:`WITHOUT_ANCHOR`). Per key: ``(out, metrics)``."""
    launches = {variant: (variant, (*SGD, *flags)) for variant, flags in VARIANT_FLAGS.items()}
    launches[WITHOUT_ANCHOR] = ("dflash", NO_ANCHOR_FLAGS)
    outs = {key: tmp_path_factory.mktemp("single") for key in launches}
    metrics = _launch_side_by_side([(outs[key], tiny_salm_dir, "ddp", variant, 1, wavs, *flags)
                                    for key, (variant, flags) in launches.items()])
    return {key: (outs[key], m) for key, m in zip(launches, metrics)}


# the recipe's defaults (FSDP2, DFlash2 with its selector) and the extra case (DDP, DFlash)
@pytest.mark.parametrize("strategy, variant", [("fsdp2", "dflash2"), ("ddp", "dflash"), ("fsdp2", "eagle3")])
def test_two_ranks_match_one(single, tiny_salm_dir, wavs, tmp_path, strategy, variant):
    single_dir, single_metrics = single[variant]
    metrics = _launch(tmp_path, tiny_salm_dir, strategy, variant, 2, wavs, *SGD, *VARIANT_FLAGS[variant])
    assert metrics[0]["steps"] == metrics[1]["steps"] == single_metrics[0]["steps"] == 2
    # every rank logs the globally normalised loss
    assert metrics[0]["train_loss"] == pytest.approx(metrics[1]["train_loss"], abs=1e-6)
    loss_rel, weight_tol = MATCH_TOLERANCE.get(variant, (1e-5, 1e-6))
    print(f"\n{strategy}/{variant}: train loss 2 ranks {metrics[0]['train_loss']!r} vs 1 process "
          f"{single_metrics[0]['train_loss']!r}; val {metrics[0]['val_loss']!r} vs {single_metrics[0]['val_loss']!r}")
    assert metrics[0]["train_loss"] == pytest.approx(single_metrics[0]["train_loss"], rel=loss_rel)
    assert metrics[0]["val_loss"] == pytest.approx(single_metrics[0]["val_loss"], rel=loss_rel)
    worst = worst_difference(_weights(tmp_path), _weights(single_dir))
    print(f"{strategy}/{variant}: 2 ranks vs 1 process after 2 SGD steps: max |dw| = {worst:.3g}")
    assert worst < weight_tol, f"{strategy}/{variant}: weights after 2 SGD steps differ from one process by {worst}"


# every anchor is drawn (num_anchors 512): the moved blocks duplicate round starts, so the weights change
MINED_STARTS = {
    "serving_anchors": ("dflash", ("--set", "dflash.serving_anchor_fraction=1.0", "--set", "dflash.serving_anchor_every=1")),
    # the recipe's variant, every step in the on-policy stage: its loss and every round start mined on each rank
    "on_policy": ("dflash2", ("--set", "dflash.on_policy_from_step=0", "--set", "dflash.serving_anchor_every=1")),
}


@pytest.mark.parametrize("option", list(MINED_STARTS))
def test_mined_round_starts_keep_two_fsdp2_ranks_equal_to_one_process(single, tiny_salm_dir, wavs, tmp_path, option):
    """Mining (a collective), the mined memory, the blocks it moves and the on-policy loss depend on the samples,
    not on the rank: two ranks still train exactly like one process on the same global batch."""
    variant, option_flags = MINED_STARTS[option]
    flags = (*SGD, *option_flags)
    one, two = _launch_side_by_side([(tmp_path / "one", tiny_salm_dir, "ddp", variant, 1, wavs, *flags),
                                     (tmp_path / "two", tiny_salm_dir, "fsdp2", variant, 2, wavs, *flags)])
    assert one[0]["train_loss"] == pytest.approx(two[0]["train_loss"], rel=1e-5)
    worst = worst_difference(_weights(tmp_path / "two"), _weights(tmp_path / "one"))
    assert worst < 1e-6, f"{option}: 2 ranks differ from one process by {worst}"
    plain_dir = single[variant][0]  # the same launch without the option
    assert worst_difference(_weights(plain_dir), _weights(tmp_path / "one")) > 0, "the option did nothing"


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_rank_without_anchor_runs_the_same_collectives_and_matches_one_process(single, tiny_salm_dir, wavs, tmp_path,
                                                                               strategy):
    """Rank 1's rows have no supervised position: it must still join every all-gather / reduce (FSDP2 hung)."""
    one_dir, one = single[WITHOUT_ANCHOR]
    two = _launch(tmp_path / "two", tiny_salm_dir, strategy, "dflash", 2, wavs, *NO_ANCHOR_FLAGS, timeout=240)
    assert two[0]["steps"] == two[1]["steps"] == one[0]["steps"] == 2
    assert two[0]["train_loss"] == pytest.approx(one[0]["train_loss"], rel=1e-5)
    worst = worst_difference(_weights(tmp_path / "two"), _weights(one_dir))
    assert worst < 1e-6, f"{strategy}: weights differ from one process by {worst}"


def test_two_fsdp2_ranks_accumulating_two_micro_batches_match_one_process(tiny_salm_dir, wavs, tmp_path):
    """Gradient accumulation over ranks and micro-batches: each window's gradient is divided by the
    window's Σw summed over both ranks and both micro-batches (DFlash2, selector on)."""
    flags = (*SGD, "--set", "trainer.accumulate_grad_batches=2")
    one, two = _launch_side_by_side([(tmp_path / "one", tiny_salm_dir, "ddp", "dflash2", 1, wavs, *flags),
                                     (tmp_path / "two", tiny_salm_dir, "fsdp2", "dflash2", 2, wavs, *flags)])
    assert one[0]["steps"] == two[0]["steps"] == 2
    worst = worst_difference(_weights(tmp_path / "two"), _weights(tmp_path / "one"))
    print(f"\nfsdp2/dflash2, accumulate 2: 2 ranks vs 1 process: max |dw| = {worst:.3g}")
    assert worst < 1e-6, f"accumulation: 2 ranks differ from one process by {worst}"
