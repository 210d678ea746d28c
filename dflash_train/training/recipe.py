"""The training recipe: from a validated config to a trained, exported, verified draft.

Order matters for users: every check that can fail fast (config, data paths, taps, mask
token, attention backend) runs before the target's weights load or a process group forms.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from dflash_train.atomic import AtomicCheckpointIO, atomic_directory
from dflash_train.config.schema import LIGHTNING_PRECISION, RunConfig
from dflash_train.config.validate import ValidatedConfig
from dflash_train.draft.build import DraftSpec
from dflash_train.draft.family import family_of, serving_lines
from dflash_train.errors import ConfigError, InputFileError
from dflash_train.files import check_writable_directory
from dflash_train.target import load_target_for_run
from dflash_train.training.checkpoint_choice import choose_export
from dflash_train.training.history import METRICS_DIR, keep_earlier_launch
from dflash_train.training.launch import run_directory_of
from dflash_train.training.lifecycle import (FinishedRun, StepCounters, ValidationRecord, check_launch,
                                             validation_schedule)
from dflash_train.training.module import DFlashDraftModule, ModuleSettings, OptimSettings
from dflash_train.training.preemption import PreemptionCheckpoint
from dflash_train.training.provenance import ProvenanceRecord, target_weights_file
from dflash_train.training.serving_anchors import ServingAnchorMiner, ServingAnchorSettings
from dflash_train.training.serving_validation import ServingValidation, ServingValidationSettings
from dflash_train.variants import variant_named

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    """What a finished (or interrupted) run leaves behind."""

    run_dir: Path
    steps: int
    train_loss: Optional[float]
    val_loss: Optional[float]
    val_accept_len: Optional[float]
    export_dir: Optional[Path]
    resumed_from: Optional[Path]
    skipped: dict[str, float]
    stopped_by: Optional[str] = None  # the signal that preempted the run (it saved a checkpoint)
    val_serving_mal: Optional[float] = None  # serving's pooled MAL at the last validation (serving validation on)
    report_path: Optional[Path] = None  # report.md with the training curves (rank 0; training/report.py)
    finished: Optional[FinishedRun] = None  # a re-run of a run that had finished: nothing was trained
    exported: Optional[str] = None  # which checkpoint the export holds, and why (training/checkpoint_choice.py)

    def report(self, run: RunConfig, serve_target: Optional[str] = None) -> list[str]:
        """Readable end-of-run summary, with the exact serve command when an export exists."""
        if self.finished is not None:
            return ([f"run directory: {self.run_dir}"] + self.finished.report()
                    + serving_lines(variant_named(run.dflash.variant), run.dflash, self.finished.export_dir, serve_target))

        def fmt(value: Optional[float]) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        lines = [
            f"run directory: {self.run_dir}" + (f" (resumed from {self.resumed_from})" if self.resumed_from else ""),
            f"steps: {self.steps}; final train loss {fmt(self.train_loss)}; val loss {fmt(self.val_loss)}; "
            f"val accept_len {fmt(self.val_accept_len)} (teacher-forced), serving MAL {fmt(self.val_serving_mal)}",
            "skipped samples: " + (", ".join(f"{k} {int(v)}" for k, v in self.skipped.items() if v) or "none"),
        ]
        if self.report_path is not None:
            lines.append(f"report: {self.report_path} (curves of loss, teacher-forced and serving acceptance)")
        if self.stopped_by is not None:
            lines.append(
                f"preempted by {self.stopped_by} at step {self.steps}: saved {self.run_dir / 'checkpoints' / 'last.ckpt'}; "
                "no export; run the same command (exp_manager.resume_if_exists=true) to continue"
            )
            return lines
        if self.export_dir is None:
            lines.append("no final export (training did not finish); resume from the last checkpoint")
            return lines
        lines.append(f"export: {self.export_dir}" + (f" ({self.exported})" if self.exported else ""))
        return lines + serving_lines(variant_named(run.dflash.variant), run.dflash, self.export_dir, serve_target)


def run_directory(run: RunConfig) -> Path:
    """``exp_manager.explicit_log_dir``, else ``exp_dir/name[/version]``."""
    em = run.exp_manager
    return run_directory_of(em.explicit_log_dir, em.exp_dir, em.name, em.version)


def resolve_attention_backend(requested: Optional[str], accelerator: str) -> str:
    """``flex_attention`` on GPU, ``sdpa`` on CPU; a CPU run asking for flex is a config error."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if requested is None:
        return "flex_attention" if on_gpu else "sdpa"
    if requested == "flex_attention" and not on_gpu:
        raise ConfigError(
            "dflash.attention_backend=flex_attention needs a GPU (its backward is GPU-only); "
            "set dflash.attention_backend=sdpa or null for CPU runs"
        )
    return requested


