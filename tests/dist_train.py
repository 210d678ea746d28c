"""Worker for the multi-process tests: `torchrun --nproc_per_node=N tests/dist_train.py OUT SALM STRATEGY VARIANT WAV... [--flag ...]`.

Every run trains on the same global batch of four conversations: one process takes all
four rows, N processes take 4/N rows each. Writes the final export and, per rank, the
last logged metrics and whether the target's experts were sharded. Flags: ``--unsupervised ROW,...`` clears the loss mask of those global
rows (a rank can be left without any anchor), ``--sgd LR`` trains with plain SGD (so the
weights show any error in the gradient's scale), ``--steps N``, ``--set KEY=VALUE`` (a recipe
override; repeatable).
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import chatml_speech_batch, compose, tiny_run_overrides  # noqa: E402
from listdata import ListDataModule  # noqa: E402

from dflash_train.config import validate_config  # noqa: E402
from dflash_train.training.recipe import train  # noqa: E402

TEXTS = [
    "hello world",
    "the draft proposes tokens and the target checks them",
    "a small speech model listens to the clip",
    "every word it hears is written down",
]


def _flags(argv: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    positional, flags, overrides = [], {}, []
    items = iter(argv)
    for item in items:
        if item == "--set":
            overrides.append(next(items))
        elif item.startswith("--"):
            flags[item[2:]] = next(items)
        else:
            positional.append(item)
    return positional, flags, overrides


VARIANT_OVERRIDES = {
    "dflash2": ["dflash.block_size=4", "dflash.num_anchors=512", "dflash.selector_rank=16", "dflash.selector_top_k=8"],
    # the whole vocabulary: each rank's rows here are its own (the recipe's vocabulary pass reads the same
    # unsharded examples on every rank)
    "eagle3": ["dflash.ttt_steps=3", "dflash.draft_vocab_size=null"],
}


def main() -> None:
    (out, salm_dir, strategy, variant, *wavs), flags, overrides = _flags(sys.argv[1:])
    unsupervised = {int(row) for row in flags.get("unsupervised", "").split(",") if row}
    steps = int(flags.get("steps", 3))
    optimizer = [f"dflash.optimizer={{_target_:torch.optim.SGD,lr:{flags['sgd']}}}"] if "sgd" in flags else []
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    from lhotse import CutSet, Recording

    cuts = CutSet([Recording.from_file(w, recording_id=f"r{i}").to_cut() for i, w in enumerate(wavs)])
    audios, lens = cuts.load_audio(collate=True)
    validated = validate_config(
        compose(
            "dflash",
            tiny_run_overrides(salm_dir)
            + [
                f"dflash={variant}",
                "trainer=cpu",
                f"trainer.devices={world}",
                f"trainer.strategy.name={strategy}",
                f"trainer.max_steps={steps}",
                f"trainer.val_check_interval={steps}",
                "+trainer.enable_progress_bar=false",
                "dflash.lr=3e-3",
            ]
            + VARIANT_OVERRIDES.get(variant, ["dflash.block_size=4", "dflash.num_anchors=512"])
            + optimizer
            + overrides
            + [
                f"exp_manager.explicit_log_dir={out}",
                "exp_manager.create_tensorboard_logger=false",
            ],
        )
    )

    loaded = {}

    def factory(run, target):
        loaded["target"] = target
        rows = range(rank * len(TEXTS) // world, (rank + 1) * len(TEXTS) // world)
        speech = (torch.as_tensor(audios)[list(rows)], torch.as_tensor(lens)[list(rows)])
        batch = chatml_speech_batch(target, speech, [TEXTS[i] for i in rows], repeat=2)
        batch.sample_ids = [f"row-{row}" for row in rows]  # global ids: the same sample has one id at any world size
        for local, row in enumerate(rows):
            if row in unsupervised:
                batch.loss_mask[local] = False
        # ListDataModule shards by rank; hand every rank its own rows as a one-element world.
        module = ListDataModule([batch] * world, [batch] * world)
        return module

    summary = train(validated, factory)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"steps": summary.steps, "train_loss": summary.train_loss, "val_loss": summary.val_loss,
                    "experts_sharded": loaded["target"].experts_sharded})
    )


if __name__ == "__main__":
    main()
