"""Exact resume: N steps, stop, resume to 2N equals an uninterrupted 2N run (fp32)."""

import re

import pytest
from conftest import UTTERANCES, ResumeComparison, chatml_speech_batch, two_batch_data, two_batches
from listdata import ListDataModule
from safetensors.torch import load_file
from test_module import _csv_rows, _recipe, _series

from dflash_train.training.recipe import train

TEXTS = list(UTTERANCES.values())
SCHEDULE = "dflash.lr_scheduler={_target_:torch.optim.lr_scheduler.StepLR,step_size:2,gamma:0.5}"


def test_a_resume_says_what_it_restored_and_warns_past_the_schedules_horizon():
    from dflash_train.training.module import describe_restored_state

    checkpoint = {
        "global_step": 300,
        "optimizer_states": [{"param_groups": [{"lr": 3.0e-4}]}],
        "lr_schedulers": [{"T_max": 500, "last_epoch": 300}],
    }
    message, warning = describe_restored_state(checkpoint, max_steps=500)
    assert message == "resume: restored global step 300, lr 0.0003, scheduler at step 300 of 500" and warning is None
    _, warning = describe_restored_state(checkpoint, max_steps=800)
    assert warning.startswith("trainer.max_steps=800 runs past the restored LR schedule's horizon (500 steps)")
    message, warning = describe_restored_state({**checkpoint, "lr_schedulers": []}, max_steps=800)
    assert message.endswith("no scheduler (constant lr)") and warning is None


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_resume_is_exact(tiny_salm_dir, tiny_target, speech_batch, tmp_path, variant, caplog):
    factory = two_batch_data(tiny_target, speech_batch)

    def recipe(run_dir, steps):
        return _recipe(tiny_salm_dir, run_dir, f"trainer.max_steps={steps}", "trainer.val_check_interval=3",
                       "exp_manager.checkpoint_every_n_steps=3", "dflash.num_anchors=6", SCHEDULE, variant=variant)

    with caplog.at_level("INFO", logger="dflash_train.training.module"):
        runs = ResumeComparison(lambda run_dir, steps: train(recipe(run_dir, steps), factory), tmp_path, 6, 3)
    assert re.search(r"resume: restored global step 3, lr [0-9.e-]+, scheduler at step 3\b", caplog.text)

    curve = _series(_csv_rows(tmp_path / "straight"), "train/dflash_loss")
    lrs = _series(_csv_rows(tmp_path / "straight"), "train/lr")
    resumed_curve = _series(_csv_rows(tmp_path / "resumed"), "train/dflash_loss")
    resumed_lrs = _series(_csv_rows(tmp_path / "resumed"), "train/lr")
    assert len(curve) == 6 and lrs[-1] == pytest.approx(lrs[0] / 8), "the StepLR schedule did not run"
    assert resumed_curve[-3:] == pytest.approx(curve[-3:], abs=1e-6)
    assert resumed_lrs[-3:] == pytest.approx(lrs[-3:], rel=1e-9)
    worst = runs.worst()
    assert worst <= 1e-6, f"resumed weights differ by {worst}"
    _the_report_spans_both_launches(tmp_path, variant, curve)


def _the_report_spans_both_launches(root, variant, straight_curve):
    """The resumed run's report (written by its second launch) holds all six steps' losses, equal to the
    uninterrupted run's, with the resume marked: Lightning's CSV logger alone would keep the last three."""
    from dflash_train.training.history import read_history
    from dflash_train.training.report import training_figure

    report = (root / "resumed" / "report.md").read_text()
    assert "2 launches (resumed at step 3)" in report and "`csv/metrics.launch-1.csv`, `csv/metrics.csv`" in report
    figure = training_figure(read_history(root / "resumed"))
    loss_panel = next(ax for ax in figure.axes if ax.get_title() == "loss")
    lines = {line.get_label(): line for line in loss_panel.get_lines()}
    assert list(lines["train loss"].get_xdata()) == [1, 2, 3, 4, 5, 6]  # step N: after N optimizer steps
    assert list(lines["train loss"].get_ydata()) == pytest.approx(straight_curve, abs=1e-6)
    assert [x for line in loss_panel.get_lines() if line.get_label() == "resumed" for x in line.get_xdata()] == [3, 3]
    if variant == "dflash2":  # its loss's parts
        assert {"base loss", "selector loss"} <= lines.keys()


