"""The Lightning module that trains a DFlash / DFlash2 draft against a frozen target.

The target is held as a plain attribute, not a submodule: it is never trained, sharded,
moved by Lightning or written into checkpoints. Optimisation is manual so that the loss is
normalised over a whole accumulation window on all ranks, and so that a window with no
valid anchor on any rank advances the step counter and the scheduler without touching
weights or optimizer state. Every rank runs the draft on every micro-batch, a placeholder
block with zero weight when its own batch has no anchor, so collectives always match.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from dflash_train.data.batch import SpeechBatch
from dflash_train.data.packing import document_layout
from dflash_train.distributed import all_reduce_sum, world_size
from dflash_train.draft.attention import FLEX_LENGTH_MULTIPLE, compiled_entries, recompile_error
from dflash_train.draft.build import DraftSpec, PreferredRow
from dflash_train.draft.export import full_state_dict
from dflash_train.draft.family import family_of
from dflash_train.errors import ConfigError, NonFiniteTrainingError
from dflash_train.target.base import FrozenTarget
from dflash_train.training.metrics import (
    WEIGHT_INDEX,
    BlockStats,
    empty_step_sums,
    step_sums,
)
from dflash_train.training.provenance import weights_sha256
from dflash_train.training.serving_anchors import CHECKPOINT_KEY as SERVING_ANCHORS_KEY
from dflash_train.training.serving_anchors import ServingAnchorMiner
from dflash_train.training.serving_validation import ServingValidation
from dflash_train.training.target_labels import target_argmax_labels

log = logging.getLogger(__name__)

SKIP_NO_ANCHOR = "no_valid_anchor"
IDENTITY_KEY = "dflash_train_identity"  # checkpoint entry: what a resume must agree with
FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # where torch ships a fused AdamW kernel


@dataclass
class OptimSettings:
    """Optimizer, scheduler and step settings; ``optimizer`` / ``lr_scheduler`` are Hydra ``_target_`` dicts."""

    lr: float = 6.0e-4
    weight_decay: float = 0.0
    optimizer: Optional[dict] = None
    lr_scheduler: Optional[dict] = None
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1


@dataclass
class ModuleSettings:
    """Everything the module needs besides the target and the draft."""

    layer_ids: list[int]
    label_source: str = "target_argmax"
    attention_backend: str = "sdpa"
    projection_only: bool = False
    seed: int = 0
    optim: OptimSettings = field(default_factory=OptimSettings)
    val_names: list[str] = field(default_factory=lambda: ["val"])
    fsdp_param_dtype: Optional[torch.dtype] = None  # FSDP2 compute/all-gather dtype (BF16 runs); grads reduce in FP32
    fsdp_reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (trainer.strategy.*)
    nonfinite_step_limit: int = 3  # non-finite-gradient steps in a row that stop the run
    expert_parallel_size: int = 1  # ranks that share the target's routed experts (trainer.strategy.ep_size)
    target_fingerprint: Optional[str] = None  # SHA-256 of the target's weights file (None: built, not loaded)
    target_weights: Optional[Path] = None  # the file to fingerprint at setup: rank 0 hashes it, all ranks agree
    stable_shapes: Optional[bool] = None  # pad lengths and anchor counts to multiples (None: on for flex)
    serving_validation: Optional[ServingValidation] = None  # decode like serving at every validation (None: off)
    serving_anchors: Optional[ServingAnchorMiner] = None  # blocks where serving rounds start after a correction

    @property
    def pads_shapes(self) -> bool:
        """Whether batches are padded to stable shapes: fewer distinct shapes for a compiled kernel."""
        return self.attention_backend == "flex_attention" if self.stable_shapes is None else self.stable_shapes


@dataclass
class StepInputs:
    """The trainer core's inputs for one batch (docs/target.md, docs/training.md)."""

    input_ids: torch.Tensor
    features: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: torch.Tensor
    doc_remaining: torch.Tensor
    embeds: Optional[torch.Tensor] = None  # token embeddings, audio frames' at audio positions (no-tap variants)
    teacher_hidden: Optional[torch.Tensor] = None  # the target's final hidden states, for a tap variant's distillation
    supervised_bound: Optional[int] = None  # at least loss_mask.sum(), known on the host (sizes the loss's rows)
    anchor_runway: Optional[int] = None  # the batch's (SpeechBatch.with_placements): proves an anchor on the host


