"""`dflash-train --cfg job` is the config check: every check a launch makes before the target's weights
load, failing with the launch's own line; an override typo names the nearest key; NeMo's recipe keys
compose as NeMo writes them. All rows run through the real entry point in one driver process
(tests/train_cli_rows.py); each failing row runs twice, as the check and as a launch."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli_rows

RUN_CONFIG = """\
defaults:
  - dflash
  - _self_
model:
  pretrained_name: TARGET
data:
  train_ds:
    input_cfg:
      - {type: lhotse_as_conversation, cuts_path: CUTS}
exp_manager:
  explicit_log_dir: RUN_DIR
"""

# The runbook's run config (examples/speechlm2/conf/dflash_local.yaml: `dflash` and `_self_`, the target, draft,
# data, schedule and output settings), its offline-label block merged in verbatim, and NeMo's
# `use_fused_linear_ce: false` ("leave use_fused_linear_ce=false").
RUNBOOK_LOCAL = """\
defaults:
  - dflash
  - _self_
model:
  pretrained_name: TARGET
dflash:
  variant: dflash2
  label_source: ground_truth
  use_fused_linear_ce: false
  draft_num_hidden_layers: 2
  target_layer_ids: [1, 4]
  lr: 3.0e-4
data:
  train_ds:
    input_cfg:
      - type: lhotse_as_conversation
        cuts_path: CUTS
        audio_locator_tag: ${model.audio_locator_tag}
  validation_ds:
    input_cfg:
      - {type: lhotse_as_conversation, cuts_path: CUTS, name: held_out}
    batch_tokens: 4096
exp_manager:
  exp_dir: RUN_DIR
"""

# The runbook's smoke command line after --config-name=dflash_local, with its own run directory.
RUNBOOK_SMOKE = ["trainer.devices=8", "trainer.num_nodes=1", "trainer.max_steps=25", "trainer.limit_train_batches=25",
                 "trainer.val_check_interval=25", "trainer.limit_val_batches=2",
                 "exp_manager.explicit_log_dir=SMOKE_DIR", "exp_manager.resume_if_exists=false"]

TYPO = "config error: unknown config key 'dflash.num_anchor'; did you mean 'num_anchors'?"

# (case, run config, extra arguments, the line both the check and the launch end with)
FAILING = [
    ("YAML typo", "typo", [], TYPO),
    ("override typo", "my_run", ["dflash.num_anchor=16"], TYPO),
    ("added override typo", "my_run", ["+dflash.num_anchor=16"], TYPO),
    ("duplicate taps", "my_run", ["dflash.target_layer_ids=[4,4]"],
     "config error: dflash.target_layer_ids=[4, 4] repeats a layer; list distinct ids"),
    ("tap beyond the target", "my_run", ["dflash.target_layer_ids=[1,99]"],
     "config error: dflash.target_layer_ids=[1, 99]: [99] outside the target's 6 decoder blocks (valid ids 0..5)"),
    ("missing data path", "my_run", ["data.train_ds.input_cfg.0.cuts_path=MISSING"],
     "config error: data.train_ds.input_cfg[0].cuts_path='MISSING' does not exist"),
    ("resume past max_steps", "my_run", ["exp_manager.explicit_log_dir=RESUMED", "trainer.max_steps=10"],
     "config error: trainer.max_steps=10 is below step 30, where RESUMED/checkpoints/last.ckpt resumes the run: set "
     "trainer.max_steps >= 30, or start a new run (another exp_manager.explicit_log_dir, or "
     "exp_manager.resume_if_exists=false)"),
    ("fused linear CE", "my_run", ["dflash.use_fused_linear_ce=true"],
     "config error: dflash.use_fused_linear_ce=true: NeMo's fused linear cross-entropy is not run here; the chunked "
     "loss replaces it (dflash.loss_chunk_size positions per LM-head chunk bound the logits' memory): set "
     "use_fused_linear_ce=false and size the chunks with dflash.loss_chunk_size"),
    ("monitor without serving validation", "dflash_local",
     ["exp_manager.checkpoint_monitor=val/serving_mal", "dflash.serving_val_samples=0"],
     "config error: exp_manager.checkpoint_monitor=val/serving_mal needs serving validation: set "
     "dflash.serving_val_samples > 0 and a data.validation_ds"),
    ("monitor validation does not log", "dflash_local", ["exp_manager.checkpoint_monitor=val/serving_mall"],
     "config error: exp_manager.checkpoint_monitor=val/serving_mall is not a metric this run's validation logs; set "
     "it to one of: val/dflash_loss, val/dflash_accuracy, val/valid_blocks, val/skipped_batches, val/accept_len, "
     "val_acc, val/serving_mal, val/serving_rounds, val/serving_failed, val/serving_seconds, "
     "val/serving_acceptance@1..7, val/serving_conditional@1..7"),
    ("best export without best checkpoints", "dflash_local", ["exp_manager.export_checkpoint=best",
                                                             "exp_manager.save_top_k=0"],
     "config error: exp_manager.export_checkpoint=best exports the best validated checkpoint: set "
     "exp_manager.save_top_k >= 1 and a data.validation_ds (or export_checkpoint=last)"),
]
BEFORE_COMPOSING = {"override typo"}  # refused before Hydra composes: no config is printed


@pytest.fixture(scope="module")
def rows(tiny_salm_dir, tmp_path_factory) -> tuple[dict, dict]:
    """Every row through dflash-train's entry point in one driver process: ``(paths, results by row)``."""
    root = tmp_path_factory.mktemp("config_check")
    conf = root / "conf"
    conf.mkdir()
    cuts = root / "train_cuts.jsonl"
    cuts.write_text('{"id": "utt-1"}\n')  # the check reads no record: only that the file exists and is not empty
    paths = {"TARGET": str(tiny_salm_dir), "CUTS": str(cuts), "RUN_DIR": str(root / "run"),
             "MISSING": str(root / "missing_cuts.jsonl"), "SMOKE_DIR": str(root / "smoke"),
             "RESUMED": str(root / "resumed")}
    (root / "resumed" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 30}, root / "resumed" / "checkpoints" / "last.ckpt")  # the step is all the check reads
    finished = root / "finished"
    (finished / "checkpoints").mkdir(parents=True)
    (finished / "export").mkdir()
    torch.save({"global_step": 30}, finished / "checkpoints" / "last.ckpt")
    (finished / "export" / "config.json").write_text(json.dumps({"training_info": {"global_step": 30}}))

    def fill(text: str) -> str:
        for name, value in paths.items():
            text = text.replace(name, value)
        return text

    (conf / "my_run.yaml").write_text(fill(RUN_CONFIG))
    (conf / "typo.yaml").write_text(fill(RUN_CONFIG) + "dflash:\n  num_anchor: 16\n")
    (conf / "typo_unset.yaml").write_text("defaults:\n  - dflash\n  - _self_\ndflash:\n  num_anchor: 16\n")
    (conf / "dflash_local.yaml").write_text(fill(RUNBOOK_LOCAL))
    check = ["--cfg", "job", "--resolve"]
    table = [
        ["check/valid", [f"--config-dir={conf}", "--config-name=my_run", *check]],
        ["check/finished run", [f"--config-dir={conf}", "--config-name=my_run", "trainer.max_steps=30",
                                f"exp_manager.explicit_log_dir={finished}", "--cfg", "job"]],
        ["check/typo with unset values", [f"--config-dir={conf}", "--config-name=typo_unset", "--cfg", "job"]],
        ["runbook/resolve", [f"--config-dir={conf}", "--config-name=dflash_local", *check]],
        ["runbook/smoke", [f"--config-dir={conf}", "--config-name=dflash_local", *map(fill, RUNBOOK_SMOKE),
                           "dflash.use_fused_linear_ce=false", *check]],
    ]
    for i, (case, name, extra, _) in enumerate(FAILING):
        args = [f"--config-dir={conf}", f"--config-name={name}", *map(fill, extra)]
        table.append([f"check/{case}", [*args, "--cfg", "job", *(["--resolve"] if i % 2 else [])]])
        own_dir = any(arg.startswith("exp_manager.explicit_log_dir=") for arg in extra)
        launch_dir = [] if own_dir else [f"exp_manager.explicit_log_dir={root / 'launches' / str(i)}"]  # Hydra's logs
        table.append([f"launch/{case}", [*args, "trainer=cpu", *launch_dir]])  # cpu: 20 steps, were one to start
    return paths, run_cli_rows(root, table)