def test_a_run_and_its_export_record_what_made_them(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    import hashlib
    import json

    import yaml

    batch = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)

    def factory(run, target):
        return ListDataModule([batch], [batch])

    def recipe(steps):
        return _recipe(tiny_salm_dir, tmp_path / "run", f"trainer.max_steps={steps}", "trainer.val_check_interval=2",
                       "exp_manager.checkpoint_every_n_steps=2", "seed=11", variant="dflash")

    train(recipe(2), factory)
    first_info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    resumed = train(recipe(4), factory)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert first_info["start_step"] == 0 and info["start_step"] == 2  # the resumed run says where it started
    weights = hashlib.sha256((tiny_salm_dir / "model.safetensors").read_bytes()).hexdigest()
    assert info["target"]["weights_sha256"] == weights and info["target"]["path"] == str(tiny_salm_dir.resolve())
    assert info["warm_start"] == "fresh" and info["seed"] == 11 and info["world_size"] == 1
    assert info["variant"] == "dflash" and all(info["versions"].values()), info["versions"]  # every library installed
    assert info["data"] == {"train": []}  # the recipe lists no input: this test hands its batches in directly
    assert info["dflash_train_revision"]  # a commit (or "not a git checkout")
    resolved = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())
    assert resolved["seed"] == 11 and resolved["dflash"]["variant"] == "dflash" and resolved["trainer"]["precision"]
    exported = json.loads((resumed.export_dir / "config.json").read_text())["training_info"]
    assert exported["global_step"] == 4 == resumed.steps
    assert exported["target"]["weights_sha256"] == weights and exported["run_dir"] == str((tmp_path / "run").resolve())


def test_resuming_with_another_target_is_refused_naming_it(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from dflash_train.errors import ConfigError

    batch = chatml_speech_batch(tiny_target, speech_batch, TEXTS, repeat=2)
    other = tmp_path / "other_target"
    shutil.copytree(tiny_salm_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["llm.lm_head.weight"] = weights["llm.lm_head.weight"] * 1.01  # same shapes, other weights
    save_file(weights, str(other / "model.safetensors"))

    def recipe(target, steps):
        return _recipe(target, tmp_path / "run", f"trainer.max_steps={steps}", "trainer.val_check_interval=2",
                       "exp_manager.checkpoint_every_n_steps=2", variant="dflash")

    train(recipe(tiny_salm_dir, 2), lambda run, target: ListDataModule([batch], [batch]))
    with pytest.raises(ConfigError, match=r"checkpoint to resume was written with target_weights_sha256=[0-9a-f]{64} "
                                          r"but this run has [0-9a-f]{64}"):
        train(recipe(other, 4), lambda run, target: ListDataModule([batch], [batch]))
    resumed = train(recipe(tiny_salm_dir, 4), lambda run, target: ListDataModule([batch], [batch]))
    assert resumed.steps == 4 and resumed.resumed_from is not None  # the same target resumes as before


def test_resume_inside_gradient_accumulation_is_exact(tiny_salm_dir, tiny_target, speech_batch, tmp_path):
    """Two micro-batches per step, stopped after step 1 and resumed to 4: the first resumed micro-batch opens a
    window (Lightning restores one batch short of the checkpoint's, which made it close one: the optimizer
    stepped after a single micro-batch, max |dw| 0.013)."""
    first, second = two_batches(tiny_target, speech_batch)

    def run(run_dir, steps):
        recipe = _recipe(tiny_salm_dir, run_dir, f"trainer.max_steps={steps}", "trainer.accumulate_grad_batches=2",
                         "trainer.val_check_interval=2", "exp_manager.checkpoint_every_n_steps=1",
                         "dflash.num_anchors=6", variant="dflash")
        return train(recipe, lambda run, target: ListDataModule([first, second, first], [second]))

    assert ResumeComparison(run, tmp_path, 4, 1).worst() == 0.0
