"""The smoke run: the user's recipe trained three times into a fresh directory, then checked.

1. ``straight``: ``trainer.max_steps=N`` uninterrupted, validating and checkpointing every N/2 steps (the
   figures, and the weights the resumed run must reproduce);
2. ``resumed`` stopped: the same launch, stopped after step N/2 once its checkpoint is written (as a
   preempted job stops);
3. ``resumed``: the same launch again with ``exp_manager.resume_if_exists=true``, to step N; its export is
   reloaded strictly and compared.

Each is :func:`~dflash_train.training.recipe.train` on the user's composed recipe with a few keys
forced (:func:`phase_overrides`): the run directory, the step budget, the schedule of validation and
checkpoints, the export's place and no external loggers. Every rank runs this; rank 0 writes the
report (``smoke.json``, ``smoke.md``) into the out directory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from omegaconf import DictConfig

from dflash_train.config.compose import compose_config
from dflash_train.config.validate import ValidatedConfig, validate_config
from dflash_train.errors import ConfigError
from dflash_train.smoke.checklist import (FitRun, Item, checkpoint_shards, export_item, figures, finite_item, gpu_key,
                                          markdown, report_dict, resume_item, saved_state,
                                          shards_item, skips_item, steps_item, trainable_item, validation_item)
from dflash_train.smoke.meter import SmokeMeter, planted_faults
from dflash_train.training.launch import launch_stamp

log = logging.getLogger(__name__)

DEFAULT_STEPS = 25


@dataclass(frozen=True)
class SmokeRequest:
    """What ``dflash-smoke`` was asked: the recipe as ``dflash-train`` takes it, the step budget, the out directory."""

    config_name: str
    overrides: tuple[str, ...] = ()
    config_dir: Optional[Path] = None
    steps: int = DEFAULT_STEPS
    out: Optional[Path] = None


def user_recipe(request: SmokeRequest) -> ValidatedConfig:
    """The recipe exactly as ``dflash-train`` with the same arguments would run it."""
    return validate_config(compose_config(request.config_name, request.overrides, request.config_dir))


def out_directory(request: SmokeRequest, run_dir: Path, rank: int) -> Path:
    """``--out``, else ``<run dir>-smoke-<launch stamp>`` beside the run directory; never the run directory or a
    path inside it, and (checked on rank 0, before any rank writes) never an existing non-empty directory."""
    if request.steps < 2:
        raise ConfigError(f"--steps {request.steps}: the smoke stops and resumes half-way; give at least 2 (default "
                          f"{DEFAULT_STEPS})")
    run_dir = run_dir.resolve()
    out = (request.out or run_dir.parent / f"{run_dir.name}-smoke-{launch_stamp()}").resolve()
    if out == run_dir or run_dir in out.parents:
        raise ConfigError(f"--out {out} is the run directory {run_dir} or inside it: the smoke never writes into a real "
                          "run; pass a directory beside it (or leave --out out)")
    if out in run_dir.parents:
        raise ConfigError(f"--out {out} holds the run directory {run_dir}; pass a fresh directory beside it")
    if rank == 0 and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty: the smoke writes into a fresh directory; pass a new path "
                          "or remove it")
    return out


def phase_overrides(request: SmokeRequest, run_dir: Path, resume: bool) -> list[str]:
    """The user's overrides, then the smoke's: its run directory and step budget, validation and a checkpoint every
    N/2 steps, the export under the run directory (of the last step), no external loggers."""
    half = max(1, request.steps // 2)
    forced = [
        f"exp_manager.explicit_log_dir={run_dir}",
        f"trainer.max_steps={request.steps}",
        f"trainer.val_check_interval={half}",
        f"exp_manager.checkpoint_every_n_steps={half}",
        f"exp_manager.resume_if_exists={str(resume).lower()}",
        "exp_manager.resume_ignore_no_checkpoint=false",
        "exp_manager.create_wandb_logger=false",
        "exp_manager.create_mlflow_logger=false",
        "dflash.output_dir=export",
        "exp_manager.export_checkpoint=last",
    ]
    return ["trainer.limit_val_batches=2", *request.overrides, *forced]


class StopAt(L.Callback):
    """Stops the fit once ``step`` is reached (its checkpoint written at that step's end), as a preempted job stops."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _fit(request: SmokeRequest, name: str, run_dir: Path, resume: bool, meter: SmokeMeter, *extra: L.Callback,
         after: Optional[FitRun] = None) -> FitRun:
    """One fit of the recipe into ``run_dir``; not run (and failed) when the fit it continues, ``after``, failed."""
    from dflash_train.training.recipe import train

    fit = FitRun(name, run_dir, meter.record, request.steps)
    if after is not None and after.error is not None:
        fit.error = f"not run: the {after.name} fit failed"
        return fit
    validated = validate_config(compose_config(request.config_name, phase_overrides(request, run_dir, resume),
                                               request.config_dir))
    meter.run = validated.run
    try:
        train(validated, callbacks=(meter, *extra))
    except Exception as err:  # noqa: BLE001 - a failing fit is the checklist's evidence (a missing shard, ...)
        fit.error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        log.error("smoke: the %s fit failed: %s", name, fit.error)
    return fit


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class SmokePlan:
    """A checked request: the user's recipe, the fresh out directory, the planted faults (tests)."""

    request: SmokeRequest
    user: ValidatedConfig
    out: Path
    faults: frozenset[str]

    def first_fit(self) -> DictConfig:
        """The first fit's composed recipe (what ``dflash-smoke`` checks before loading anything, as ``dflash-train``
        does)."""
        return compose_config(self.request.config_name, phase_overrides(self.request, self.out / "straight", False),
                              self.request.config_dir)


