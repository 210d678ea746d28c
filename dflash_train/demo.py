"""``make demo``: the main job end to end on the built-in tiny default.

Builds what the demo needs once (a tiny random-weight NeMo SALM in ``demo_assets/tiny_salm``,
a synthesized espeak-ng speech set in ``demo_assets/data``), then runs exactly what
``dflash-train --config-name=demo`` runs: a fresh DFlash2 draft trained on the target's
greedy labels, exported to ``runs/demo/export`` and verified. It also writes the
vLLM-ready target to ``runs/demo/target`` and prints the serve command for both.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from dflash_train.cli import CONFIG_DIR
from dflash_train.config import validate_config

DEMO_ASSETS = Path("demo_assets")
DEMO_RUN = Path("runs/demo")


def prepare_assets() -> None:
    """The tiny target and the demo speech data, built only when missing."""
    from dflash_train.data.demo_data import write_demo_data
    from dflash_train.testing.tiny_salm import build_tiny_salm

    target_dir = DEMO_ASSETS / "tiny_salm"
    if not (target_dir / "model.safetensors").exists():
        print(f"demo: building the tiny SALM target in {target_dir}")
        build_tiny_salm(target_dir)
    data_dir = DEMO_ASSETS / "data"
    if not (data_dir / "val_cuts.jsonl.gz").exists():
        print(f"demo: synthesizing speech with espeak-ng into {data_dir}")
        write_demo_data(data_dir)


def main(overrides: list[str] | None = None) -> int:
    """Prepare assets, train on ``conf/demo.yaml`` (plus ``overrides``), print the summary; the exit code."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s %(levelname)s] %(message)s")
    from dflash_train.export_target import export_target
    from dflash_train.train import train

    started = time.perf_counter()
    prepare_assets()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="demo", overrides=overrides or [])
    validated = validate_config(cfg)
    run_dir = Path(validated.run.exp_manager.explicit_log_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the demo is always a fresh run
    summary = train(validated)
    target = export_target(validated.run.model.pretrained_name, run_dir / "target")
    print("\n=== dflash_train demo ===")
    for line in summary.report(validated.run, serve_target=str(target)):
        print(line)
    print(f"target (vLLM-ready): {target}")
    print(f"wall time: {time.perf_counter() - started:.0f} s")
    return 0 if summary.export_dir is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