def data_parallel_size(run: RunConfig, trainer_kwargs: dict) -> int:
    """All processes are data parallel: ``dp_size``, else the launcher's world size, else devices × nodes."""
    if run.trainer.strategy.dp_size:
        return run.trainer.strategy.dp_size
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    devices, nodes = trainer_kwargs.get("devices", "auto"), int(trainer_kwargs.get("num_nodes", 1))
    if isinstance(devices, int):
        return devices * nodes
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if devices == "auto" and not torch.cuda.is_available():
        return nodes
    if devices == "auto":
        return torch.cuda.device_count() * nodes
    raise ConfigError(f"cannot infer the data-parallel size from trainer.devices={devices}; set trainer.strategy.dp_size")


def build_strategy(run: RunConfig, accelerator: str, trainer_kwargs: dict):
    """Lightning strategy for ``trainer.strategy.name``."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    name = run.trainer.strategy.name
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo" if on_cpu else "nccl")
    if name == "fsdp2":
        return ModelParallelStrategy(
            data_parallel_size=data_parallel_size(run, trainer_kwargs),
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
        )
    return "auto"


class ExportOnTrainEnd(Callback):
    """Write the variant's serving export when training ends, reload it strictly and compare (DFlash: the
    draft-only HF directory; MTP: the target's directory with the trained heads).

    The export is written and verified in a directory beside ``out_dir`` and renamed into
    place only when it matches, so ``out_dir`` always holds a whole export (or none). A
    preempted run writes no export: it has not finished. The export holds the last step, or with
    ``exp_manager.export_checkpoint=best`` the best validated checkpoint (training/checkpoint_choice.py). Its
    ``training_info`` records the step the weights are from (``global_step``), the step training reached
    (``trained_steps``), how they were chosen (``exported_checkpoint``) and that step's validation figures
    (``val_step``, ``val_accept_len``, ``val_serving_mal``), from whichever launch ran it.
    """

    def __init__(self, run: RunConfig, out_dir: Path, preemption: Optional[PreemptionCheckpoint] = None,
                 provenance: Optional[ProvenanceRecord] = None, validation: Optional[ValidationRecord] = None):
        self.run = run
        self.out_dir = out_dir
        self.preemption = preemption
        self.provenance = provenance
        self.validation = validation
        self.written: Optional[Path] = None
        self.exported: Optional[str] = None  # which checkpoint the export holds, when not simply the last step

    def on_train_end(self, trainer: L.Trainer, pl_module: DFlashDraftModule) -> None:
        if self.preemption is not None and self.preemption.stopped_by is not None:
            return
        chosen = choose_export(trainer, pl_module, self.run, self.validation)  # collective under FSDP2
        if trainer.is_global_zero:
            with atomic_directory(self.out_dir) as staging:
                info = self.provenance.training_info(chosen.step) if self.provenance else None
                if info is not None:
                    # what training reported, beside what serving the export delivers (dflash-eval, vLLM)
                    info.update(chosen.validation, trained_steps=trainer.global_step,
                                exported_checkpoint=chosen.choice)
                family = family_of(pl_module.spec.variant)
                count = family.write_export(staging, self.out_dir, pl_module.draft, chosen.state, self.run, info)
            log.info("export: wrote %s (%d tensors), reloaded strictly and matched", self.out_dir, count)
        self.exported = chosen.describe(trainer.global_step)
        trainer.strategy.barrier("dflash-export")
        self.written = self.out_dir  # every rank reports the export rank 0 wrote

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        log.error(
            "training stopped by %s at step %d: no final export was written; the last checkpoint in %s resumes the run",
            type(exception).__name__,
            trainer.global_step,
            Path(trainer.default_root_dir) / "checkpoints",
        )


def _metric_text(metrics: dict, key: str) -> str:
    """A logged metric with four decimals, ``n/a`` when it was not logged."""
    return f"{float(metrics[key]):.4f}" if key in metrics else "n/a"


class ProgressLog(Callback):
    """Plain progress lines on rank 0 every ``log_every_n_steps`` steps (cluster logs have no progress bar)."""

    def __init__(self, every: int):
        self.every = max(1, int(every))
        self._last: Optional[int] = None  # with accumulation several micro-batches end at one step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every or step == self._last:
            return
        self._last = step
        value = partial(_metric_text, trainer.callback_metrics)

        log.info(
            "step %d/%s: loss %s, accept_len %s, lr %.3g",
            step,
            trainer.max_steps if trainer.max_steps > 0 else "?",
            value("train/dflash_loss"),
            value("train/accept_len"),
            trainer.optimizers[0].param_groups[0]["lr"],
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Teacher-forced and serving acceptance side by side after every validation."""
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        value = partial(_metric_text, trainer.callback_metrics)

        log.info(
            "validation at step %d: val accept_len %s (teacher-forced), serving MAL %s (acceptance@1 %s)",
            trainer.global_step,
            value("val/accept_len"),
            value("val/serving_mal"),
            value("val/serving_acceptance@1"),
        )