def pad_to_multiple(inputs: StepInputs, multiple: int) -> StepInputs:
    """Right-pad the sequence axis to a multiple of ``multiple`` with positions no block can use.

    Padding is what short rows already have: no supervision, no document (``doc_remaining``
    -1), zero features; it is never an anchor, a label or a context position, so the loss
    and gradients are unchanged. Compiled attention then sees at most one sequence length
    per ``multiple`` instead of one per batch.
    """
    length = inputs.input_ids.shape[1]
    extra = -length % multiple
    if extra == 0:
        return inputs

    def pad(tensor: torch.Tensor, value) -> torch.Tensor:
        shape = (tensor.shape[0], extra, *tensor.shape[2:])
        return torch.cat([tensor, tensor.new_full(shape, value)], dim=1)

    return StepInputs(
        input_ids=pad(inputs.input_ids, 0),
        features=pad(inputs.features, 0),
        loss_mask=pad(inputs.loss_mask, False),
        position_ids=pad(inputs.position_ids, 0),
        seq_lens=inputs.seq_lens,
        doc_remaining=pad(inputs.doc_remaining, -1),
        embeds=None if inputs.embeds is None else pad(inputs.embeds, 0),
        teacher_hidden=None if inputs.teacher_hidden is None else pad(inputs.teacher_hidden, 0),
        supervised_bound=inputs.supervised_bound,
        anchor_runway=inputs.anchor_runway,
    )


