"""``make demo``: build the built-in tiny target and run the main job's start-up on it.

The demo target (a tiny random-weight NeMo SALM) is written to ``demo_assets/tiny_salm``
once. The recipe ``conf/demo.yaml`` is then validated and the target loaded and checked
exactly as ``dflash-train --config-name=demo`` does.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from dflash_train.cli import CONFIG_DIR
from dflash_train.config import validate_config

DEMO_ASSETS = Path("demo_assets")


def main() -> int:
    """Prepare demo assets, validate ``conf/demo.yaml`` and load its target; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s %(levelname)s] %(message)s")
    from dflash_train.target import load_target_for_run
    from dflash_train.testing.tiny_salm import build_tiny_salm

    target_dir = DEMO_ASSETS / "tiny_salm"
    if not (target_dir / "model.safetensors").exists():
        print(f"demo: building the tiny SALM target in {target_dir}")
        build_tiny_salm(target_dir)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="demo")
    loaded = load_target_for_run(validate_config(cfg).run)
    print(
        f"demo: target ready ({loaded.target.num_layers} blocks, hidden {loaded.target.hidden_size}, "
        f"taps {loaded.layer_ids}, mask_token_id {loaded.mask_token_id})."
    )
    print(
        "demo: set-up is complete. Draft training on the demo data is not part of this build yet "
        "(it arrives with the data and training issues); stopping here."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