class SampleIdLog(Callback):
    """Every rank appends the sample ids of each batch it trains or validates on to ``rank<R>.jsonl``.

    One JSON object per batch: ``split`` (``train`` or the validation set's name), ``step``
    (the global step the batch belongs to) and ``ids``. The files show which rank saw which
    sample and when: the evidence for data sharding, and for reproducing a step.
    """

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir

    def _write(self, trainer: L.Trainer, split: str, batch) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"split": split, "step": trainer.global_step, "ids": list(batch.sample_ids)}
        with open(self.out_dir / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._write(trainer, "train", batch)

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not trainer.sanity_checking:
            self._write(trainer, pl_module.settings.val_names[dataloader_idx], batch)


def _callbacks(run: RunConfig, run_dir: Path, val_every: Optional[int]) -> list[Callback]:
    em = run.exp_manager
    ckpt_dir = run_dir / "checkpoints"
    every = em.checkpoint_every_n_steps or val_every
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, save_top_k=0, save_last=em.save_last, every_n_train_steps=every),
    ]
    if em.save_top_k > 0:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                # the monitored value in the name ("/" would make a directory of it)
                filename=f"best-step={{step}}-{em.checkpoint_monitor.replace('/', '_')}={{{em.checkpoint_monitor}:.4f}}",
                auto_insert_metric_name=False,
                monitor=em.checkpoint_monitor,
                mode=em.checkpoint_mode,
                save_top_k=em.save_top_k,
                # a resumed launch validates its checkpoint's step again, with the same figures: it rewrites that
                # step's file rather than keeping a "-v1" copy beside it
                enable_version_counter=False,
            )
        )
    return callbacks


def _loggers(run: RunConfig, run_dir: Path, resuming: bool) -> list:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.utilities import rank_zero_only

    loggers = []
    em = run.exp_manager
    if em.create_wandb_logger:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(**{"save_dir": str(run_dir), "name": run.name, **(em.wandb_logger_kwargs or {})}))
    if em.create_mlflow_logger:
        from lightning.pytorch.loggers import MLFlowLogger

        loggers.append(MLFlowLogger(**{"save_dir": str(run_dir / "mlruns"), **(em.mlflow_logger_kwargs or {})}))
    if run.exp_manager.create_tensorboard_logger:
        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version=""))
    if run.exp_manager.create_csv_logger:
        if rank_zero_only.rank == 0:  # Lightning writes the CSV on rank 0 alone
            keep_earlier_launch(run_dir, resuming)
        loggers.append(CSVLogger(save_dir=str(run_dir), name=METRICS_DIR, version=""))
    return loggers or False


def _plugins() -> list:
    """Atomic checkpoint writes; under SLURM, Lightning's own requeue handler off (:class:`PreemptionCheckpoint` saves)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    plugins: list = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def build_datamodule(run: RunConfig, target) -> L.LightningDataModule:
    """The configured speech data pipeline, tokenizing and budgeting with the target's own parts."""
    from dflash_train.data.estimator import AudioTokenEstimator
    from dflash_train.data.module import SpeechDataModule

    return SpeechDataModule(
        run.data,
        target.tokenizer,
        run.model.audio_locator_tag,
        AudioTokenEstimator.from_target(target),
        seed=run.seed,
    )


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes: its directory, the export, the checkpoint to resume from (if any)."""

    run_dir: Path
    export_dir: Path
    last_checkpoint: Path
    resume_from: Optional[Path]

    @classmethod
    def of(cls, run: RunConfig) -> "RunPaths":
        """The run's paths; resuming without a checkpoint is an error unless ``resume_ignore_no_checkpoint``."""
        em = run.exp_manager
        run_dir = check_writable_directory(run_directory(run), "the run directory")
        export_dir = Path(run.dflash.output_dir)
        last = run_dir / "checkpoints" / "last.ckpt"
        resume = last if em.resume_if_exists and last.exists() else None
        if resume is None and em.resume_if_exists and not em.resume_ignore_no_checkpoint:
            raise ConfigError(f"exp_manager.resume_if_exists=true but {last} does not exist")
        return cls(run_dir, export_dir if export_dir.is_absolute() else run_dir / export_dir, last, resume)


