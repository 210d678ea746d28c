"""Validation reports serving's acceptance: the number training logs is the number dflash-eval measures.

A real run of the demo recipe (tiny SALM, demo speech, the real data module) logs
``val/serving_mal`` and per-position acceptance at its last validation, decoded in memory from
the training draft. ``dflash-eval``'s path then loads the written export from disk, loads the
target afresh with serving's perception precision, and decodes the same first records of the
validation set: its pooled counters must be exactly the ones training logged.
"""

from __future__ import annotations

import csv
import math

import pytest
from conftest import demo_recipe

from dflash_train.config.schema import InputConfig
from dflash_train.errors import ConfigError
from dflash_train.evaluate.loading import TargetSource
from dflash_train.evaluate.run import TARGET_MTP_HEADS, evaluate, prepare
from dflash_train.training.recipe import train

SAMPLES = 4
MAX_NEW_TOKENS = 24
STEPS = 30


def _recipe(tiny_salm_dir, demo_data, run_dir, *extra):
    # long enough for a draft that accepts some proposals and not others, which is what the parity checks
    # need (a 12-step DFlash draft may accept nothing on the tiny target, depending on its initialisation)
    return demo_recipe(tiny_salm_dir, demo_data, run_dir, f"trainer.max_steps={STEPS}",
                       f"trainer.val_check_interval={STEPS // 2}", "dflash.lr=5e-3",
                       "trainer.limit_val_batches=1", f"dflash.serving_val_samples={SAMPLES}",
                       f"dflash.serving_val_max_new_tokens={MAX_NEW_TOKENS}", *extra)


def _last_logged(run_dir, prefix: str) -> dict[str, float]:
    """The last non-empty value of every metric starting with ``prefix`` in the run's CSV log."""
    path = next(run_dir.rglob("metrics.csv"))
    values = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.startswith(prefix) and value not in ("", None):
                    values[key] = float(value)
    return values


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "mtp"])
def test_the_logged_serving_mal_is_what_dflash_eval_measures_on_the_export(variant, tiny_salm_dir, demo_data,
                                                                          tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="dflash_train.training.recipe"):
        summary = train(_recipe(tiny_salm_dir, demo_data, run_dir, f"dflash={variant}"))
    logged = _last_logged(run_dir, "val/serving_")
    export = str(summary.export_dir)
    if variant == "mtp":  # the export is the target with its heads
        target, drafts = TargetSource(checkpoint=export), {"draft": TARGET_MTP_HEADS}
    else:
        target, drafts = TargetSource(checkpoint=str(tiny_salm_dir)), {"draft": export}
    settings, loaded = prepare(target, drafts, InputConfig(type="lhotse_as_conversation", cuts_path=str(demo_data[1])),
                               max_new_tokens=MAX_NEW_TOKENS, dtype="float32", limit=SAMPLES)
    report = evaluate(settings, loaded)
    counters = report.counters("draft")
    assert len(report.samples) == SAMPLES and not report.failures and counters.rounds > 10
    assert 0 < counters.accepted < counters.proposed, "parity needs accepted and rejected proposals"

    print(f"\n{variant}: training logged serving MAL {logged['val/serving_mal']:.4f} over "
          f"{logged['val/serving_rounds']:.0f} rounds; dflash-eval {counters.mal:.4f} over {counters.rounds}; "
          f"teacher-forced val accept_len {summary.val_accept_len:.4f}; {logged['val/serving_seconds']:.2f} s")
    assert summary.val_serving_mal == pytest.approx(counters.mal, rel=0, abs=1e-6)
    assert logged["val/serving_rounds"] == counters.rounds and logged["val/serving_failed"] == 0
    for position in counters.positions():
        for name, value in (("acceptance", position.rate), ("conditional", position.conditional)):
            got = logged[f"val/serving_{name}@{position.k}"]
            assert (math.isnan(got) and math.isnan(value)) or got == pytest.approx(value, abs=1e-6), (name, position)
    assert (f"validation at step {STEPS}: val accept_len {summary.val_accept_len:.4f} (teacher-forced), serving MAL "
            f"{summary.val_serving_mal:.4f}") in caplog.text
    assert f"serving MAL {summary.val_serving_mal:.4f}" in "\n".join(summary.report(_recipe(
        tiny_salm_dir, demo_data, run_dir, f"dflash={variant}")[0]))
    _the_report_shows_what_dflash_eval_measures(run_dir, summary, counters)


