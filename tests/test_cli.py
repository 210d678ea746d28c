"""The real entry points: `dflash-train`, `python -m dflash_train` and `torchrun -m dflash_train`."""

import os
import subprocess
import sys
from pathlib import Path

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


def test_torchrun_launches_the_module_on_every_rank(tmp_path):
    proc = _run([str(BIN / "torchrun"), "--nproc_per_node=2", "--master_port=29533", "-m", "dflash_train",
                 "--config-name=dflash", "--cfg", "job", "model.pretrained_name=/x", "data.train_ds.input_cfg=[]"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("num_anchors: 512") == 2


def test_cli_loads_the_real_target_and_checks_taps(tiny_salm_dir, tmp_path):
    base = [str(BIN / "dflash-train"), f"model.pretrained_name={tiny_salm_dir}", "data.train_ds.input_cfg=[]",
            "trainer.precision=32-true", "dflash.draft_num_hidden_layers=2", f"exp_manager.exp_dir={tmp_path}"]
    bad = _run(base + ["dflash.target_layer_ids=[1,7]"], tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "config error: dflash.target_layer_ids=[1, 7]: [7] outside the target's 6 decoder blocks (valid ids 0..5)"
    )
    ok = _run(base, tmp_path)
    assert "target ready: 6 decoder blocks, hidden 64, vocab 384, taps [1, 3], mask_token_id 320" in ok.stdout + ok.stderr
    assert ok.returncode == 1 and "nothing was trained" in ok.stderr