def setup_target(run: RunConfig, world_size: int = 1):
    """The frozen target (BF16 in BF16 runs; its experts are sharded later, once the ranks are up), the draft's
    shape and its compute dtype under FSDP2."""
    half = torch.bfloat16 if run.trainer.precision.startswith("bf16") else None
    target, layer_ids, mask_token_id = load_target_for_run(run, half or torch.float32, world_size)
    return target, DraftSpec(run.dflash, tuple(layer_ids), mask_token_id, target.num_layers), half


def setup_draft(run: RunConfig, target, spec: DraftSpec, backend: str, datamodule=None) -> torch.nn.Module:
    """A fresh draft shaped after the target (fitted to ``datamodule``'s training data where its family takes
    something from it), or the warm start ``dflash.init_from_pretrained``.

    The draft's initialisation is drawn from ``seed`` itself, not from whatever state loading the
    target left the generator in: the same seed gives the same draft however the target was loaded."""
    family = family_of(spec.variant)
    torch.manual_seed(run.seed)
    draft = family.build_draft(target, spec, backend)
    if run.dflash.init_from_pretrained:
        family.warm_start(draft, run.dflash.init_from_pretrained, spec)
    else:
        log.info("draft: fresh initialisation (%s)", spec.variant.describe_draft(run.dflash))
        if datamodule is not None:
            family.fit_to_data(draft, datamodule, spec)
    return draft


def setup_module(run: RunConfig, target, draft, spec: DraftSpec, backend: str, datamodule, half,
                 trainer_kwargs: dict) -> DFlashDraftModule:
    """The Lightning module; it takes over clipping and accumulation from ``trainer_kwargs`` (manual optimisation)."""
    settings = ModuleSettings(
        layer_ids=list(spec.layer_ids),
        label_source=run.dflash.label_source,
        attention_backend=backend,
        projection_only=run.dflash.projection_only,
        seed=run.seed,
        optim=OptimSettings(
            lr=run.dflash.lr,
            weight_decay=run.dflash.weight_decay,
            optimizer=run.dflash.optimizer,
            lr_scheduler=run.dflash.lr_scheduler,
            gradient_clip_val=trainer_kwargs.pop("gradient_clip_val", None),
            accumulate_grad_batches=int(trainer_kwargs.pop("accumulate_grad_batches", 1) or 1),
        ),
        val_names=list(getattr(datamodule, "val_names", ["val"])),
        fsdp_param_dtype=half,
        fsdp_reshard_after_forward=run.trainer.strategy.reshard_after_forward,
        nonfinite_step_limit=run.dflash.nonfinite_step_limit,
        expert_parallel_size=run.trainer.strategy.ep_size,
        target_weights=target_weights_file(run),
        serving_validation=setup_serving_validation(run, target, spec),
        serving_anchors=setup_serving_anchors(run, target, spec),
    )
    return DFlashDraftModule(target, draft, spec, settings)


