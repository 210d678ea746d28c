"""The real entry points: `dflash-train`, `python -m dflash_train` and `torchrun -m dflash_train`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import rank_log_lines

BIN = Path(sys.executable).parent


def _run(args, cwd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_print_resolved_config_exits_zero_and_names_missing_values(tmp_path):
    proc = _run([sys.executable, "-m", "dflash_train", "--config-name=dflash", "--cfg", "job", "--resolve"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "block_size: 8" in proc.stdout and "variant: dflash2" in proc.stdout
    assert "name: dflash" in proc.stdout  # ${name} interpolation resolved in exp_manager
    assert "mandatory values not set (???): model.pretrained_name, data.train_ds.input_cfg" in proc.stderr
    assert list(tmp_path.iterdir()) == [], "printing the config must not start a run"


def test_console_script_rejects_bad_key_in_one_line(tmp_path):
    proc = _run([str(BIN / "dflash-train"), "model.pretrained_name=/x", "data.train_ds.input_cfg=[]",
                 "+dflash.num_anchor=3"], tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: unknown config key 'dflash.num_anchor'; did you mean 'num_anchors'?"
    )


def test_torchrun_launches_the_module_on_every_rank(tiny_salm_dir, tmp_path):
    cuts = tmp_path / "cuts.jsonl"
    cuts.write_text('{"id": "utt-1"}\n')  # the config check reads no record
    proc = _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dflash_train",
                 "--config-name=dflash", "--cfg", "job", f"model.pretrained_name={tiny_salm_dir}",
                 f"data.train_ds.input_cfg=[{{type: lhotse_as_conversation, cuts_path: {cuts}}}]"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("num_anchors: 512") == 2
    assert proc.stderr.count("# config check passed") == 2


def _demo_args(salm_dir, demo_data, run_dir):
    train_cuts, val_cuts = demo_data
    return [
        "--config-name=demo",
        f"model.pretrained_name={salm_dir}",
        f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
        f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}",
        "data.train_ds.bucket_estimate_samples=20",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]


def test_cli_rejects_taps_outside_the_target_before_loading_it(tiny_salm_dir, demo_data, tmp_path):
    bad = _run([str(BIN / "dflash-train"), *_demo_args(tiny_salm_dir, demo_data, tmp_path / "run"),
                "dflash.target_layer_ids=[1,7]"], tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "config error: dflash.target_layer_ids=[1, 7]: [7] outside the target's 6 decoder blocks (valid ids 0..5)"
    )


def test_cli_missing_data_path_fails_at_start(tiny_salm_dir, demo_data, tmp_path):
    args = _demo_args(tiny_salm_dir, demo_data, tmp_path / "run")
    args[2] = f"data.train_ds.input_cfg.0.cuts_path={tmp_path / 'nope.jsonl.gz'}"
    proc = _run([str(BIN / "dflash-train"), *args], tmp_path)
    assert proc.returncode == 1
    assert f"cuts_path='{tmp_path / 'nope.jsonl.gz'}' does not exist" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_cli_trains_on_speech_data_and_exports(tiny_salm_dir, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = _run([str(BIN / "dflash-train"), *_demo_args(tiny_salm_dir, demo_data, run_dir)], tmp_path, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "steps: 3; final train loss" in out
    assert f"export: {run_dir / 'export'}" in out
    assert '"num_speculative_tokens": 7' in out
    assert (run_dir / "export" / "model.safetensors").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert f"report: {run_dir / 'report.md'}" in out and (run_dir / "report" / "acceptance.png").is_file()
    # the console (cli/console.py): no third-party notice that needs no action, each line once
    assert [line for line in out.splitlines() if "warn" in line.lower()] == []
    assert out.count("Seed set to") == 1 and out.count("Trainable params") == 1


def test_torchrun_trains_with_two_fsdp2_ranks(tiny_salm_dir, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dflash_train",
                 *_demo_args(tiny_salm_dir, demo_data, run_dir), "trainer.devices=2",
                 "trainer.strategy.name=fsdp2"], tmp_path, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = proc.stdout + proc.stderr
    assert out.count("steps: 3; final train loss") == 1, "rank 0 reports the run on the console, once"
    assert out.count(f"export: {run_dir / 'export'}") == 1 and "no final export" not in out
    logs = rank_log_lines(tmp_path, "steps: 3; final train loss")
    assert [len(logs.get(rank, [])) for rank in (0, 1)] == [1, 1], "each rank's log file keeps its own lines"
    assert (run_dir / "export" / "model.safetensors").exists()


def test_user_config_dir_inherits_the_recipe(tmp_path):
    """The run config is printed whole, then checked as a launch checks it (its data path does not exist here)."""
    (tmp_path / "my_run.yaml").write_text(
        "defaults:\n  - dflash\n  - _self_\nmodel:\n  pretrained_name: /ckpt/my_salm\n"
        "data:\n  train_ds:\n    input_cfg:\n      - {type: lhotse_as_conversation, cuts_path: /data/t.jsonl.gz}\n"
    )
    proc = _run([str(BIN / "dflash-train"), f"--config-dir={tmp_path}", "--config-name=my_run", "--cfg", "job",
                 "--resolve"], tmp_path)
    assert "pretrained_name: /ckpt/my_salm" in proc.stdout and "num_anchors: 512" in proc.stdout
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "config error: data.train_ds.input_cfg[0].cuts_path='/data/t.jsonl.gz' does not exist"
    ), proc.stderr[-2000:]
    assert "mandatory" not in proc.stderr


def test_the_demo_deletes_only_a_run_directory_it_made(tmp_path):
    from dflash_train.cli.demo import DEMO_MARKER, fresh_run_directory
    from dflash_train.errors import ConfigError

    foreign = tmp_path / "real_run"
    (foreign / "checkpoints").mkdir(parents=True)
    (foreign / "checkpoints" / "last.ckpt").write_text("weeks of training")
    with pytest.raises(ConfigError, match="explicit_log_dir=.*real_run exists and was not made by the demo"):
        fresh_run_directory(foreign)
    assert (foreign / "checkpoints" / "last.ckpt").read_text() == "weeks of training"

    demo_run = tmp_path / "demo"
    fresh_run_directory(demo_run)
    (demo_run / "old_export").mkdir()
    fresh_run_directory(demo_run)
    assert sorted(p.name for p in demo_run.iterdir()) == [DEMO_MARKER]


SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "dflash_train.py"


def test_the_runbook_entry_script_prints_the_resolved_config_from_any_directory(tmp_path):
    proc = _run([sys.executable, str(SCRIPT), "--config-name=dflash", "--cfg", "job", "--resolve"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "variant: dflash2" in proc.stdout and "num_anchors: 512" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_runbook_torchrun_command_line_trains_on_two_processes(tiny_salm_dir, demo_data, tmp_path):
    """The runbook's line verbatim (its keys and values), pointed at the demo target and data."""
    train_cuts, val_cuts = demo_data
    run_dir = tmp_path / "run"
    proc = _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(SCRIPT), "--config-name=demo",
                 "trainer.devices=2", "trainer.num_nodes=1", "trainer.max_steps=25", "trainer.limit_train_batches=25",
                 "trainer.val_check_interval=25", "trainer.limit_val_batches=2",
                 f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.resume_if_exists=false",
                 f"model.pretrained_name={tiny_salm_dir}", f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
                 f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}", "data.train_ds.bucket_estimate_samples=20",
                 f"exp_manager.exp_dir={tmp_path / 'exp'}"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors").exists()
    assert "steps: 25;" in proc.stderr + proc.stdout


