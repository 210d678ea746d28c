"""What ``dflash-smoke`` measures inside one fit of the recipe: a Lightning callback beside the recipe's own.

:class:`SmokeMeter` times each training step by phase, checks every loss and every gradient for
finiteness, records the trainable parameters and a fingerprint of the frozen target before and after,
the steps, validation's valid blocks, the state a fit starts from (step, LR, scheduler), memory, host
syncs and compile cache entries, and on rank 0 the draft's final weights. It changes nothing the
module does; the planted faults of :data:`FAULTS` (tests only, ``DFLASH_SMOKE_FAULTS``) are the one
exception, each the fault a checklist item must catch.
"""

from __future__ import annotations

import math
import os
import resource
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import lightning as L
import torch

from dflash_train.errors import ConfigError

FAULTS_ENV = "DFLASH_SMOKE_FAULTS"
FAULTS = {
    "nan_gradient": "a NaN in one draft gradient at the first step",
    "trainable_target": "one target parameter left trainable",
    "missing_shard": "one file of the uninterrupted run's final checkpoint deleted",
    "resume_drift": "one draft weight nudged when the resumed fit starts",
    "export_not_reloading": "one tensor dropped from the final export",
}
"""The planted faults ``DFLASH_SMOKE_FAULTS=name,name`` switches on (the smoke's own tests): name -> what it does."""

PHASES = ("data_wait", "target", "draft_forward", "backward", "optimizer")
"""A training step's phases, in order: waiting for the batch, the target's forward (splice, taps, labels),
the draft's forward with the loss, the backward, and the rest (all-reduce, optimizer, scheduler, logging)."""


def planted_faults() -> frozenset[str]:
    """The faults ``DFLASH_SMOKE_FAULTS`` names; an unknown name is a one-line error listing the known ones."""
    names = frozenset(n.strip() for n in os.environ.get(FAULTS_ENV, "").split(",") if n.strip())
    unknown = sorted(names - FAULTS.keys())
    if unknown:
        raise ConfigError(f"{FAULTS_ENV}: unknown fault(s) {unknown}; known: {sorted(FAULTS)}")
    return names


@dataclass
class StartState:
    """Where a fit starts: its step, learning rates and scheduler states (a resumed fit: the checkpoint's)."""

    step: int
    lrs: list[float]
    schedulers: list[dict]


@dataclass
class FitRecord:
    """Everything one fit measured (per rank; the memory of every rank after the fit)."""

    steps: list[int] = field(default_factory=list)  # global step after each training batch
    phases: list[dict[str, float]] = field(default_factory=list)  # seconds per phase, per training batch
    after_validation: list[bool] = field(default_factory=list)  # the batch's data wait spans a validation
    tokens: list[int] = field(default_factory=list)  # real positions of each batch (this rank)
    query_tokens: list[float] = field(default_factory=list)  # draft query positions (logged valid blocks x block)
    row_lengths: list[float] = field(default_factory=list)
    losses_finite: int = 0
    losses_nonfinite: int = 0
    backwards_with_nonfinite_grads: int = 0
    backwards: int = 0
    nonfinite_steps: int = 0  # steps the module did not apply for a non-finite gradient
    draft_trainable: list[str] = field(default_factory=list)
    draft_trainable_count: int = 0
    optimizer_matches_draft: bool = False
    target_trainable: list[str] = field(default_factory=list)
    target_unchanged: Optional[bool] = None
    validations: list[float] = field(default_factory=list)  # valid blocks of each validation (all ranks)
    start: Optional[StartState] = None
    skips: dict[str, float] = field(default_factory=dict)
    memory: list[dict[str, Optional[float]]] = field(default_factory=list)  # per rank
    syncs: list[int] = field(default_factory=list)  # host syncs of each training batch (when counted)
    sync_sites: list[str] = field(default_factory=list)
    compile_entries: int = 0
    params: dict[str, int] = field(default_factory=dict)  # the MFU formula's sizes (parameter_counts)
    per_rank: list[dict] = field(default_factory=list)  # every rank's finiteness and trainable-target counts
    final_state: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: the draft's weights at the end
    export_tensors: Optional[int] = None  # rank 0: the final export's strict reload (the final fit)
    export_error: Optional[str] = None


def _target_fingerprint(target: torch.nn.Module) -> torch.Tensor:
    """Per target tensor its sum and its sum of magnitudes, accumulated in float64 (no float64 copy of the tensor):
    a change to a weight moves them."""
    values = [torch.stack([t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)])
              for t in target.state_dict().values() if t.is_floating_point()]
    return torch.stack(values).cpu() if values else torch.zeros(0)