def setup_serving_anchors(run: RunConfig, target, spec: DraftSpec) -> Optional[ServingAnchorMiner]:
    """The round-start miner at the served K: serving-aware anchors (``dflash.serving_anchor_fraction`` > 0,
    post-correction starts) or the on-policy stage (``dflash.on_policy_from_step`` >= 0, every start)."""
    from dflash_train.data.prompt import build_prompt_format
    from dflash_train.evaluate.anchors import AFTER_CORRECTION, KINDS, NOT_A_START
    from dflash_train.evaluate.loading import default_stop_token_ids

    cfg = run.dflash
    on_policy = cfg.on_policy_from_step >= 0
    if cfg.serving_anchor_fraction == 0 and not on_policy:
        return None
    prompt_format = build_prompt_format(run.data.prompt_format, target.tokenizer, run.model.audio_locator_tag)
    settings = ServingAnchorSettings(
        fraction=cfg.on_policy_anchor_fraction if on_policy else cfg.serving_anchor_fraction,
        every=cfg.serving_anchor_every,
        num_speculative_tokens=spec.variant.speculative_tokens(spec.cfg),
        stop_token_ids=frozenset(default_stop_token_ids(prompt_format)),
        seed=run.seed,
        kinds=frozenset(KINDS) - {NOT_A_START} if on_policy else frozenset({AFTER_CORRECTION}),
        from_step=max(cfg.on_policy_from_step, 0),
        on_policy=on_policy,
    )
    if on_policy:
        log.info("on-policy stage from step %d: up to %.0f%% of each row's blocks at its serving round starts, mined "
                 "every %d steps; loss on each block's accepted prefix, reverse KL (weight %g) at its first rejection",
                 settings.from_step, 100 * settings.fraction, settings.every, cfg.on_policy_reverse_kl_weight)
    else:
        log.info("serving-aware anchors: up to %.0f%% of each row's anchors at its serving round starts, mined every "
                 "%d steps", 100 * settings.fraction, settings.every)
    return ServingAnchorMiner(settings)


def setup_serving_validation(run: RunConfig, target, spec: DraftSpec) -> Optional[ServingValidation]:
    """The serving-acceptance measurement of every validation (``dflash.serving_val_samples`` > 0): the first
    records of the first validation set, decoded at the K the export is served with."""
    from dflash_train.data.estimator import AudioTokenEstimator
    from dflash_train.data.prompt import build_prompt_format

    samples = run.dflash.serving_val_samples
    if samples == 0:
        return None
    if run.data.validation_ds is None:
        log.warning("dflash.serving_val_samples=%d but no data.validation_ds: serving validation is off", samples)
        return None
    k = spec.variant.speculative_tokens(spec.cfg)
    settings = ServingValidationSettings(
        samples=samples,
        max_new_tokens=run.dflash.serving_val_max_new_tokens,
        num_speculative_tokens=k,
        perception_dtype=getattr(torch, run.dflash.serving_val_perception_dtype),
    )
    inp = run.data.validation_ds.input_cfg[0]
    log.info("serving validation: the first %d records of %s, K=%d, up to %d new tokens, perception in %s",
             samples, inp.cuts_path or inp.manifest_filepath or inp.shar_path, k, settings.max_new_tokens,
             run.dflash.serving_val_perception_dtype)
    prompt_format = build_prompt_format(run.data.prompt_format, target.tokenizer, run.model.audio_locator_tag)
    estimator = AudioTokenEstimator.from_target(target)
    return ServingValidation(inp, prompt_format, estimator, run.data.system_prompt, settings)


@dataclass
class RunCallbacks:
    """The callbacks whose state the summary reads."""

    preemption: PreemptionCheckpoint
    exporter: ExportOnTrainEnd


def setup_trainer(run: RunConfig, trainer_kwargs: dict, accelerator: str, paths: RunPaths,
                  half, accumulate: int = 1) -> tuple[L.Trainer, RunCallbacks]:
    """The Lightning trainer: precision, strategy, checkpointing, preemption, export, logs; validation every
    ``val_check_interval`` optimizer steps of ``accumulate`` micro-batches (training/lifecycle.py)."""
    preemption = PreemptionCheckpoint(paths.last_checkpoint, requeue=run.exp_manager.requeue_on_preemption)
    provenance = ProvenanceRecord(run, paths.run_dir)
    validation = ValidationRecord()
    exporter = ExportOnTrainEnd(run, paths.export_dir, preemption, provenance, validation)
    extra: list[Callback] = [provenance, preemption, validation, exporter, StepCounters(paths.resume_from)]
    extra.append(ProgressLog(trainer_kwargs.get("log_every_n_steps") or 50))
    if run.exp_manager.record_sample_ids:
        extra.append(SampleIdLog(paths.run_dir / "sample_ids"))
    precision = LIGHTNING_PRECISION[run.trainer.precision]
    log.info(
        "precision: trainer.precision=%s runs Lightning '%s' (docs/training.md, Precision); frozen target in %s",
        run.trainer.precision,
        precision,
        str(half or torch.float32).removeprefix("torch."),
    )
    val_every = trainer_kwargs.get("val_check_interval")
    trainer = L.Trainer(
        **{**trainer_kwargs, **validation_schedule(trainer_kwargs, accumulate)},
        precision=precision,
        strategy=build_strategy(run, accelerator, trainer_kwargs),
        callbacks=_callbacks(run, paths.run_dir, val_every if isinstance(val_every, int) else None) + extra,
        plugins=_plugins(),
        logger=_loggers(run, paths.run_dir, resuming=paths.resume_from is not None),
        default_root_dir=str(paths.run_dir),
    )
    return trainer, RunCallbacks(preemption, exporter)