OFFLINE_LABEL_RECIPE = """\
# The runbook's offline-label recipe: DFlash2 trained on the target's own replies (written by dflash-labels)
defaults:
  - dflash
  - override dflash: dflash2
  - _self_

model:
  pretrained_name: {target}
  audio_locator_tag: "<|audio|>"

data:
  train_ds:
    input_cfg:
      - type: lhotse_as_conversation
        cuts_path: {labels}
        audio_locator_tag: "<|audio|>"
        weight: 1.0
        tags:
          context: "Transcribe the audio."
    use_multimodal_sampling: true
    batch_tokens: 1024
    max_tokens: 160
    bucket_estimate_samples: 20

dflash:
  label_source: ground_truth
"""


def test_the_runbook_offline_label_recipe_trains_two_steps(tiny_salm_dir, demo_data, tmp_path):
    """The recipe block as a user saves it next to their runs, launched with the runbook's entry script."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "offline_labels.yaml").write_text(OFFLINE_LABEL_RECIPE.format(target=tiny_salm_dir, labels=demo_data[0]))
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, str(SCRIPT), f"--config-dir={conf}", "--config-name=offline_labels", "trainer=cpu",
                 "trainer.precision=32-true", "trainer.max_steps=2", "dflash.draft_num_hidden_layers=1",
                 "data.validation_ds=null", f"exp_manager.explicit_log_dir={run_dir}",
                 f"exp_manager.exp_dir={tmp_path / 'exp'}"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = (run_dir / "resolved_config.yaml").read_text()
    assert "variant: dflash2" in resolved and "label_source: ground_truth" in resolved
    assert "steps: 2;" in proc.stderr + proc.stdout and (run_dir / "export" / "model.safetensors").exists()

    wrong_tag = OFFLINE_LABEL_RECIPE.replace('        audio_locator_tag: "<|audio|>"', '        audio_locator_tag: "<audio>"')
    (conf / "offline_labels.yaml").write_text(wrong_tag.format(target=tiny_salm_dir, labels=demo_data[0]))
    proc = _run([sys.executable, str(SCRIPT), f"--config-dir={conf}", "--config-name=offline_labels", "trainer=cpu",
                 f"exp_manager.explicit_log_dir={tmp_path / 'refused'}"], tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "config error: data.train_ds.input_cfg[0].audio_locator_tag='<audio>' differs from "
        "model.audio_locator_tag='<|audio|>' (the target's audio placeholder); make them equal"
    ), proc.stderr[-2000:]