class DFlashDraftModule(L.LightningModule):
    """Trains ``draft`` on the frozen ``target`` with its variant's trainer core (nemo_automodel's for
    DFlash / DFlash2, :class:`~dflash_train.draft.mtp_objective.MTPTrainerCore` for MTP)."""

    def __init__(self, target: FrozenTarget, draft: torch.nn.Module, spec: DraftSpec, settings: ModuleSettings):
        super().__init__()
        self.automatic_optimization = False
        object.__setattr__(self, "target", target)
        self.spec = spec
        self.settings = settings
        self.core = family_of(spec.variant).build_core(draft, target, spec, settings.attention_backend, settings.pads_shapes)
        self.skip_counts: Counter[str] = Counter()
        self._sharded = False  # FSDP2 has sharded the draft (configure_model)
        self.nonfinite_steps = 0  # optimizer steps not applied for a NaN / infinite gradient
        self._nonfinite_in_a_row = 0
        self.grad_norm = float("nan")  # of the last applied step, after normalisation, before clipping
        self._val_stats: dict[str, BlockStats] = {}
        self._window_weight = 0.0  # this rank's Σ w over the current accumulation window
        self._log_window: Optional[torch.Tensor] = None  # this rank's step sums since the last log step (device)
        self._log_window_started: Optional[float] = None  # when the log window began (the last log step's end)
        self._log_window_steps = 0
        self._log_window_skipped = 0  # steps since the last log step that applied nothing
        if settings.projection_only:
            for name, param in self.draft.named_parameters():
                param.requires_grad_(name == "fc.weight")

    @property
    def draft(self) -> torch.nn.Module:
        return self.core.draft_model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.draft.parameters() if p.requires_grad]

    def run_identity(self) -> dict:
        """What a checkpoint must agree with to be resumed here: the target's weights, the variant and
        the set of trainable draft parameters (``projection_only`` changes it)."""
        trainable = sorted(name for name, p in self.draft.named_parameters() if p.requires_grad)
        return {
            "target_weights_sha256": self.settings.target_fingerprint,
            "variant": self.spec.variant.name,
            "trainable_parameters": trainable,
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[IDENTITY_KEY] = self.run_identity()
        if self.settings.serving_anchors is not None:  # every rank's memory (a collective: all ranks save)
            checkpoint[SERVING_ANCHORS_KEY] = self.settings.serving_anchors.state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint of another target, variant or trainable set, naming what differs; then say
        what is restored (step, learning rates, scheduler) and warn when the schedule ends before max_steps."""
        self._check_identity(checkpoint)
        if self.settings.serving_anchors is not None:
            self.settings.serving_anchors.restore(checkpoint.get(SERVING_ANCHORS_KEY, {}))
        trainer = getattr(self, "_trainer", None)
        max_steps = trainer.max_steps if trainer is not None else None
        message, warning = describe_restored_state(checkpoint, max_steps)
        log.info(message)
        if warning:
            log.warning(warning)

    def _check_identity(self, checkpoint: dict) -> None:
        saved, ours = checkpoint.get(IDENTITY_KEY), self.run_identity()
        if saved is None:
            return  # written before checkpoints recorded their identity
        for key in ("target_weights_sha256", "variant"):
            if saved.get(key) != ours[key]:
                raise ConfigError(
                    f"the checkpoint to resume was written with {key}={saved.get(key)} but this run has {ours[key]}; "
                    "point exp_manager at a fresh run directory or set exp_manager.resume_if_exists=false"
                )
        if saved.get("trainable_parameters") != ours["trainable_parameters"]:
            changed = sorted(set(saved.get("trainable_parameters") or []) ^ set(ours["trainable_parameters"]))
            raise ConfigError(
                f"the checkpoint to resume trained another set of parameters (differing: {changed[:5]}); "
                "keep dflash.projection_only as it was, or start a fresh run (exp_manager.resume_if_exists=false)"
            )

    def configure_model(self) -> None:
        """Shard the draft with FSDP2 over the data-parallel mesh (ModelParallelStrategy only).

        In BF16 runs the sharded FP32 master weights are all-gathered and computed in BF16
        (half the all-gather traffic) and gradients are reduce-scattered in FP32.
        """
        mesh = getattr(self, "device_mesh", None)
        if mesh is None or self._sharded:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        policy = MixedPrecisionPolicy(param_dtype=self.settings.fsdp_param_dtype, reduce_dtype=torch.float32)
        dp_mesh = mesh["data_parallel"]
        reshard = self.settings.fsdp_reshard_after_forward
        for layer in self.draft.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
        # the root keeps torch's own rule (gathered through backward): the selector and the loss read its
        # parameters after the draft's forward
        fully_shard(self.draft, mesh=dp_mesh, mp_policy=policy)
        for method in getattr(self.draft, "fsdp_forward_methods", ()):  # called outside its forward (EAGLE-3)
            register_fsdp_forward_method(self.draft, method)
        self._sharded = True
        log.info("FSDP2: %s; reshard_after_forward=%s", describe_sharding(self.draft), str(reshard).lower())

    def setup(self, stage: str) -> None:
        if self.settings.expert_parallel_size > 1 and not self.target.experts_sharded:  # before the rest moves
            self.target.shard_experts(self.settings.expert_parallel_size, self.device)
        self.target.to(self.device)
        self._fingerprint_target()

    def _fingerprint_target(self) -> None:
        """``settings.target_fingerprint`` from ``settings.target_weights``: hashed on rank 0 and broadcast, so
        one process reads the (multi-GB) file, not every rank of every node."""
        settings = self.settings
        if settings.target_weights is None or settings.target_fingerprint is not None:
            return
        digest = None
        if self.global_rank == 0:
            started = time.perf_counter()
            digest = weights_sha256(settings.target_weights)
            log.info(
                "target weights SHA-256 %s… (%s, %.1f s on rank 0, broadcast to %d ranks)",
                digest[:16], settings.target_weights, time.perf_counter() - started, self.trainer.world_size,
            )
        settings.target_fingerprint = self.trainer.strategy.broadcast(digest, src=0)

    def on_fit_start(self) -> None:
        self.target.to(self.device)
        precision = self.trainer.precision_plugin
        self.warm_shape_classes(precision.train_step_context, precision.val_step_context)

    # ------------------------------------------------------------------ inputs
    def prepare(self, batch: SpeechBatch) -> StepInputs:
        """Splice audio, run the target (taps, or its final hidden state), choose labels and lay out documents."""
        target = self.target
        spliced = target.splice_batch(batch, self.spec.mask_token_id)
        packed = spliced.document_ids is not None
        doc_ids = spliced.document_ids if packed else torch.where(spliced.attention_mask, 0, -1)
        layout = document_layout(doc_ids, batch.max_documents if packed else 1)
        argmax = self.settings.label_source == "target_argmax"
        taps_features = self.spec.variant.uses_taps
        keeps_teacher = self.keeps_teacher
        # Rows are right-padded: in a causal target no real position can see the padding that follows
        # it, so the target runs without a padding mask (HF would read the mask back to pick a kernel).
        taps = target.forward_taps(
            spliced.inputs_embeds,
            None,
            self.settings.layer_ids if taps_features else [],
            return_last_hidden=argmax or not taps_features or keeps_teacher,
            position_ids=layout.position_ids if packed else None,
            document_ids=doc_ids if packed else None,
        )
        ids = spliced.input_ids
        if argmax:
            ids = target_argmax_labels(
                ids, spliced.loss_mask, taps.last_hidden, target.lm_head, supervised_bound=batch.supervised_tokens
            )
        features, embeds = taps.features, None
        if not taps_features:  # the final hidden state, and the embeddings of the (label) tokens
            features = taps.last_hidden
            with torch.no_grad():
                embeds = torch.where(spliced.audio_mask[..., None], spliced.inputs_embeds, target.embed_tokens(ids))
        inputs = StepInputs(
            ids, features, spliced.loss_mask, layout.position_ids, layout.seq_lens, layout.doc_remaining, embeds,
            taps.last_hidden if keeps_teacher else None, batch.supervised_tokens, batch.anchor_runway,
        )
        if self.settings.pads_shapes:
            inputs = pad_to_multiple(inputs, FLEX_LENGTH_MULTIPLE)
        return inputs

    @property
    def distills(self) -> bool:
        """Whether the run's loss learns the target's distribution (so each step keeps its final hidden states)."""
        return self.spec.variant.loss_terms(self.spec.cfg).distills

    @property
    def keeps_teacher(self) -> bool:
        """Whether the core gets the target's final hidden states (``teacher_hidden``): a tap variant that distils
        or learns the target's distribution (MTP's features already are those states)."""
        variant = self.spec.variant
        return variant.uses_taps and (self.distills or variant.reads_target_distribution)

    def has_valid_anchor(self, inputs: StepInputs) -> bool:
        """Whether any row holds an anchor of this variant (DFlash: a supervised position with a full block
        left in its document). The batch's host ``anchor_runway`` of at least the variant's span answers it
        without reading the device; otherwise the device answers."""
        variant, cfg = self.spec.variant, self.spec.cfg
        if inputs.anchor_runway is not None and inputs.anchor_runway >= variant.block_span(cfg):
            return True
        return variant.has_valid_anchor(cfg, inputs.loss_mask, inputs.doc_remaining)

    def run_core(self, inputs: StepInputs, rng_key: int, preferred: Optional[list[PreferredRow]] = None,
                 on_policy: bool = False):
        """One trainer-core forward; anchor sampling is seeded by ``rng_key`` so resumes are exact.

        ``preferred``: per row, positions that get part of its blocks (serving-aware anchors, the on-policy
        stage); ``on_policy``: the on-policy stage's loss (``ChunkedBlockLoss.on_policy``).
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(rng_key)
            extra = {} if inputs.embeds is None else {"embeds": inputs.embeds}
            if inputs.teacher_hidden is not None:
                extra["teacher_hidden"] = inputs.teacher_hidden
            if preferred is not None:
                self.core.preferred_anchors = preferred
                self.core.preferred_fraction = self.settings.serving_anchors.settings.fraction
            if on_policy:
                self.core.on_policy = True
            self.core.supervised_bound = inputs.supervised_bound
            try:
                return self.core(
                    inputs.input_ids,
                    inputs.features,
                    inputs.loss_mask.float(),
                    position_ids=inputs.position_ids,
                    seq_lens=inputs.seq_lens,
                    doc_remaining=inputs.doc_remaining,
                    **extra,
                )
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:  # flex attention's own hit is already named
                raise recompile_error("the draft step's block-mask builder", f"batch {tuple(inputs.input_ids.shape)}") from err
            finally:
                self.core.preferred_anchors = None
                self.core.supervised_bound = None
                if on_policy:
                    self.core.on_policy = False

    def _rng_key(self, step: int, batch_idx: int, stream: int) -> int:
        return (self.settings.seed * 1_000_003 + step * 7_919 + batch_idx * 131 + stream * 17 + self.global_rank) % (
            2**63 - 1
        )

    def placeholder_inputs(self, like: StepInputs) -> StepInputs:
        """One fully supervised one-block row: a valid anchor for a rank whose batch has none.

        Its loss is multiplied by zero, so it changes no weight; it exists so that every rank
        runs the same forward and backward and therefore the same collectives (FSDP2's
        all-gathers and reduce-scatters, DDP's gradient all-reduce).
        """
        length = self.spec.variant.placeholder_length(self.spec.cfg)
        return self.filler_inputs(1, length, like.features, like.embeds)

    def filler_inputs(
        self, rows: int, length: int, features_like: torch.Tensor, embeds_like: Optional[torch.Tensor] = None
    ) -> StepInputs:
        """``rows`` fully supervised one-document rows of ``length`` mask tokens with zero features (and zero
        embeddings, and zero target states when distilling), in the width, dtype and device of ``features_like`` /
        ``embeds_like``."""
        device = features_like.device
        keeps_teacher = self.keeps_teacher
        teacher = features_like.new_zeros(rows, length, self.target.hidden_size) if keeps_teacher else None
        layout = document_layout(torch.zeros(rows, length, dtype=torch.long, device=device), 1)
        return StepInputs(
            input_ids=torch.full((rows, length), self.spec.mask_token_id, dtype=torch.long, device=device),
            features=features_like.new_zeros(rows, length, features_like.shape[-1]),
            loss_mask=torch.ones(rows, length, dtype=torch.bool, device=device),
            position_ids=layout.position_ids,
            seq_lens=layout.seq_lens,
            doc_remaining=layout.doc_remaining,
            embeds=None if embeds_like is None else embeds_like.new_zeros(rows, length, embeds_like.shape[-1]),
            teacher_hidden=teacher,
        )

    def warm_shape_classes(self, train_context=contextlib.nullcontext, eval_context=contextlib.nullcontext) -> None:
        """Compile the flex draft step's shape classes before the first batch (flex runs only).

        A flex run's compiled functions see four classes of inputs, whatever the batch: grad mode × one row
        or more (docs/training.md, the flex paragraph of "Precision"). Each forward here, on filler rows
        under the run's precision contexts, builds one class's entries, so the first real batches reuse
        them and a recompile-limit problem shows before any data is read. The forwards count as placeholders (zero statistics) and are
        not differentiated: every rank runs the same ones, so collectives stay in step.
        """
        if self.settings.attention_backend != "flex_attention" or not self.spec.variant.uses_taps:
            return
        started = time.perf_counter()
        embed = self.target.embed_tokens.weight
        width = len(self.settings.layer_ids) * self.target.hidden_size
        features = embed.new_zeros(1, 1, width)
        self.core.placeholder = True
        try:
            for grad, context in ((True, train_context), (False, eval_context)):
                for rows in (1, 2):
                    with torch.set_grad_enabled(grad), context():
                        self.run_core(self.filler_inputs(rows, 2 * FLEX_LENGTH_MULTIPLE, features), rng_key=rows)
        finally:
            self.core.placeholder = False
        log.info("flex: compiled the draft step's 4 shape classes in %.1f s: %s", time.perf_counter() - started,
                 compiled_entries())

    def _forward_core(self, inputs: StepInputs, rng_key: int, preferred: Optional[list[PreferredRow]] = None,
                      on_policy: bool = False):
        """The core on ``inputs``, or on :meth:`placeholder_inputs` with zero weight when they hold no anchor.

        Returns ``(metrics, sums, loss_sum)``: ``sums`` are the batch's :class:`BlockStats`
        as a device tensor (:func:`~dflash_train.training.metrics.step_sums`); ``loss_sum`` is Σ w·CE
        of this batch, the quantity whose gradient, summed over ranks and micro-batches and
        divided by the window's Σ w, is the gradient of the exact window loss.
        """
        if self.has_valid_anchor(inputs):
            metrics = self.run_core(inputs, rng_key, preferred, on_policy)
            return metrics, step_sums(metrics), metrics.loss * metrics.loss_weight
        self.core.placeholder = True  # a core that pools statistics over ranks counts this forward as zero
        try:
            metrics = self.run_core(self.placeholder_inputs(inputs), rng_key)
        finally:
            self.core.placeholder = False
        return None, empty_step_sums(self.device), metrics.loss * 0.0

    # ------------------------------------------------------------------ training
    def training_step(self, batch: SpeechBatch, batch_idx: int) -> None:
        """One micro-batch: forward, backward of the unnormalised loss, and the optimizer step at a window's end.

        Gradients of Σ w·CE accumulate over the ``accumulate_grad_batches`` micro-batches of a
        window; at its end they are divided by the window's Σ w over all ranks, so the step
        minimises Σ w·CE / Σ w over the whole window on every rank. Every rank runs the core
        on every micro-batch (see :meth:`placeholder_inputs`); a window with no supervised
        weight anywhere steps nothing but still advances the step and the scheduler.
        """
        started = time.perf_counter()
        optimizer = self.optimizers()
        accumulate = self.settings.optim.accumulate_grad_batches
        micro = batch_idx % accumulate  # not batch_idx itself: it restarts when a run resumes
        inputs = self.prepare(batch)
        preferred = self._serving_anchors(batch, inputs, micro)
        miner = self.settings.serving_anchors
        on_policy = miner is not None and miner.settings.on_policy_at(self.global_step)
        metrics, sums, loss_sum = self._forward_core(inputs, self._rng_key(self.global_step, micro, 0), preferred,
                                                     on_policy)
        coverage = self.core.anchor_coverage_sums if metrics is not None else None
        hard_ce = getattr(self.core, "weighted_ce", None) if metrics is not None else None
        if metrics is None:
            self.skip_counts[SKIP_NO_ANCHOR] += 1
        # DP frameworks average gradients over ranks; the world size undoes that average.
        self.manual_backward(loss_sum * world_size())
        self._window_weight = self._window_weight + sums[WEIGHT_INDEX]
        stepped = True
        window_end = micro == accumulate - 1
        if window_end:
            stepped = self._finish_window(optimizer)
        self._log_train(sums, metrics, inputs, started, stepped, coverage, hard_ce, window_end)

    def _serving_anchors(self, batch: SpeechBatch, inputs: StepInputs, micro: int) -> Optional[list[PreferredRow]]:
        """Serving-aware anchors (training/serving_anchors.py): mine this batch on due steps, then the
        preferred anchor positions of its rows."""
        miner = self.settings.serving_anchors
        if miner is None:
            return None
        if miner.due(self.global_step, micro):
            copy = self.serving_copy()  # a collective: every rank mines on the same steps
            spliced = self.target.splice_batch(batch, self.spec.mask_token_id)
            with self.target.uneven_forwards():  # ranks decode different rounds
                miner.mine(self.target, copy, spliced.inputs_embeds, spliced.loss_mask, batch.sample_ids)
        return miner.preferred(inputs.loss_mask, batch.sample_ids, self.global_step)

    def on_train_epoch_start(self) -> None:
        self._window_weight = 0.0

    def _finish_window(self, optimizer) -> bool:
        """Normalise, clip and apply the window's gradients; ``False`` if the step applied nothing.

        One all-reduce carries the window's Σw, a non-finite flag and Σ grad² (sharded grads
        are summed over ranks, replicated ones counted once), so every rank agrees: a window
        with no supervised weight, or with a NaN / infinite gradient on any rank, changes no
        weight and no optimizer state; ``nonfinite_step_limit`` such steps in a row stop the run.
        """
        params = self.trainable_parameters()
        local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params) if g is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad in local:
            squares = squares + grad.double().pow(2).sum()
        nonfinite = (~torch.isfinite(squares)).double()
        if not self._sharded:
            squares = squares / world_size()  # replicated: every rank holds the whole gradient
        window = torch.as_tensor(self._window_weight, dtype=torch.float64, device=self.device).reshape(())
        total, bad, squares = all_reduce_sum(torch.stack([window, nonfinite, squares])).tolist()  # the one host sync
        self._window_weight = 0.0
        applied = total > 0 and not bad
        if bad:
            self.nonfinite_steps += 1
            self._nonfinite_in_a_row += 1
            log.warning(
                "step %d: non-finite gradient; the step is not applied (%d in a row)",
                self.global_step,
                self._nonfinite_in_a_row,
            )
            if self._nonfinite_in_a_row >= self.settings.nonfinite_step_limit:
                raise NonFiniteTrainingError(
                    f"{self._nonfinite_in_a_row} optimizer steps in a row had a NaN or infinite gradient "
                    f"(dflash.nonfinite_step_limit={self.settings.nonfinite_step_limit}); lower dflash.lr, check the "
                    "data and resume from the last checkpoint"
                )
        else:
            self._nonfinite_in_a_row = 0
        self.grad_norm = math.sqrt(squares) / total if applied else float("nan")
        if applied:
            # normalise and clip in one pass, from the norm just reduced (torch's clip_grad_norm_ rule)
            scale = 1.0 / total
            clip = self.settings.optim.gradient_clip_val
            if clip and self.grad_norm > clip:
                scale *= clip / (self.grad_norm + 1e-6)
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(scale)
        else:
            optimizer.zero_grad(set_to_none=True)  # grad-less params: the optimizer leaves weights and state as they are
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        return applied

    def _log_train(self, sums: torch.Tensor, metrics, inputs: StepInputs, started: float, stepped: bool,
                   coverage: Optional[torch.Tensor] = None, hard_ce: Optional[torch.Tensor] = None,
                   window_end: bool = True) -> None:
        """Add this step's sums to the log window's, on the device; on a log step, log the window.

        Between log steps nothing is read back to the host (each read would stall it until the
        device has caught up). On a log step (``trainer.log_every_n_steps``) one all-reduce sums the
        window over ranks and one read brings it back: loss, accuracy and acceptance are exact ratios
        over the window's steps, throughput is its wall-clock time (the read waits for the device, so
        the time is the device's), and the variant's own metrics are this step's, this rank's.
        ``coverage`` is the anchor draw's ``[Σ coverage, documents, documents not reached]``
        (draft/anchors.py; ``None`` for a placeholder step), pooled over the window's documents. ``hard_ce`` is
        the step's Σ w·CE at every supervised position (the chunked head's), logged as ``train/ce``: the
        hard-label cross-entropy beside an objective that is not it (distillation, the on-policy stage, DFlash2's
        selector term). Only a window's last micro-batch logs, at the step it made (training/lifecycle.py).
        """
        tokens_here = inputs.doc_remaining.ge(0).sum().double().reshape(1)
        if coverage is None:
            coverage = torch.zeros(3, dtype=torch.float64, device=self.device)
        ce_here = torch.zeros(1, dtype=torch.float64, device=self.device) if hard_ce is None else (
            hard_ce.detach().to(device=self.device, dtype=torch.float64).reshape(1))
        window = torch.cat([sums, tokens_here, coverage.to(device=self.device, dtype=torch.float64), ce_here])
        if self._log_window_started is None:
            self._log_window_started = started
        self._log_window = window if self._log_window is None else self._log_window + window
        self._log_window_steps += 1
        self._log_window_skipped += 0 if stepped else 1
        last = self.trainer.max_steps > 0 and self.global_step >= self.trainer.max_steps
        if not window_end or not (self.trainer._logger_connector.should_update_logs or last):  # Lightning's rule
            return
        reasons, data_skips = self._local_data_skips()
        host = torch.tensor([float(self.skip_counts[SKIP_NO_ANCHOR])] + data_skips, dtype=torch.float64, device=self.device)
        variant = self.spec.variant.step_metrics(metrics) if metrics is not None else {}
        local = [value.detach().double().reshape(1) for value in variant.values()]
        summed = torch.cat([all_reduce_sum(torch.cat([self._log_window, host]))] + local).tolist()  # the one read
        now = time.perf_counter()
        elapsed = now - self._log_window_started
        steps, skipped = self._log_window_steps, self._log_window_skipped
        self._log_window, self._log_window_started, self._log_window_steps, self._log_window_skipped = None, now, 0, 0
        count = len(sums)
        total = BlockStats(*summed[:count])
        tokens, covered, documents, unreached, ce_sum, no_anchor = summed[count : count + 6]
        data_values = summed[count + 6 : count + 6 + len(reasons)]
        values = {
            "train/dflash_loss": total.loss,
            "train/dflash_accuracy": total.accuracy,
            "train/accept_len": total.accept_len,
            "train/valid_tokens": total.tokens / steps,
            "train/valid_blocks": total.blocks / steps,
            "train/dflash_skipped_step": float(skipped),
            f"train/skipped/{SKIP_NO_ANCHOR}": no_anchor,
            "train/skipped/nonfinite": float(self.nonfinite_steps),  # agreed on every rank: not reduced
            "train/grad_norm": self.grad_norm,
            "train/tokens_per_second": tokens / max(elapsed, 1e-9),
            "train/step_time": elapsed / steps,
            "train/lr": self.optimizers().param_groups[0]["lr"],
            "train/anchor_coverage": covered / max(documents, 1.0),
            "train/documents_without_block": unreached / max(documents, 1.0),
        }
        values.update({f"data/skipped/{reason}": value for reason, value in zip(reasons, data_values)})
        values.update({f"train/{name}": value for name, value in zip(variant, summed[count + 6 + len(reasons) :])})
        if getattr(self.core, "weighted_ce", None) is not None:  # the chunked head (or MTP's loss) ran
            values["train/ce"] = ce_sum / total.weight if total.weight > 0 else 0.0
        if self.settings.serving_anchors is not None:  # this rank's decode time of the miner (or on-policy stage)
            values["train/mining_seconds"] = self.settings.serving_anchors.take_seconds() / steps
        if torch.cuda.is_available() and self.device.type == "cuda":
            values["train/peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log_dict(values, on_step=True, logger=False)  # callback_metrics: the progress lines and the summary
        for logger in self.loggers:  # at the step just made (Lightning would log them again on later micro-batches)
            logger.log_metrics(values, step=self.global_step)
        self.log_dict(
            {"loss": total.loss, "accept_len": total.accept_len, "tok/s": values["train/tokens_per_second"]},
            prog_bar=True,
            on_step=True,
            logger=False,
        )

    def _local_data_skips(self) -> tuple[list[str], list[float]]:
        """``(reasons, this rank's counts)`` from a datamodule that counts skipped samples (else empty)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "skip_counts"):
            return [], []
        from dflash_train.data.conversation import SKIP_REASONS

        reasons = sorted(SKIP_REASONS)
        local = datamodule.skip_counts()
        return reasons, [float(local.get(reason, 0)) for reason in reasons]

    # ------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        self._val_stats = {name: BlockStats() for name in self.settings.val_names}

    def validation_step(self, batch: SpeechBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        name = self.settings.val_names[dataloader_idx]
        inputs = self.prepare(batch)
        _, sums, _ = self._forward_core(inputs, self._rng_key(0, batch_idx, 1 + dataloader_idx))
        self._val_stats[name].add(BlockStats(*sums.tolist()))

    def on_validation_epoch_end(self) -> None:
        overall = BlockStats()
        for name, stats in self._val_stats.items():
            total = stats.all_reduced(self.device)
            overall.add(total)
            if len(self._val_stats) > 1:
                self.log_dict(
                    {
                        f"val_{name}/dflash_loss": total.loss,
                        f"val_{name}/dflash_accuracy": total.accuracy,
                        f"val_{name}/accept_len": total.accept_len,
                    }
                )
        if overall.batches > 0 and overall.skipped == overall.batches:
            log.warning(
                "every validation batch was skipped (no valid anchor): val_acc=0 is not evidence of useful validation"
            )
        self.log_dict(
            {
                "val/dflash_loss": overall.loss,
                "val/dflash_accuracy": overall.accuracy,
                "val/valid_blocks": overall.blocks,
                "val/skipped_batches": overall.skipped,
            }
        )
        self.log_dict({"val/accept_len": overall.accept_len, "val_acc": overall.accuracy}, prog_bar=True)
        if self.settings.serving_validation is not None and not self.trainer.sanity_checking:
            self._log_serving_validation(self.settings.serving_validation)

    def serving_copy(self) -> torch.nn.Module:
        """The draft as serving runs it: unsharded, in its export form, in the target's dtype and on its device.
        Gathering FSDP2 shards is a collective: every rank must call this at the same point."""
        state = full_state_dict(self.draft, every_rank=True)
        embed = self.target.embed_tokens.weight
        copy = family_of(self.spec.variant).serving_copy(self.draft, self.target, self.spec, state)
        return copy.to(device=embed.device, dtype=embed.dtype).eval()

    def _log_serving_validation(self, serving: ServingValidation) -> None:
        """Decode this rank's share of the serving-validation samples with an unsharded export-form copy of the
        draft and log the pooled counters (docs/training.md, "Serving acceptance during validation")."""
        started = time.perf_counter()
        copy = self.serving_copy()
        with self.target.uneven_forwards():  # ranks decode different records
            counts = serving.measure(self.target, copy, self.global_rank, self.trainer.world_size)
        totals = all_reduce_sum(counts.to(self.device)).cpu()
        values = serving.metrics(totals, time.perf_counter() - started)
        self.log("val/serving_mal", values.pop("val/serving_mal"), prog_bar=True)
        self.log_dict(values)

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> Any:
        from hydra.utils import instantiate

        optim = self.settings.optim
        params = self.trainable_parameters()
        if optim.optimizer is not None:
            optimizer = instantiate(optim.optimizer, params=params)
        else:
            # fused: one kernel per step, and the step counters stay on the device (the per-parameter loop reads
            # each one back to the host every step)
            fused = bool(params) and all(p.device.type in FUSED_ADAMW_DEVICES for p in params)
            optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, fused=fused or None)
        if optim.lr_scheduler is None:
            return optimizer
        scheduler = instantiate(optim.lr_scheduler, optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def describe_sharding(draft: torch.nn.Module) -> str:
    """How much of ``draft`` this rank holds, read off its parameters: DTensor count and local elements.

    Logged on every rank once FSDP2 has sharded the draft, so a launch shows that it shards
    (each rank holding about 1/N of the elements) rather than replicating.
    """
    params = list(draft.parameters())
    sharded = [p for p in params if hasattr(p, "to_local")]
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    total = sum(p.numel() for p in params)
    ranks = {p.device_mesh.size() for p in sharded} or {1}
    return (
        f"draft sharded over {max(ranks)} ranks: {len(sharded)} of {len(params)} parameters are DTensors; "
        f"this rank holds {local} of {total} elements"
    )


SCHEDULE_HORIZON_KEYS = ("total_steps", "T_max", "total_iters")
"""State-dict keys that end a PyTorch LR schedule: OneCycleLR, CosineAnnealingLR, LinearLR / PolynomialLR."""


def describe_restored_state(checkpoint: dict, max_steps: Optional[int]) -> tuple[str, Optional[str]]:
    """What a resume restores (step, learning rates, scheduler state) as one line, and a warning when the
    restored schedule ends before ``max_steps``."""
    step = checkpoint.get("global_step")
    groups = [g for state in checkpoint.get("optimizer_states") or [] for g in state.get("param_groups", [])]
    lrs = ", ".join(f"{g['lr']:.3g}" for g in groups if "lr" in g) or "?"
    schedulers = checkpoint.get("lr_schedulers") or []
    horizon = next(
        (int(state[k]) for state in schedulers for k in SCHEDULE_HORIZON_KEYS if isinstance(state.get(k), (int, float))),
        None,
    )
    if schedulers:
        state = schedulers[0]
        schedule = f"scheduler at step {state.get('last_epoch', '?')}" + (f" of {horizon}" if horizon else "")
    else:
        schedule = "no scheduler (constant lr)"
    message = f"resume: restored global step {step}, lr {lrs}, {schedule}"
    warning = None
    if horizon is not None and max_steps is not None and max_steps > horizon:
        warning = (
            f"trainer.max_steps={max_steps} runs past the restored LR schedule's horizon ({horizon} steps): beyond it "
            "the schedule does what its class does there (OneCycleLR raises, CosineAnnealingLR climbs again, "
            "LinearLR stays put), not what was planned; extend the schedule or lower trainer.max_steps"
        )
    return message, warning