def plan_smoke(request: SmokeRequest) -> SmokePlan:
    """Everything checkable before a weight loads: the step budget, the faults named, the recipe, the out directory."""
    import os

    from dflash_train.training.recipe import run_directory

    faults = planted_faults()
    user = user_recipe(request)
    return SmokePlan(request, user, out_directory(request, run_directory(user.run), int(os.environ.get("RANK", "0"))),
                     faults)


def run_smoke(plan: SmokePlan) -> int:
    """Train, stop, resume, export and check; writes ``smoke.json`` and ``smoke.md`` (rank 0) and returns the exit
    code: 0 when every item passed, 1 when one failed (the table names it)."""
    started = time.perf_counter()
    request, user, out, faults = plan.request, plan.user, plan.out, plan.faults
    world = _world_size()
    straight_meter = SmokeMeter(user.run, faults=faults)
    straight = _fit(request, "straight", out / "straight", False, straight_meter)
    shards = []
    if _rank() == 0:
        last = out / "straight" / "checkpoints" / "last.ckpt"
        if "missing_shard" in faults:
            _delete_one_file(last)
        shards.append(checkpoint_shards(last, world))
    half = max(1, request.steps // 2)
    stopped_meter = SmokeMeter(user.run, count_syncs=True, faults=faults)
    stopped = _fit(request, "stopped", out / "resumed", False, stopped_meter, StopAt(half), after=straight)
    stopped.expected_steps = half
    saved = None
    if _rank() == 0:
        checkpoint = out / "resumed" / "checkpoints" / "last.ckpt"
        shards.append(checkpoint_shards(checkpoint, world))
        saved = saved_state(checkpoint)
    resumed_meter = SmokeMeter(user.run, faults=faults, verify_export=True, resumed=True)
    resumed = _fit(request, "resumed", out / "resumed", True, resumed_meter, after=stopped)
    if _rank() != 0:
        return 0
    fits = [straight, stopped, resumed]
    on_cuda = torch.cuda.is_available() and str(user.trainer_kwargs.get("accelerator", "auto")) in ("auto", "gpu", "cuda")
    items: list[Item] = [
        finite_item(fits), trainable_item(fits), steps_item(fits), skips_item(fits), validation_item(fits),
        shards_item(shards, world), resume_item(saved, resumed, straight, exact=not on_cuda), export_item(resumed),
    ]
    device = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    figs = figures(straight.record, stopped.record, straight.record.params, world, device if on_cuda else None)
    figs.plan, plan_note = plan_prediction(user, world, device if on_cuda else None)
    context = {"recipe": request.config_name, "overrides": list(request.overrides), "config_dir": str(request.config_dir)
               if request.config_dir else None, "steps": request.steps, "world_size": world, "device": device,
               "out": str(out), "planted_faults": sorted(faults), "wall_s": round(time.perf_counter() - started, 1),
               "plan_note": plan_note}
    report = report_dict(items, figs, context)
    (out / "smoke.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(items, figs, context)
    (out / "smoke.md").write_text(text)
    print(text, flush=True)
    failed = report["failed"]
    if failed:
        print(f"dflash-smoke: FAILED: {', '.join(failed)} (see {out / 'smoke.md'})", flush=True)
    return 1 if failed else 0


def _delete_one_file(checkpoint: Path) -> None:
    """The planted ``missing_shard`` fault: a distributed checkpoint loses its last shard, a single file goes."""
    victim = sorted(checkpoint.glob("*.distcp"))[-1] if checkpoint.is_dir() else checkpoint
    victim.unlink()


def plan_prediction(user: ValidatedConfig, world_size: int, device_name: Optional[str]) -> tuple[dict, str]:
    """``dflash-plan``'s prediction (:func:`~dflash_train.plan.plan_run`, bounds: roofline step time, tokens/s and
    MFU, the counted peak memory) of each figure for this recipe on this GPU, keyed as :func:`markdown` shows them,
    and a note saying where they come from. Empty on a CPU or a GPU the planner has no figures for: its bounds are
    a GPU's. Rank 0 calls it alone, after the fits: the launch's process group (which the fits leave initialised) is
    destroyed first, since the planner runs the step over a fake process group of its own."""
    import torch.distributed as dist

    from dflash_train.plan import plan_run

    key = gpu_key(device_name)
    if key is None:
        where = device_name or "CPU"
        return {}, f"dflash-plan's predictions: not shown (the planner bounds GPU runs; this one ran on {where})"
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    try:
        plan = plan_run(user, key, world_size, gpus_per_node=max(1, torch.cuda.device_count()))
    except Exception as err:  # noqa: BLE001 - the smoke's verdict stands without the plan beside it
        return {}, f"dflash-plan's predictions: not shown (the planner failed: {type(err).__name__}: {err})"
    seconds = plan.roofline_seconds
    predicted = {"target": seconds.get("perception", 0.0) + seconds.get("target", 0.0),
                 "draft_forward": seconds.get("draft_forward", 0.0) + seconds.get("loss", 0.0),
                 "backward": seconds.get("backward", 0.0), "optimizer": seconds.get("optimizer", 0.0),
                 "step_s": plan.step_seconds, "tokens_per_s": plan.tokens_per_second, "mfu": plan.mfu,
                 "peak_allocated_gib": plan.peak_bytes / 2**30}
    return predicted, (f"plan: dflash-plan's bounds on {plan.gpu_figures['name']} (roofline per phase, perception in "
                       "target and the loss in draft forward; counted peak memory without the allowance); a measured/plan "
                       "ratio above 1 is time the bound does not see")