@pytest.mark.parametrize("case, name, extra, line", FAILING, ids=[row[0] for row in FAILING])
def test_the_check_fails_with_the_launchs_line(rows, case, name, extra, line):
    paths, results = rows
    expected = line.replace("MISSING", paths["MISSING"]).replace("RESUMED", paths["RESUMED"])
    for mode in ("check", "launch"):
        result = results[f"{mode}/{case}"]
        assert result["code"] == 1, f"{mode}: {result['stderr'][-2000:]}"
        assert result["stderr"].strip().splitlines()[-1] == expected, f"{mode}: {result['stderr'][-2000:]}"
    printed = results[f"check/{case}"]["stdout"]
    assert ("num_anchors: 512" in printed) == (case not in BEFORE_COMPOSING), "the config is printed before the check"


def test_a_valid_run_config_passes_the_check_and_writes_nothing(rows):
    paths, results = rows
    result = results["check/valid"]
    assert result["code"] == 0, result["stderr"][-2000:]
    assert f"pretrained_name: {paths['TARGET']}" in result["stdout"]
    assert result["stderr"].strip().splitlines()[-1] == (
        "# config check passed: every check a launch makes before loading the target's weights"
    )
    assert not Path(paths["RUN_DIR"]).exists()


def test_a_finished_run_is_reported_as_the_launch_reports_it(rows):
    """A launch of a run whose export holds its last step trains nothing and checks nothing further."""
    result = rows[1]["check/finished run"]
    assert result["code"] == 0, result["stderr"][-2000:]
    assert result["stderr"].strip().splitlines()[-1].startswith(
        "# finished: the run reached trainer.max_steps=30; nothing to do"
    )


def test_unset_values_are_listed_after_the_key_check(rows):
    """A config with ``???`` left still gets the key check (a typo often leaves the key it meant unset)."""
    result = rows[1]["check/typo with unset values"]
    assert result["code"] == 1 and result["stderr"].strip().splitlines()[-1] == TYPO
    assert "num_anchors: 512" in result["stdout"]


@pytest.mark.parametrize("row", ["runbook/resolve", "runbook/smoke"])
def test_the_runbooks_run_config_and_smoke_overrides_pass_the_check(rows, row):
    result = rows[1][row]
    assert result["code"] == 0, result["stderr"][-2000:]
    assert result["stderr"].strip().splitlines()[-1].startswith("# config check passed")
    out = result["stdout"]
    assert "use_fused_linear_ce: false" in out and "label_source: ground_truth" in out and "variant: dflash2" in out
    assert "audio_locator_tag: <|audio|>" in out.split("validation_ds")[0].split("input_cfg")[1]  # resolved
    if row == "runbook/smoke":
        assert "devices: 8" in out and "max_steps: 25" in out and "resume_if_exists: false" in out
