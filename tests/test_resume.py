"""Exact resume: N steps, stop, resume to 2N equals an uninterrupted 2N run (fp32)."""

import pytest
from conftest import UTTERANCES, chatml_speech_batch, same_tensors
from listdata import ListDataModule
from safetensors.torch import load_file
from test_module import _csv_rows, _recipe, _series

from dflash_train.training.recipe import train

TEXTS = list(UTTERANCES.values())
SCHEDULE = "dflash.lr_scheduler={_target_:torch.optim.lr_scheduler.StepLR,step_size:2,gamma:0.5}"


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_resume_is_exact(tiny_salm_dir, tiny_target, speech_batch, tmp_path, variant):
    first = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    second = chatml_speech_batch(tiny_target, speech_batch, TEXTS[::-1], repeat=3)

    def factory(run, target):
        return ListDataModule([first, second], [second])

    def recipe(run_dir, steps):
        return _recipe(tiny_salm_dir, run_dir, f"trainer.max_steps={steps}", "trainer.val_check_interval=3",
                       "exp_manager.checkpoint_every_n_steps=3", "dflash.num_anchors=6", SCHEDULE, variant=variant)

    straight = train(recipe(tmp_path / "straight", 6), factory)
    stopped = train(recipe(tmp_path / "resumed", 3), factory)
    at_three = load_file(str(stopped.export_dir / "model.safetensors"))
    resumed = train(recipe(tmp_path / "resumed", 6), factory)

    assert stopped.steps == 3 and resumed.steps == 6 and straight.steps == 6
    assert resumed.resumed_from == tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    curve = _series(_csv_rows(tmp_path / "straight"), "train/dflash_loss")
    lrs = _series(_csv_rows(tmp_path / "straight"), "train/lr")
    resumed_curve = _series(_csv_rows(tmp_path / "resumed"), "train/dflash_loss")
    resumed_lrs = _series(_csv_rows(tmp_path / "resumed"), "train/lr")
    assert len(curve) == 6 and lrs[-1] == pytest.approx(lrs[0] / 8), "the StepLR schedule did not run"
    assert resumed_curve[-3:] == pytest.approx(curve[-3:], abs=1e-6)
    assert resumed_lrs[-3:] == pytest.approx(lrs[-3:], rel=1e-9)
    a = load_file(str(straight.export_dir / "model.safetensors"))
    b = load_file(str(resumed.export_dir / "model.safetensors"))
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed weights differ by {worst}"
    assert not same_tensors(a, at_three), "steps 4-6 did not train"
