"""Serving-aware anchors: round starts mined with the reference decoder steer part of the anchors.

Checked: the replacement rule on hand-made anchors; then real runs of the demo recipe (real data
module, the DFlash trainer core) where mining fills the memory, the option changes training, and
a run stopped and resumed reaches the same weights as one straight run (the memory travels in
the checkpoint).
"""

from __future__ import annotations

import csv
import re

import pytest
import torch
from conftest import demo_recipe, same_tensors
from safetensors.torch import load_file

from dflash_train.draft.build import PreferredRow, replace_with_preferred
from dflash_train.errors import ConfigError
from dflash_train.training.serving_anchors import CHECKPOINT_KEY, reply_span
from dflash_train.training.recipe import train


def test_preferred_positions_take_blocks_from_the_uniform_draw():
    loss_mask = torch.zeros(2, 20)
    loss_mask[0, 5:15] = 1
    loss_mask[0, 17] = 1
    loss_mask[1, 2:10] = 1
    anchors = torch.tensor([[5, 6, 8, 11, 12, 0], [2, 3, 4, 0, 0, 0]])
    keep = torch.tensor([[True] * 5 + [False], [True] * 3 + [False] * 3])
    # row 0: 2 and 15 unsupervised, 17 has no full block (B=4, S=20)
    preferred = [PreferredRow([9, 2, 13, 9, 15, 7, 17], 1), PreferredRow([7, 3], 2)]

    def replaced(rows, remaining=None):
        return replace_with_preferred(anchors, keep, rows, 0.6, loss_mask, 4, 20, remaining)

    out, out_keep = replaced(preferred)
    assert torch.equal(out_keep, keep) and out[0, 5] == 0 and out[1, 3:].tolist() == [0, 0, 0]
    row0, row1 = out[0, :5].tolist(), out[1, :3].tolist()
    assert row0 == sorted(row0) and row1 == sorted(row1)
    # round(0.6 * 5) = 3 blocks go to 9, 13, 7 (valid, in the given order); 2 of the 5 drawn survive
    assert sorted(set(row0) & {9, 13, 7}) == [7, 9, 13] and len([a for a in row0 if a in (5, 6, 8, 11, 12)]) == 2
    # round(0.6 * 3) = 2 blocks go to 7 and 3; 3 may also survive from the draw and then trains twice
    assert row1.count(7) == 1 and row1.count(3) >= 1 and len(row1) == 3
    assert torch.equal(replaced(preferred)[0], out)  # the row's seed decides, not the global generator
    draws = {tuple(replaced([PreferredRow(preferred[0].positions, seed), preferred[1]])[0][0].tolist())
             for seed in range(40)}
    assert len(draws) > 1  # the replaced blocks depend on the seed, not always the last ones
    remaining = torch.full((2, 20), 100)
    remaining[0, 13] = 1  # 13 would cross its document's end
    out, _ = replaced(preferred, remaining)
    assert 13 not in out[0].tolist() and sorted(set(out[0, :5].tolist()) & {9, 7}) == [7, 9]
    assert torch.equal(replaced([PreferredRow([], 1), PreferredRow([], 2)])[0], anchors)


def test_the_reply_span_is_the_last_supervised_run():
    assert reply_span(torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 0]).bool()) == (5, 3)
    assert reply_span(torch.zeros(4, dtype=torch.bool)) is None


def _recipe(tiny_salm_dir, demo_data, run_dir, steps, *extra):
    return demo_recipe(tiny_salm_dir, demo_data, run_dir, "data.train_ds.batch_tokens=400", f"trainer.max_steps={steps}",
                       "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
                       "exp_manager.checkpoint_every_n_steps=4", "exp_manager.resume_if_exists=true", "dflash=dflash",
                       "trainer.log_every_n_steps=2",
                       "dflash.num_anchors=8", "dflash.serving_val_samples=0", *extra)


SERVING_ANCHORS = ("dflash.serving_anchor_fraction=0.5", "dflash.serving_anchor_every=3")
ON_POLICY = ("dflash.on_policy_from_step=2", "dflash.serving_anchor_every=1")


