"""Two gloo processes (DDP and FSDP2) match one process on the same global batch."""

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import run_launcher
from safetensors.torch import load_file

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def _launch(out: Path, salm_dir, strategy: str, variant: str, nproc: int, wavs, *flags: str,
            timeout: int = 600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--standalone",  # a free port of its own: tests may run concurrently
           str(HERE / "dist_train.py"), str(out), str(salm_dir), strategy, variant, *map(str, wavs), *flags]
    proc = run_launcher(cmd, env, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}


@pytest.fixture(scope="module")
def wavs(speech_files, tmp_path_factory):
    from dflash_train.testing.speech import synthesize

    extra = synthesize("every word it hears is written down", tmp_path_factory.mktemp("w") / "w4.wav")
    return [speech_files["utt-short"], speech_files["utt-mid"], speech_files["utt-long"], extra]


@pytest.fixture(scope="module")
def single(tiny_salm_dir, wavs, tmp_path_factory):
    runs = {}
    for variant in ("dflash", "dflash2"):
        out = tmp_path_factory.mktemp(f"single_{variant}")
        runs[variant] = (out, _launch(out, tiny_salm_dir, "ddp", variant, 1, wavs))
    return runs


# DFlash's loss is exactly Σw·CE/Σw over ranks. DFlash2 adds the selector loss, whose own
# per-rank denominator nemo_automodel's core does not expose, so it is normalised by the
# base weights: equal ranks, close to (not bit-equal with) one process.
TOLERANCE = {"dflash": (1e-4, 1e-4), "dflash2": (5e-2, 5e-3)}


@pytest.mark.parametrize("strategy, variant", [("ddp", "dflash"), ("fsdp2", "dflash"), ("fsdp2", "dflash2")])
def test_two_ranks_match_one(single, tiny_salm_dir, wavs, tmp_path, strategy, variant):
    loss_rel, weight_abs = TOLERANCE[variant]
    single_dir, single_metrics = single[variant]
    metrics = _launch(tmp_path, tiny_salm_dir, strategy, variant, 2, wavs)
    assert metrics[0]["steps"] == metrics[1]["steps"] == single_metrics[0]["steps"] == 3
    # every rank logs the globally normalised loss
    assert metrics[0]["train_loss"] == pytest.approx(metrics[1]["train_loss"], abs=1e-6)
    assert metrics[0]["train_loss"] == pytest.approx(single_metrics[0]["train_loss"], rel=loss_rel)
    assert metrics[0]["val_loss"] == pytest.approx(single_metrics[0]["val_loss"], rel=loss_rel)
    ours = load_file(str(tmp_path / "export" / "model.safetensors"))
    ref = load_file(str(single_dir / "export" / "model.safetensors"))
    assert ours.keys() == ref.keys()
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < weight_abs, f"weights after 3 steps differ by {worst}"


def _weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_rank_without_anchor_runs_the_same_collectives_and_matches_one_process(tiny_salm_dir, wavs, tmp_path,
                                                                               strategy):
    """Rank 1's rows have no supervised position: it must still join every all-gather / reduce (FSDP2 hung)."""
    flags = ("--unsupervised", "2,3", "--sgd", "0.5", "--steps", "2")
    single = _launch(tmp_path / "one", tiny_salm_dir, "ddp", "dflash", 1, wavs, *flags)
    two = _launch(tmp_path / "two", tiny_salm_dir, strategy, "dflash", 2, wavs, *flags, timeout=240)
    assert two[0]["steps"] == two[1]["steps"] == single[0]["steps"] == 2
    assert two[0]["train_loss"] == pytest.approx(single[0]["train_loss"], rel=1e-5)
    ours, ref = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    worst = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < 1e-6, f"{strategy}: weights differ from one process by {worst}"