def _the_report_shows_what_dflash_eval_measures(run_dir, summary, counters):
    """The run report written at train end: its acceptance panel's last serving point, its validation table and
    its per-position table hold dflash-eval's figures for the export."""
    from dflash_train.training.history import read_history
    from dflash_train.training.report import acceptance_figure, per_position_figure

    assert summary.report_path == run_dir / "report.md"
    report = summary.report_path.read_text()
    history = read_history(run_dir)
    panel = acceptance_figure(history, "").axes[0]
    served = next(line for line in panel.get_lines() if line.get_label().startswith("serving MAL"))
    assert list(served.get_xdata()) == [STEPS // 2, STEPS]  # step N: after N optimizer steps
    assert served.get_ydata()[-1] == pytest.approx(counters.mal, abs=1e-6)
    forced = next(line for line in panel.get_lines() if line.get_label().startswith("val accept_len"))
    assert forced.get_ydata()[-1] == pytest.approx(summary.val_accept_len, abs=1e-6)
    assert f"| {STEPS} | {summary.val_loss:.3f} | {summary.val_accept_len:.3f} | {counters.mal:.3f} |" in report
    positions = counters.positions()
    per_position = per_position_figure(history, STEPS).axes[0].get_lines()
    for position in positions:
        rate, conditional = (f"{v:.3f}" if not math.isnan(v) else "nan" for v in (position.rate, position.conditional))
        assert f"| {position.k} | {rate} | {conditional} |" in report, position
    assert list(per_position[0].get_ydata()) == pytest.approx([p.rate for p in positions], abs=1e-6, nan_ok=True)
    assert f"`{summary.export_dir}`: the weights of step {STEPS}." in report and "serve: " in report


def test_a_checkpoint_monitored_on_serving_mal_needs_serving_validation(tiny_salm_dir, demo_data, tmp_path):
    with pytest.raises(ConfigError, match=r"^exp_manager.checkpoint_monitor=val/serving_mal needs serving validation: "
                                          r"set dflash.serving_val_samples > 0 and a data.validation_ds$"):
        _recipe(tiny_salm_dir, demo_data, tmp_path, "exp_manager.checkpoint_monitor=val/serving_mal",
                "dflash.serving_val_samples=0")
    run = _recipe(tiny_salm_dir, demo_data, tmp_path / "run", "exp_manager.checkpoint_monitor=val/serving_mal",
                  "trainer.max_steps=3", "trainer.val_check_interval=3", "exp_manager.save_top_k=1",
                  "dflash.draft_num_hidden_layers=1")
    train(run)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved[0].startswith("best-step=3-val_serving_mal=") and saved[1] == "last.ckpt", saved


def test_serving_perception_is_the_evaluators_and_leaves_the_training_perception_untouched(tiny_salm_dir, tiny_target,
                                                                                          speech_batch):
    """Inside the block the audio frames are exactly dflash-eval's (perception in bfloat16); afterwards every
    perception tensor is the very one training had, bit for bit."""
    import torch

    from dflash_train.config.schema import ModelConfig
    from dflash_train.evaluate.loading import load_target

    served = load_target(ModelConfig(pretrained_name=str(tiny_salm_dir)), "cpu", "float32", "bfloat16")
    audios, lens = speech_batch[0], speech_batch[1]
    before = {name: tensor.clone() for name, tensor in tiny_target.perception.state_dict().items()}
    trained_frames = tiny_target.encode_audio(audios, lens)
    with tiny_target.perception_as_served(torch.bfloat16):
        frames = tiny_target.encode_audio(audios, lens)
    expected = served.encode_audio(audios, lens)
    assert all(torch.equal(a, b) for a, b in zip(frames, expected)) and frames[0].dtype == torch.bfloat16
    assert not torch.equal(trained_frames[0].to(torch.bfloat16), frames[0])  # the precision changes the frames
    after = tiny_target.perception.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert tiny_target.perception_dtype is None
    assert all(torch.equal(a, b) for a, b in zip(trained_frames, tiny_target.encode_audio(audios, lens)))