class SyncCount:
    """Host-device syncs of one training batch: CUDA's own sync-debug warnings on a GPU, else
    :class:`~dflash_train.testing.host_syncs.HostSyncCounter` (CPU, a lower bound of what CUDA would see)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> "SyncCount":
        if self.device.type == "cuda":
            self._caught = warnings.catch_warnings(record=True)
            self._warnings = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            from dflash_train.testing.host_syncs import HostSyncCounter

            self._counter = HostSyncCounter().__enter__()
        return self

    def pause(self) -> None:
        """Do not count the meter's own checks."""
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        else:
            self._counter.pause()

    def resume(self) -> None:
        """Count again."""
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._counter.resume()

    def exit(self) -> list[str]:
        """Stop counting; where each sync happened."""
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self._caught.__exit__(None, None, None)
            return [str(w.message).splitlines()[0] for w in self._warnings if "synchroniz" in str(w.message)]
        self._counter.__exit__(None, None, None)
        return list(self._counter.sites.elements())


class SmokeMeter(L.Callback):
    """Measures one fit into :attr:`record` (see the module docstring).

    ``count_syncs``: count host syncs per training batch (a dispatch mode; the fit that does is not timed
    for the figures). ``faults``: the planted faults this fit applies (``nan_gradient`` and
    ``trainable_target`` in every fit, ``resume_drift`` in a resumed one); ``verify_export``: on rank 0,
    reload the recipe's final export strictly and compare it with the trained weights (the last fit).
    """

    def __init__(self, run, count_syncs: bool = False, faults: frozenset[str] = frozenset(),
                 verify_export: bool = False, resumed: bool = False):
        self.run = run
        self.count_syncs = count_syncs
        self.faults = faults
        self.verify_export = verify_export
        self.resumed = resumed
        self.record = FitRecord()
        self._marks: dict[str, float] = {}
        self._last_end: Optional[float] = None
        self._validated_since = False
        self._training = False
        self._fingerprint: Optional[torch.Tensor] = None
        self._sync: Optional[SyncCount] = None
        self._overhead: dict[str, float] = {}

    def _now(self, pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ fit
    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        if "trainable_target" in self.faults:
            next(pl_module.target.parameters()).requires_grad_(True)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        prepare = pl_module.prepare

        def timed_prepare(batch):
            inputs = prepare(batch)
            if self._training:
                self._marks["target"] = self._now(pl_module)
            return inputs

        pl_module.prepare = timed_prepare  # instance attribute: the module's own method, timed

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        rec = self.record
        rec.draft_trainable = sorted(n for n, p in pl_module.draft.named_parameters() if p.requires_grad)
        rec.draft_trainable_count = sum(p.numel() for p in pl_module.draft.parameters() if p.requires_grad)
        optimized = [p for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]]
        # by shape (a DTensor's is the whole tensor's): FSDP2 swaps the root's registered parameters between its
        # sharded and gathered tensors, so identities differ after a forward although the optimizer holds the draft's
        shapes = sorted(tuple(p.shape) for p in optimized)
        target_ids = {id(p) for p in pl_module.target.parameters()}
        rec.optimizer_matches_draft = (shapes == sorted(tuple(p.shape) for p in pl_module.trainable_parameters())
                                       and not target_ids & {id(p) for p in optimized})
        rec.target_trainable = sorted(n for n, p in pl_module.target.named_parameters() if p.requires_grad)
        self._fingerprint = _target_fingerprint(pl_module.target)
        target = pl_module.target
        rec.params = parameter_counts(target, pl_module.draft, target.hidden_size, target.vocab_size)
        rec.start = StartState(
            trainer.global_step,
            [float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups],
            [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        )
        if self.resumed and "resume_drift" in self.faults:
            with torch.no_grad():
                pl_module.trainable_parameters()[0].add_(1e-3)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        from dflash_train.draft.attention import compiled_entries
        from dflash_train.draft.export import full_state_dict

        rec = self.record
        rec.target_unchanged = bool(torch.equal(self._fingerprint, _target_fingerprint(pl_module.target)))
        rec.nonfinite_steps = int(pl_module.nonfinite_steps)
        rec.skips = {**{f"train/{k}": float(v) for k, v in pl_module.skip_counts.items()},
                     "train/nonfinite": float(pl_module.nonfinite_steps),
                     **{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("data/skipped/")}}
        rec.compile_entries = sum(compiled_entries().values()) if pl_module.device.type == "cuda" else 0
        rec.memory = _gathered(_memory(pl_module.device))
        rec.per_rank = _gathered({"losses_nonfinite": rec.losses_nonfinite,
                                  "losses": rec.losses_finite + rec.losses_nonfinite, "backwards": rec.backwards,
                                  "backwards_with_nonfinite_grads": rec.backwards_with_nonfinite_grads,
                                  "target_trainable": rec.target_trainable, "target_unchanged": rec.target_unchanged})
        state = full_state_dict(pl_module.draft)  # a collective under FSDP2: every rank calls it
        if trainer.is_global_zero:
            rec.final_state = {k: v.detach().cpu().clone() for k, v in state.items()}
            if self.verify_export:
                self._verify_export(pl_module, rec)
        del pl_module.prepare

    def _verify_export(self, pl_module, rec: FitRecord) -> None:
        """The recipe's final export, reloaded strictly with the variant's class and compared with the weights."""
        from dflash_train.draft.family import family_of
        from dflash_train.training.recipe import RunPaths

        location = RunPaths.of(self.run).export_dir
        if "export_not_reloading" in self.faults:
            drop_one_tensor(location)
        try:
            rec.export_tensors = family_of(pl_module.spec.variant).verify_export(location, pl_module.draft,
                                                                                rec.final_state, self.run)
        except Exception as err:  # noqa: BLE001 - whatever the reload raises is the item's evidence
            rec.export_error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"

    # ------------------------------------------------------------------ steps
    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        self.record.tokens.append(int(batch.lengths.sum()))
        self.record.row_lengths.append(float(batch.lengths.float().mean()))
        now = self._now(pl_module)
        self._marks = {"start": now, "data_wait": 0.0 if self._last_end is None else now - self._last_end}
        self._overhead = {}
        self.record.after_validation.append(self._validated_since or self._last_end is None)
        self._validated_since = False
        self._training = True
        if self.count_syncs:
            self._sync = SyncCount(pl_module.device).__enter__()

    @contextmanager
    def _own(self, pl_module, phase: str) -> Iterator[None]:
        """The meter's own checks: neither counted as host syncs nor timed as part of ``phase``."""
        if self._sync is not None:
            self._sync.pause()
        started = self._now(pl_module)
        try:
            yield
        finally:
            self._overhead[phase] = self._overhead.get(phase, 0.0) + self._now(pl_module) - started
            if self._sync is not None:
                self._sync.resume()

    def on_before_backward(self, trainer: L.Trainer, pl_module, loss: torch.Tensor) -> None:
        if self._training:
            self._marks["draft_forward"] = self._now(pl_module)
        with self._own(pl_module, "backward"):
            finite = bool(torch.isfinite(loss.detach()).all())
            self.record.losses_finite += finite
            self.record.losses_nonfinite += not finite

    def on_after_backward(self, trainer: L.Trainer, pl_module) -> None:
        if self._training:
            self._marks["backward"] = self._now(pl_module)
        with self._own(pl_module, "optimizer"):
            params = pl_module.trainable_parameters()
            if "nan_gradient" in self.faults and trainer.global_step == 0 and params and params[0].grad is not None:
                params[0].grad.view(-1)[0] = float("nan")
            grads = [p.grad for p in params if p.grad is not None]
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            self.record.backwards += 1
            self.record.backwards_with_nonfinite_grads += not all(bool(torch.isfinite(g).all()) for g in grads)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._sync is not None:
            found = self._sync.exit()
            self._sync = None
            self.record.syncs.append(len(found))
            self.record.sync_sites = sorted(set(self.record.sync_sites) | set(found))
        end = self._now(pl_module)
        marks, self._training, self._last_end = self._marks, False, end
        start, target = marks["start"], marks.get("target", marks["start"])
        forward, backward = marks.get("draft_forward", target), marks.get("backward", marks.get("draft_forward", target))
        own = self._overhead
        self.record.phases.append({"data_wait": marks["data_wait"], "target": target - start,
                                   "draft_forward": forward - target,
                                   "backward": backward - forward - own.get("backward", 0.0),
                                   "optimizer": end - backward - own.get("optimizer", 0.0)})
        self.record.steps.append(int(trainer.global_step))
        blocks = trainer.callback_metrics.get("train/valid_blocks")
        self.record.query_tokens.append(float(blocks) * pl_module.spec.cfg.block_size if blocks is not None else math.nan)

    def on_validation_end(self, trainer: L.Trainer, pl_module) -> None:
        self._validated_since = True
        if not trainer.sanity_checking and "val/valid_blocks" in trainer.callback_metrics:
            self.record.validations.append(float(trainer.callback_metrics["val/valid_blocks"]))

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        self._validated_since = True  # a checkpoint's write is not the next batch's data wait


EMBEDDING_TABLES = ("embed_tokens", "codebook", "lm_head")  # looked up (or the frozen head, counted apart): no 2·P·T


def parameter_counts(target: torch.nn.Module, draft: torch.nn.Module, hidden: int, vocab: int) -> dict[str, int]:
    """Parameters without embedding tables and LM head (the MFU formula's P), the hidden size and vocabulary."""
    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for n, p in module.named_parameters() if not any(s in n for s in EMBEDDING_TABLES))

    return {"target": count(target), "draft": count(draft), "hidden": hidden, "vocab": vocab}



def _memory(device: torch.device) -> dict[str, Optional[float]]:
    """This process's peak memory in GiB: CUDA's allocated and reserved, else the process's peak resident set."""
    if device.type == "cuda":
        return {"allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30, "process_peak_rss_gib": None}
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    return {"allocated_gib": None, "reserved_gib": None, "process_peak_rss_gib": rss_kib / 2**20}


def _gathered(value: dict) -> list[dict]:
    """``value`` of every rank, in rank order (this rank's alone without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def drop_one_tensor(export_dir) -> None:
    """The planted ``export_not_reloading`` fault: rewrite the export's first weights file without its last tensor."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = sorted(Path(export_dir).glob("*.safetensors"))[0]
    tensors = load_file(str(path))
    tensors.pop(sorted(tensors)[-1])
    save_file(tensors, str(path), metadata={"format": "pt"})
