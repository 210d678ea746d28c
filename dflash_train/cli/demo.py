"""``make demo``: the main job end to end on the built-in demo, ending with the draft's measured acceptance.

Synthesizes the demo speech set once (``demo_assets/data``, espeak-ng), then runs exactly what
``dflash-train --config-name=demo`` runs: a fresh DFlash draft trained on the stored reference
target (``benchmarks/reference_target``, a tiny NeMo SALM trained for ASR on the same kind of
speech) with the target's greedy labels, exported to ``runs/demo/export`` and verified. It writes
the vLLM-ready target to ``runs/demo/target``, prints the serve command for both, and finally
evaluates the draft on the held-out validation set with the reference speculative decoder,
printing what ``dflash-eval`` prints and writing ``runs/demo/eval.json`` and ``runs/demo/eval.png``.
It ends by pointing at the run's report, ``runs/demo/report.md`` (training curves; ``dflash-report``).
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from pathlib import Path

from dflash_train.cli.common import run_command
from dflash_train.cli.console import configure_console
from dflash_train.config import validate_config
from dflash_train.config.compose import compose_config
from dflash_train.variants import variant_named
from dflash_train.config.schema import RunConfig
from dflash_train.errors import ConfigError

DEMO_CONFIG = "demo"
DEMO_DATA = Path("demo_assets") / "data"
DEMO_MARKER = ".dflash_demo_run"
EVAL_JSON = "eval.json"


def prepare_data(run: RunConfig) -> None:
    """Synthesize the demo speech set into :data:`DEMO_DATA` when the recipe reads a file of it that is missing,
    or the set there is an earlier demo's (other sentences)."""
    from dflash_train.testing.demo_data import is_demo_set, write_demo_set

    inputs = [*run.data.train_ds.input_cfg, *(run.data.validation_ds.input_cfg if run.data.validation_ds else [])]
    wanted = [Path(i.cuts_path) for i in inputs if i.cuts_path and Path(i.cuts_path).parent == DEMO_DATA]
    if wanted and (any(not path.exists() for path in wanted) or not is_demo_set(DEMO_DATA)):
        print(f"demo: synthesizing speech with espeak-ng into {DEMO_DATA}")
        write_demo_set(DEMO_DATA)


def check_target_exists(pretrained_name: str) -> None:
    """The demo's target directory must exist: its default is relative to the repository root."""
    if not Path(pretrained_name).expanduser().is_dir():
        raise ConfigError(
            f"the demo's target model.pretrained_name={pretrained_name} does not exist under {Path.cwd()}: "
            "run the demo from the repository root (`make demo`) or pass model.pretrained_name=<SALM checkpoint dir>"
        )


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


def evaluate_on_validation(run: RunConfig, overrides: list[str], export_dir: Path, run_dir: Path) -> int:
    """Run ``dflash-eval --config-name demo OVERRIDES --draft EXPORT`` in process (an MTP export: the export as
    the target, ``--mtp``): the reference decoder on the recipe's validation set, its table printed,
    ``eval.json`` and ``eval.png`` written under ``run_dir``; returns dflash-eval's exit status."""
    from dflash_train.cli.eval import publish
    from dflash_train.evaluate.loading import TargetSource
    from dflash_train.evaluate.run import DRAFT, MTP, TARGET_MTP_HEADS, evaluate, prepare

    json_path = run_dir / EVAL_JSON
    if variant_named(run.dflash.variant).family == "mtp":  # the export is the target with its MTP heads
        overrides, drafts, draft_flags = [*overrides, f"model.pretrained_name={export_dir}"], {MTP: TARGET_MTP_HEADS}, ["--mtp"]
    else:
        drafts, draft_flags = {DRAFT: str(export_dir)}, ["--draft", str(export_dir)]
    command = ["dflash-eval", "--config-name", DEMO_CONFIG, *draft_flags, "--device", "cpu", "--json", str(json_path),
               *overrides]
    print(f"\n=== the draft on the held-out validation set (reference decoder; same as: {shlex.join(command)}) ===")
    settings, loaded = prepare(TargetSource(config_name=DEMO_CONFIG, overrides=tuple(overrides)), drafts, None,
                               device="cpu")
    return publish(evaluate(settings, loaded), json_path)


def run_demo(overrides: list[str]) -> int:
    """Train, export and evaluate the demo draft on ``conf/demo.yaml`` plus ``overrides``; the exit code."""
    from dflash_train.target.vllm_export import export_target
    from dflash_train.training.recipe import train
    from dflash_train.training.report import write_run_report

    started = time.perf_counter()
    validated = validate_config(compose_config(DEMO_CONFIG, overrides))
    check_target_exists(validated.run.model.pretrained_name)
    run_dir = Path(validated.run.exp_manager.explicit_log_dir)
    fresh_run_directory(run_dir)
    prepare_data(validated.run)
    summary = train(validated)
    target = export_target(validated.run.model.pretrained_name, run_dir / "target")
    print("\n=== dflash_train demo ===")
    for line in summary.report(validated.run, serve_target=str(target)):
        print(line)
    print(f"target (vLLM-ready): {target}")
    if summary.export_dir is None:
        return 1
    status = evaluate_on_validation(validated.run, overrides, summary.export_dir, run_dir)
    report = write_run_report(run_dir, serve_target=str(target))  # again, now with the serve command's target
    print(f"\nthe run's report (training curves, teacher-forced vs serving acceptance): {report}")
    print(f"wall time: {time.perf_counter() - started:.0f} s")
    return status


def main(overrides: list[str] | None = None) -> int:
    """Run the demo with ``overrides`` (default: the command line); one-line errors, the exit code."""
    overrides = sys.argv[1:] if overrides is None else overrides
    configure_console()
    return run_command("demo", lambda: run_demo(overrides), debug=False)


if __name__ == "__main__":
    sys.exit(main())
