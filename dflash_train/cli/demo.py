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

from dflash_train.config import validate_config
from dflash_train.config.compose import compose_config
from dflash_train.errors import ConfigError

DEMO_ASSETS = Path("demo_assets")
DEMO_MARKER = ".dflash_demo_run"


def prepare_assets() -> None:
    """The tiny target and the demo speech data, built only when missing."""
    from dflash_train.testing.demo_data import write_demo_data
    from dflash_train.testing.tiny_salm import build_tiny_salm

    target_dir = DEMO_ASSETS / "tiny_salm"
    if not (target_dir / "model.safetensors").exists():
        print(f"demo: building the tiny SALM target in {target_dir}")
        build_tiny_salm(target_dir)
    data_dir = DEMO_ASSETS / "data"
    if not (data_dir / "val_cuts.jsonl.gz").exists():
        print(f"demo: synthesizing speech with espeak-ng into {data_dir}")
        write_demo_data(data_dir)


def fresh_run_directory(run_dir: Path) -> None:
    """Make ``run_dir`` empty for a fresh demo run, deleting it only if an earlier demo made it.

    The demo marks its run directory with :data:`DEMO_MARKER`; any other existing directory
    (a real run, a typo in ``exp_manager.explicit_log_dir``) is a :class:`ConfigError`, untouched.
    """
    if run_dir.exists():
        if not (run_dir / DEMO_MARKER).is_file():
            raise ConfigError(
                f"exp_manager.explicit_log_dir={run_dir} exists and was not made by the demo; "
                "remove it yourself or point the demo elsewhere"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / DEMO_MARKER).write_text("written by dflash_train's demo; the demo deletes this directory on its next run\n")


def main(overrides: list[str] | None = None) -> int:
    """Prepare assets, train on ``conf/demo.yaml`` (plus ``overrides``, default: the command line),
    print the summary; the exit code."""
    overrides = sys.argv[1:] if overrides is None else overrides
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s %(levelname)s] %(message)s")
    from dflash_train.target.vllm_export import export_target
    from dflash_train.training.recipe import train

    started = time.perf_counter()
    prepare_assets()
    validated = validate_config(compose_config("demo", overrides))
    run_dir = Path(validated.run.exp_manager.explicit_log_dir)
    try:
        fresh_run_directory(run_dir)
    except ConfigError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    summary = train(validated)
    target = export_target(validated.run.model.pretrained_name, run_dir / "target")
    print("\n=== dflash_train demo ===")
    for line in summary.report(validated.run, serve_target=str(target)):
        print(line)
    print(f"target (vLLM-ready): {target}")
    print(f"wall time: {time.perf_counter() - started:.0f} s")
    return 0 if summary.export_dir is not None else 1


if __name__ == "__main__":
    sys.exit(main())
