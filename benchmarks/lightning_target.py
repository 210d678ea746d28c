"""Forward and training-step time of the Lightning-shaped target on this machine's CPU.

    .venv/bin/python benchmarks/lightning_target.py [--target DIR] [--repeats 5] [--short 2] [--long 8]

The target is ``python -m dflash_train.testing.tiny_mtp_salm --preset lightning`` (52 blocks: 23 Mamba-2 on
HF's PyTorch reference ops, 23 MoE with 8 experts top-6 + a shared expert, 6 attention; hidden 64), written to a
temporary directory unless ``--target`` names one. Printed, as JSON:

- ``forward_s``: median seconds of the target's training forward (``forward_taps`` with the runbook's six taps
  and the final hidden state) on random embeddings of each shape [rows, positions];
- ``step_s``: seconds per optimizer step of the demo recipe (``model=salm_automodel``, FP32, batch_tokens as the
  recipe sets, serving validation off) for DFlash2 with the six taps and for MTP heads, from two runs that differ
  only in ``trainer.max_steps`` (``--short`` and ``--long``): (time_long - time_short) / (long - short), so
  loading, validation and export cancel out (after one untimed run that pays the process's one-off costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

SHAPES = ((1, 128), (2, 256))


def _forward_times(target_dir: Path, repeats: int) -> dict:
    from dflash_train.config.schema import ModelConfig
    from dflash_train.target import open_speech_target
    from dflash_train.testing.tiny_mtp_salm import LIGHTNING_TAPS

    target = open_speech_target(ModelConfig(pretrained_name=str(target_dir)))
    times = {}
    for rows, positions in SHAPES:
        embeds = torch.randn(rows, positions, target.llm.config.hidden_size)
        seconds = []
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first call warms up
                start = time.perf_counter()
                target.forward_taps(embeds, None, LIGHTNING_TAPS, return_last_hidden=True)
                seconds.append(time.perf_counter() - start)
        times[f"[{rows}, {positions}]"] = round(statistics.median(seconds[1:]), 3)
    return times


def _train_seconds(target_dir: Path, data: tuple[Path, Path], run_dir: Path, variant: list[str], steps: int) -> float:
    from conftest import compose

    from dflash_train.config import validate_config
    from dflash_train.training.recipe import train

    train_cuts, val_cuts = data
    run = validate_config(compose("demo", [
        "model=salm_automodel", f"model.pretrained_name={target_dir}", *variant,
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}", f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20", "trainer.precision=32-true", f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=1", "dflash.serving_val_samples=0",
        "+trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]))
    start = time.perf_counter()
    assert train(run).steps == steps
    return time.perf_counter() - start


def main() -> None:
    """Measure and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="a Lightning-shaped target (default: build one)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per shape")
    parser.add_argument("--short", type=int, default=2, help="steps of the shorter training run")
    parser.add_argument("--long", type=int, default=8, help="steps of the longer training run")
    args = parser.parse_args()
    from dflash_train.testing.demo_data import write_demo_data
    from dflash_train.testing.tiny_mtp_salm import main as build

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target_dir = args.target
        if target_dir is None:
            target_dir = work / "target"
            build(["--out", str(target_dir), "--preset", "lightning"])
        data = write_demo_data(work / "data", count=24, val_count=4, jobs=2)
        result = {"threads": torch.get_num_threads(), "forward_s": _forward_times(target_dir, args.repeats),
                  "step_s": {}}
        variants = {"dflash2": ["dflash=dflash2", "dflash.target_layer_ids=[1,5,19,29,41,51]",
                                "dflash.selector_rank=16", "dflash.selector_top_k=8"],
                    "mtp": ["dflash=mtp"]}
        _train_seconds(target_dir, data, work / "warm-up", variants["mtp"], 1)  # the process's one-off costs
        for name, variant in variants.items():
            short, long = (_train_seconds(target_dir, data, work / f"{name}-{n}", variant, n)
                           for n in (args.short, args.long))
            result["step_s"][name] = round((long - short) / (args.long - args.short), 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
