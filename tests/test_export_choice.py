"""``exp_manager.export_checkpoint=best`` when no checkpoint was validated: the export is the last step, and the
export and the run summary say why (the best-checkpoint export itself is tested through the CLI in
tests/test_lifecycle.py)."""

import json

from conftest import UTTERANCES, chatml_speech_batch
from listdata import ListDataModule
from test_module import _recipe

from dflash_train.training.recipe import train


def test_a_best_export_of_a_run_that_never_validated_is_its_last_step_and_says_so(tiny_salm_dir, tiny_target,
                                                                                  speech_batch, tmp_path):
    batch = chatml_speech_batch(tiny_target, speech_batch, list(UTTERANCES.values()), repeat=2)
    recipe = _recipe(tiny_salm_dir, tmp_path / "run", "trainer.max_steps=1", "trainer.val_check_interval=2",
                     "data.validation_ds={input_cfg:[]}", "dflash.serving_val_samples=0",
                     "exp_manager.export_checkpoint=best", variant="dflash")
    summary = train(recipe, lambda run, target: ListDataModule([batch], [batch]))
    info = json.loads((summary.export_dir / "config.json").read_text())["training_info"]
    reason = "exp_manager.export_checkpoint=best but no checkpoint was validated on val_acc"
    assert info["exported_checkpoint"] == {"choice": "last", "reason": reason}
    assert info["global_step"] == info["trained_steps"] == 1 and "val_step" not in info
    assert summary.exported == f"the last step, 1: {reason}"
    assert f"export: {summary.export_dir} (the last step, 1: {reason})" in summary.report(recipe.run)
