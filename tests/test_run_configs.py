"""The run configs in the repository's top-level ``conf/`` (one per public target): every file composes with the
packaged recipe, leaves exactly the checkpoint and data paths for the user to set, passes every check a launch
makes with those paths pointing at a tiny target of the same structure, and trains a few steps through the
real CLI against it.

A new file in ``conf/`` is covered without touching this module (the list is a glob); its tiny target is
chosen by the target family the config selects (``model.use_nemo_automodel``: a Nemotron-H SpeechLM, else a
NeMo SALM) and shaped by the config's own taps.

The CPU training run adds only ``trainer=cpu trainer.devices=1 trainer.strategy.ep_size=1`` (a CPU process is
one rank, and expert parallelism must divide the world size) and a few-steps budget (``trainer.max_steps``,
``trainer.val_check_interval``, ``trainer.limit_val_batches``, ``dflash.serving_val_samples`` /
``serving_val_max_new_tokens`` and the batches' ``batch_tokens`` / ``max_tokens`` / ``num_workers``) to what the
configs set.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_train.config import missing_keys
from dflash_train.config.compose import compose_config

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF = REPO_ROOT / "conf"
BIN = Path(sys.executable).parent
RUN_CONFIGS = sorted(path.stem for path in CONF.glob("*.yaml"))

# What a user must set, and all a test may set besides the CPU overrides: checkpoint and data paths.
PLACEHOLDERS = {
    "model.pretrained_name",
    "data.train_ds.input_cfg[0].cuts_path",
    "data.validation_ds.input_cfg[0].cuts_path",
}
CPU_OVERRIDES = ["trainer=cpu", "trainer.devices=1", "trainer.strategy.ep_size=1"]
# A few small steps: the configs' token budgets (4096-8192 positions: 40-80 of the demo's ~100-position rows,
# a minute a step on 2 CPU cores) cut to two rows per batch, one validation batch, one serving decode of 8
# tokens, the batches read in the main process.
FEW_STEPS = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
             "dflash.serving_val_samples=1", "dflash.serving_val_max_new_tokens=8",
             *(f"data.{split}.{key}=256" for split in ("train_ds", "validation_ds")
               for key in ("batch_tokens", "max_tokens")), "data.train_ds.num_workers=0"]


def test_conf_holds_the_public_targets():
    assert {"canary_qwen_2_5b", "nemotron_lightning_speechlm"} <= set(RUN_CONFIGS), RUN_CONFIGS


def _structure(name: str):
    """The composed config as a user gets it (no override): its target family and taps."""
    cfg = compose_config(name, [], config_dir=CONF)
    return cfg, bool(cfg.model.get("use_nemo_automodel")), list(cfg.dflash.target_layer_ids or [])


@pytest.fixture(scope="module")
def tiny_targets(tmp_path_factory):
    """One tiny target per structure, built on first use: ``get(name) -> checkpoint dir``."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        _, nemotron_h, taps = _structure(name)
        key = "nemotron_h" if nemotron_h else f"salm{max(taps, default=5) + 3}"
        if key not in built:
            out = tmp_path_factory.mktemp(key) / "target"
            built[key] = _tiny_lightning(out) if nemotron_h else _tiny_canary_qwen(out, max(taps, default=5) + 3)
        return built[key]

    return get


def _tiny_lightning(out: Path) -> Path:
    """Nemotron 3.5 Lightning's structure at tiny width (the builder's ``--preset lightning``: 52 blocks of
    Lightning's kinds and proportions, MoE with a shared expert, 2 KV heads, MTP heads, nemotron-nano-v3)."""
    from dflash_train.testing.tiny_mtp_salm import LIGHTNING, build_tiny_mtp_salm

    return build_tiny_mtp_salm(out, LIGHTNING)


def _tiny_canary_qwen(out: Path, layers: int) -> Path:
    """canary-qwen-2.5b's structure at tiny width: FastConformer -> one linear projection -> Qwen3 with tied
    embeddings and nonzero LoRA adapters, ``layers`` blocks (28 for canary's taps), GQA 2:1 as Qwen3-1.7B's
    16/8; its config.json names canary's audio tag, which SALM adds to the tokenizer as canary-qwen's does."""
    from dflash_train.testing.tiny_salm import TinySALMSpec, build_tiny_salm

    spec = TinySALMSpec(num_hidden_layers=layers, tie_word_embeddings=True, linear_projection=True,
                        lora_rank=4, lora_alpha=8.0)
    build_tiny_salm(out, spec)
    config = json.loads((out / "config.json").read_text())
    config["audio_locator_tag"] = "<|audioplaceholder|>"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _paths(target: Path, demo_data) -> list[str]:
    train_cuts, val_cuts = demo_data
    return [f"model.pretrained_name={target}",
            f"data.train_ds.input_cfg.0.cuts_path={train_cuts}",
            f"data.validation_ds.input_cfg.0.cuts_path={val_cuts}"]


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_a_run_config_leaves_only_paths_unset_and_passes_the_launch_checks(name, tiny_targets, demo_data, tmp_path):
    """As a user gets it: the packaged recipe under it, only checkpoint and data paths unset; with those set
    (to a tiny target of its structure), every check a launch makes before loading weights passes at the
    config's own topology (8 devices, its ep_size)."""
    from dflash_train.cli.train import check_before_loading

    cfg, _, taps = _structure(name)
    assert set(missing_keys(cfg)) == PLACEHOLDERS, f"{name}: unset keys {missing_keys(cfg)}"
    assert cfg.dflash.variant == "dflash2" and cfg.trainer.devices == 8, "the recipe's draft, one 8-GPU node"
    assert taps, f"{name}: taps chosen for the target, not derived"
    cfg = compose_config(name, [*_paths(tiny_targets(name), demo_data),
                                f"exp_manager.explicit_log_dir={tmp_path / 'run'}"], config_dir=CONF)
    assert check_before_loading(cfg) is None  # raises on any violated rule; None: a fresh run would start


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_a_run_config_trains_against_a_tiny_target_of_its_structure(name, tiny_targets, demo_data, tmp_path):
    """``dflash-train --config-dir conf --config-name=<name>`` from the repository root with the paths set and
    the CPU overrides: it trains, validates and exports a draft tapping the config's blocks."""
    _, _, taps = _structure(name)
    run_dir = tmp_path / "run"
    started = time.perf_counter()
    proc = subprocess.run(
        [str(BIN / "dflash-train"), "--config-dir", "conf", f"--config-name={name}",
         *_paths(tiny_targets(name), demo_data), *CPU_OVERRIDES, *FEW_STEPS,
         f"exp_manager.explicit_log_dir={run_dir}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    wall = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == taps
    assert config["training_info"]["global_step"] == 2, config["training_info"]
    print(f"{name}: {wall:.1f} s")