@pytest.mark.parametrize("option", [SERVING_ANCHORS, ON_POLICY], ids=["serving_anchors", "on_policy"])
def test_serving_anchors_mine_steer_training_and_resume_exactly(tiny_salm_dir, demo_data, tmp_path, option):
    """Serving-aware anchors remember post-correction starts; the on-policy stage (from step 2, mining every
    step) every start, the first round's included, and trains with its own loss; both resume exactly (the
    on-policy run stops inside the stage) and log the miner's decode time."""
    straight = train(_recipe(tiny_salm_dir, demo_data, tmp_path / "straight", 8, *option))
    stopped = train(_recipe(tiny_salm_dir, demo_data, tmp_path / "resumed", 4, *option))
    checkpoint = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    mined = checkpoint[CHECKPOINT_KEY]
    assert len(mined) >= 4 and all(starts == sorted(set(starts)) for starts in mined.values())
    if option is ON_POLICY:  # mined on steps 2 and 3 only, every round start kept
        assert all(starts and starts[0] == 0 and len(starts) >= 2 for starts in mined.values())
    else:
        assert all(0 not in starts for starts in mined.values())
        assert any(mined.values()), "no round started after a correction: the option would do nothing here"
    with open(tmp_path / "straight" / "csv" / "metrics.csv") as handle:
        logged = [row for row in csv.DictReader(handle) if row.get("train/mining_seconds")]
    assert logged and max(float(row["train/mining_seconds"]) for row in logged) > 0
    # train/ce, the hard-label CE at every supervised position: the objective itself off-policy, not in the stage
    losses = [(int(row["step"]), float(row["train/ce"]), float(row["train/dflash_loss"])) for row in logged]
    if option is ON_POLICY:
        assert all(abs(ce - loss) > 1e-3 * ce for step, ce, loss in losses if step >= 3)  # logged at the step made
    else:
        assert all(abs(ce - loss) <= 1e-6 * ce for _, ce, loss in losses)
    resumed = train(_recipe(tiny_salm_dir, demo_data, tmp_path / "resumed", 8, *option))
    assert stopped.steps == 4 and resumed.steps == 8
    a = load_file(str(straight.export_dir / "model.safetensors"))
    b = load_file(str(resumed.export_dir / "model.safetensors"))
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed weights differ by {worst}"

    uniform = train(_recipe(tiny_salm_dir, demo_data, tmp_path / "uniform", 8))
    assert not same_tensors(a, load_file(str(uniform.export_dir / "model.safetensors"))), "the option changed nothing"
    if option is ON_POLICY:  # the stage's loss reaches training: its reverse-KL weight changes the weights
        plain = train(_recipe(tiny_salm_dir, demo_data, tmp_path / "no_reverse", 8, *option,
                              "dflash.on_policy_reverse_kl_weight=0"))
        assert not same_tensors(a, load_file(str(plain.export_dir / "model.safetensors")))


@pytest.mark.parametrize("overrides, message", [
    (["dflash.serving_anchor_fraction=1.5"], "dflash.serving_anchor_fraction=1.5 must be in [0, 1]"),
    (["dflash.serving_anchor_every=0", "dflash.serving_anchor_fraction=0.5"], "dflash.serving_anchor_every=0 must be >= 1"),
    (["dflash.serving_anchor_fraction=0.5", "data.train_ds.packing=true", "++data.train_ds.batch_size=null"],
     "dflash.serving_anchor_fraction > 0 needs padded batches"),
    (["dflash=mtp", "dflash.serving_anchor_fraction=0.5"], "dflash.serving_anchor_fraction is a DFlash key the mtp"),
    (["dflash.on_policy_from_step=-3"], "dflash.on_policy_from_step=-3 must be >= 0, or -1 (off)"),
    (["dflash.on_policy_from_step=2", "dflash.on_policy_anchor_fraction=0"],
     "dflash.on_policy_anchor_fraction=0.0 must be in (0, 1]"),
    (["dflash.on_policy_from_step=2", "dflash.serving_anchor_fraction=0.5"],
     "dflash.on_policy_from_step and dflash.serving_anchor_fraction both place blocks"),
    (["dflash.on_policy_from_step=2", "dflash.loss_chunk_size=0"], "dflash.on_policy_from_step needs the chunked loss"),
    (["dflash.on_policy_from_step=2", "dflash.distill_top_k=4", "dflash.loss_kl_weight=1"],
     "the reverse KL needs the target's whole distribution"),
    (["dflash.on_policy_from_step=2", "data.train_ds.packing=true", "++data.train_ds.batch_size=null"],
     "dflash.on_policy_from_step needs padded batches"),
    (["dflash=mtp", "dflash.on_policy_from_step=2"], "dflash.on_policy_from_step is a DFlash key the mtp"),
    (["dflash.on_policy_reverse_kl_weight=0.5"], "dflash.on_policy_reverse_kl_weight is set but the on-policy stage is off"),
])
def test_serving_anchor_mistakes_are_one_line_errors(tiny_salm_dir, demo_data, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _recipe(tiny_salm_dir, demo_data, tmp_path, 2, *[o for o in overrides if not o.startswith("dflash=")],
                *[o for o in overrides if o.startswith("dflash=")])