def summarize(trainer: L.Trainer, paths: RunPaths, callbacks: RunCallbacks) -> TrainSummary:
    """What the finished (or preempted) fit leaves: steps, last losses, export, skip counts."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    skipped = {k.removeprefix("data/skipped/"): v for k, v in metrics.items() if k.startswith("data/skipped/")}
    return TrainSummary(
        run_dir=paths.run_dir,
        steps=trainer.global_step,
        train_loss=metrics.get("train/dflash_loss"),
        val_loss=metrics.get("val/dflash_loss"),
        val_accept_len=metrics.get("val/accept_len"),
        export_dir=callbacks.exporter.written,
        resumed_from=paths.resume_from,
        skipped=skipped,
        stopped_by=callbacks.preemption.stopped_by,
        val_serving_mal=metrics.get("val/serving_mal"),
        exported=callbacks.exporter.exported,
    )


def train(validated: ValidatedConfig, datamodule_factory=None, callbacks: tuple[Callback, ...] = ()) -> TrainSummary:
    """Run the recipe, step by step: checks, target, draft, data, module, trainer, fit, summary.

    ``datamodule_factory(run, target)`` replaces the configured data pipeline (tests); ``callbacks`` join the
    recipe's own, after them (``dflash-smoke``'s measurements: dflash_train/smoke/).
    """
    run, trainer_kwargs = validated
    trainer_kwargs = dict(trainer_kwargs)
    accelerator = str(trainer_kwargs.get("accelerator", "auto"))
    backend = resolve_attention_backend(run.dflash.attention_backend, accelerator)
    if datamodule_factory is None:
        from dflash_train.data.validate import validate_data_config

        validate_data_config(run.data)  # data paths and formats, before any weight loads
        datamodule_factory = build_datamodule
    paths = RunPaths.of(run)
    finished = check_launch(paths.resume_from, paths.export_dir, trainer_kwargs.get("max_steps"))
    if finished is not None:
        return TrainSummary(paths.run_dir, finished.step, None, None, None, finished.export_dir, paths.resume_from, {},
                            finished=finished)
    if paths.resume_from is not None and run.dflash.init_from_pretrained:
        log.warning(
            "resuming from %s: its weights replace dflash.init_from_pretrained=%s (the warm start only seeds a fresh "
            "run; set exp_manager.resume_if_exists=false to start over from it)",
            paths.resume_from,
            run.dflash.init_from_pretrained,
        )
    L.seed_everything(run.seed, workers=True)

    target, spec, half = setup_target(run, data_parallel_size(run, trainer_kwargs))
    datamodule = datamodule_factory(run, target)
    # a resume restores what a fresh draft took from the data (EAGLE-3's vocabulary) with its checkpoint
    draft = setup_draft(run, target, spec, backend, datamodule if paths.resume_from is None else None)
    module = setup_module(run, target, draft, spec, backend, datamodule, half, trainer_kwargs)
    trainer, recipe_callbacks = setup_trainer(run, trainer_kwargs, accelerator, paths, half,
                                              module.settings.optim.accumulate_grad_batches)
    trainer.callbacks.extend(callbacks)

    trainer.fit(module, datamodule=datamodule, ckpt_path=str(paths.resume_from) if paths.resume_from else None)
    summary = summarize(trainer, paths, recipe_callbacks)
    if trainer.is_global_zero:
        summary.report_path = report_after_training(paths.run_dir)
    return summary


def report_after_training(run_dir: Path) -> Optional[Path]:
    """The run's ``report.md`` (all launches so far); ``None``, with a warning, when it cannot be written (the run
    logged no metrics, a figure failed): the training and its export stand, the report is a view of them."""
    from dflash_train.training.report import write_run_report

    try:
        return write_run_report(run_dir)
    except InputFileError as err:
        log.warning("no run report: %s", err)
    except Exception as err:  # noqa: BLE001 - a report failure must not fail a finished run
        log.warning("no run report: %s: %s (`dflash-report %s --debug` shows the traceback)", type(err).__name__,
                    err, run_dir)
    return None
