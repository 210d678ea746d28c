"""What every draft variant shares: its common config keys and the :class:`DraftVariant` protocol.

A variant (DFlash, DFlash2, next MTP) is one module in this package that subclasses
:class:`DraftVariant` and is registered in :mod:`dflash_train.variants`. Everything the rest
of the framework needs to know about a variant is a member here, so no other module
branches on a variant's name (docs/development.md, Adding a draft variant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

import torch
from torch import nn

from dflash_train.constants import speculative_tokens
from dflash_train.errors import MissingDependencyError
from dflash_train.loss.head import LossTerms

AUTOMODEL_INSTALL = "pip install --no-deps nemo-automodel==0.7.0"


@dataclass
class DFlashConfig:
    """The ``dflash`` section: the draft and its training objective, keys every variant shares
    (docs/configuration.md#dflash). A variant's schema subclasses it with its own keys."""

    variant: str = "dflash"
    block_size: int = 8
    loss_decay_gamma: float = 4.0
    step_loss_weights: Optional[list[float]] = None  # one loss weight per draft position; null: the decay above
    loss_ce_weight: float = 1.0  # hard cross-entropy against the labels
    loss_kl_weight: float = 0.0  # tau^2 KL(target || draft): distillation of the target's next-token distribution
    loss_tv_weight: float = 0.0  # total variation between the two
    distill_top_k: int = 0  # the target's distribution cut to its k likeliest tokens and renormalised (0: all)
    distill_temperature: float = 1.0  # tau, both distributions' softmax temperature in the kl / tv terms
    num_anchors: int = 512
    anchor_budget: str = "per_row"  # num_anchors per row, or per document of a packed row (draft/anchors.py)
    label_source: str = "target_argmax"
    projection_only: bool = False
    draft_num_hidden_layers: int = 6
    target_layer_ids: Optional[list[int]] = None
    mask_token_id: Optional[int] = None
    init_from_pretrained: Optional[str] = None
    output_dir: str = "export"
    lr: float = 6.0e-4
    weight_decay: float = 0.0
    optimizer: Optional[dict] = None
    lr_scheduler: Optional[dict] = None
    loss_chunk_size: int = 256
    use_fused_linear_ce: bool = False  # NeMo's recipe key, accepted as NeMo writes it; true is refused (chunked loss)
    attention_backend: Optional[str] = None
    compile_recompile_limit: int = 8  # entries per compiled function of a flex run before the run stops
    gradient_checkpointing: bool = False
    nonfinite_step_limit: int = 3
    serving_val_samples: int = 0  # validation records decoded like serving at every validation (0: off)
    serving_val_max_new_tokens: int = 64  # greedy reply length cap of that decoding
    serving_val_perception_dtype: str = "bfloat16"  # serving's perception precision (vLLM runs it in bfloat16)
    serving_anchor_fraction: float = 0.0  # share of a row's blocks at mined post-correction round starts (0: off)
    serving_anchor_every: int = 10  # steps between two minings of the current batch's round starts
    on_policy_from_step: int = -1  # the on-policy stage from this step on (training/serving_anchors.py; -1: off)
    on_policy_anchor_fraction: float = 1.0  # share of a row's blocks at its mined round starts in that stage
    on_policy_reverse_kl_weight: float = 1.0  # tau^2 KL(draft || target) at a block's first rejected position
    on_policy_after_rejection_weight: float = 0.0  # the run's loss terms at positions not accepted (0: none there)
    draft_model_config: dict = field(default_factory=dict)


ANCHOR_BUDGETS = ("per_row", "per_document")
"""``dflash.anchor_budget`` values: ``num_anchors`` per row (default) or per packed document
(:mod:`dflash_train.draft.anchors`)."""


def decayed_step_weights(num_steps: int, gamma: float) -> list[float]:
    """``w_k = exp(-(k-1)/gamma)`` for k = 1..D: the DFlash block loss's decay over draft positions."""
    return [math.exp(-k / gamma) for k in range(num_steps)] if gamma > 0 else [1.0] * num_steps


def _loss_problems(cfg: DFlashConfig) -> Iterator[str]:
    """The rules of the loss keys (:class:`~dflash_train.loss.head.LossTerms`)."""
    weights = {key: getattr(cfg, key) for key in ("loss_ce_weight", "loss_kl_weight", "loss_tv_weight")}
    if min(weights.values()) < 0 or sum(weights.values()) <= 0:
        yield (
            f"dflash.loss_ce_weight / loss_kl_weight / loss_tv_weight = {', '.join(map(str, weights.values()))} must be "
            "non-negative and not all zero (the default is 1 / 0 / 0: cross-entropy alone)"
        )
    if cfg.distill_temperature <= 0:
        yield f"dflash.distill_temperature={cfg.distill_temperature} must be > 0"
    if cfg.distill_top_k < 0:
        yield f"dflash.distill_top_k={cfg.distill_top_k} must be >= 0 (0: the target's whole distribution)"
    if cfg.on_policy_from_step >= 0:
        yield from _on_policy_problems(cfg)
    else:
        idle = changed_from_default(cfg, ON_POLICY_KEYS)
        if idle:
            yield (f"dflash.{idle[0]} is set but the on-policy stage is off (dflash.on_policy_from_step=-1): set "
                   "on_policy_from_step to the step it starts at, or remove the key")
    if (cfg.loss_kl_weight > 0 or cfg.loss_tv_weight > 0) and cfg.loss_chunk_size == 0:
        yield (
            "dflash.loss_kl_weight / loss_tv_weight (distillation) with dflash.loss_chunk_size=0: only the chunked loss "
            "distills; set loss_chunk_size > 0 (the default 256) or the two weights to 0"
        )


def changed_from_default(cfg: DFlashConfig, keys) -> list[str]:
    """The ``keys`` of ``cfg`` whose value differs from the shared schema's default (keys that were set)."""
    defaults = DFlashConfig()
    return [key for key in keys if getattr(cfg, key) != getattr(defaults, key)]


def unused_key_problems(cfg: DFlashConfig, keys, variant: str) -> Iterator[str]:
    """One line per key of ``keys`` (shared-schema keys ``variant`` has no use for) set to other than its default."""
    for key in changed_from_default(cfg, keys):
        yield f"dflash.{key} is a DFlash key the {variant} variant does not use; remove it (override ~dflash.{key})"


ON_POLICY_KEYS = ("on_policy_anchor_fraction", "on_policy_reverse_kl_weight", "on_policy_after_rejection_weight")
"""The on-policy stage's keys besides ``on_policy_from_step``: they mean nothing while the stage is off."""


def _on_policy_problems(cfg: DFlashConfig) -> Iterator[str]:
    """The rules of the on-policy stage's keys (``dflash.on_policy_*``), when it is on."""
    if not 0 < cfg.on_policy_anchor_fraction <= 1:
        yield f"dflash.on_policy_anchor_fraction={cfg.on_policy_anchor_fraction} must be in (0, 1]"
    if cfg.on_policy_reverse_kl_weight < 0:
        yield f"dflash.on_policy_reverse_kl_weight={cfg.on_policy_reverse_kl_weight} must be >= 0"
    if not 0 <= cfg.on_policy_after_rejection_weight <= 1:
        yield f"dflash.on_policy_after_rejection_weight={cfg.on_policy_after_rejection_weight} must be in [0, 1]"
    if cfg.serving_anchor_fraction > 0:
        yield ("dflash.on_policy_from_step and dflash.serving_anchor_fraction both place blocks at mined round starts "
               "(every start vs. post-correction ones): set serving_anchor_fraction=0 or on_policy_from_step=-1")
    if cfg.loss_chunk_size == 0:
        yield "dflash.on_policy_from_step needs the chunked loss: set dflash.loss_chunk_size > 0 (the default 256)"
    if cfg.on_policy_reverse_kl_weight > 0 and cfg.distill_top_k > 0:
        yield (f"dflash.on_policy_reverse_kl_weight with dflash.distill_top_k={cfg.distill_top_k}: the reverse KL needs "
               "the target's whole distribution; set distill_top_k=0 or on_policy_reverse_kl_weight=0")


class TargetDims(NamedTuple):
    """The target sizes that recipe values are checked against."""

    num_layers: int
    hidden_size: int
    vocab_size: int


def automodel_speculative_dflash():
    """nemo_automodel's DFlash package (draft models and trainer cores), or a one-line install hint."""
    try:
        from nemo_automodel.components.speculative import dflash
    except ImportError as err:
        raise MissingDependencyError(
            f"draft training needs nemo-automodel's DFlash classes ({err}); install them with `{AUTOMODEL_INSTALL}` "
            "(--no-deps: its own pins conflict with NeMo; its DFlash classes import lhotse, hydra and HF datasets, "
            "which this project's install brings)"
        ) from None
    return dflash


class DraftVariant:
    """How one draft method is configured, built, trained, exported, warm-started and decoded.

    Subclasses set the class attributes and override the hooks that differ; the defaults
    are the DFlash behaviour (argmax proposals, no extra keys, rules or metrics).
    """

    name: str
    """``dflash.variant`` value and config group option (``dflash=<name>``)."""
    config_schema: type[DFlashConfig] = DFlashConfig
    """The typed ``dflash`` section of this variant: its keys and defaults."""
    export_architecture: str
    """The class name vLLM's model registry serves this draft under."""
    architecture_aliases: tuple[str, ...] = ()
    """Training-time class names (nemo_automodel's) that mean the same architecture."""
    export_config_keys: tuple[str, ...] = ()
    """``dflash.*`` keys copied into the export's ``dflash_config`` besides the shared ones; they
    shape the weights, so a warm start must match them too."""
    supports_projection_only: bool = False
    """Whether ``dflash.projection_only`` (train only the feature projection) applies."""
    serving_note: str = ""
    """What a user must know before serving this variant's export."""
    serves_on_vllm_cpu: bool = True
    """Whether vLLM's CPU build can serve the export (the end-of-run summary then prints its command too)."""
    family: str = "block"
    """How the draft is built, trained, exported and served: a key of
    :data:`dflash_train.draft.family.FAMILIES` (``block``: a DFlash-style draft of nemo_automodel's
    classes exported as its own directory; ``mtp``: MTP heads exported inside the target)."""
    uses_taps: bool = True
    """Whether the draft reads tapped target features (``dflash.target_layer_ids``); ``False``: it reads the
    target's final hidden state and the token embeddings instead."""
    reads_target_distribution: bool = False
    """Whether the trainer core learns the target's next-token distribution: the module then hands it the
    target's final hidden states (``teacher_hidden``) whatever the loss terms."""

    def tap_count(self, cfg: DFlashConfig) -> int:
        """How many target layers the draft taps when ``dflash.target_layer_ids`` is null (DFlash: one per
        draft layer)."""
        return cfg.draft_num_hidden_layers

    def block_span(self, cfg: DFlashConfig) -> int:
        """Real tokens of its document that must follow an anchor position (DFlash: the rest of a full block)."""
        return cfg.block_size - 1

    def draft_positions(self, cfg: DFlashConfig) -> int:
        """Positions one block (chain) drafts and the loss weighs: ``block_size − 1`` for a block draft."""
        return cfg.block_size - 1

    def step_weights(self, cfg: DFlashConfig) -> list[float]:
        """The loss weight of each draft position: ``dflash.step_loss_weights``, else ``exp(−(k−1)/γ)``."""
        if cfg.step_loss_weights is not None:
            return [float(w) for w in cfg.step_loss_weights]
        return decayed_step_weights(self.draft_positions(cfg), cfg.loss_decay_gamma)

    def loss_terms(self, cfg: DFlashConfig) -> LossTerms:
        """What the draft's loss minimises per position (``dflash.loss_*``, ``dflash.distill_*``)."""
        reverse = cfg.on_policy_reverse_kl_weight if cfg.on_policy_from_step >= 0 else 0.0
        return LossTerms(cfg.loss_ce_weight, cfg.loss_kl_weight, cfg.loss_tv_weight, cfg.distill_top_k,
                         cfg.distill_temperature, reverse)

    def has_valid_anchor(self, cfg: DFlashConfig, loss_mask: torch.Tensor, doc_remaining: torch.Tensor) -> bool:
        """Whether a batch holds any anchor this variant trains on."""
        return bool((loss_mask & (doc_remaining >= self.block_span(cfg))).any())

    def placeholder_length(self, cfg: DFlashConfig) -> int:
        """Length of the smallest fully supervised row that holds one valid anchor."""
        return self.block_span(cfg) + 1

    def speculative_tokens(self, cfg: DFlashConfig) -> int:
        """K, the tokens vLLM should draft per round with this variant's export."""
        return speculative_tokens(cfg.block_size)

    def describe_draft(self, cfg: DFlashConfig) -> str:
        """The draft's shape in a log line."""
        return f"{self.name}, {cfg.draft_num_hidden_layers} layers"

    def load_classes(self) -> tuple[type[nn.Module], type[nn.Module]]:
        """nemo_automodel's ``(draft model class, trainer core class)`` (``block`` family)."""
        raise NotImplementedError

    def trainer_kwargs(self, cfg: DFlashConfig) -> dict:
        """Extra keyword arguments of this variant's trainer core."""
        return {}

    def config_problems(self, cfg: DFlashConfig) -> Iterator[str]:
        """One message per violated rule of this variant's keys (checked at start-up); a variant with keys of its
        own extends it."""
        weights, positions = cfg.step_loss_weights, self.draft_positions(cfg)
        if weights is not None and (len(weights) != positions or min(weights) < 0 or sum(weights) <= 0):
            yield (
                f"dflash.step_loss_weights={list(weights)} must list {positions} non-negative weights (one per draft "
                "position, not all zero), or be null for the decayed default"
            )
        if weights is not None and self.family == "block" and cfg.loss_chunk_size == 0:
            yield (
                "dflash.step_loss_weights with dflash.loss_chunk_size=0: the library's own loss decays by "
                "loss_decay_gamma only; set loss_chunk_size > 0 (the default 256) or step_loss_weights=null"
            )
        yield from _loss_problems(cfg)

    def target_problems(self, cfg: DFlashConfig, dims: TargetDims) -> Iterator[str]:
        """One message per key that does not fit the target's sizes; a variant with keys of its own extends it."""
        if cfg.distill_top_k > dims.vocab_size:
            yield f"dflash.distill_top_k={cfg.distill_top_k} exceeds the target vocabulary ({dims.vocab_size}); 0 keeps all of it"

    def step_metrics(self, metrics) -> dict[str, torch.Tensor]:
        """Variant-specific training metrics of a step's trainer-core output (``train/<name>``), as device
        scalars: the module reads them back only on log steps, with the step's other sums."""
        return {}

    def decode_forward_kwargs(self, num_speculative_tokens: int) -> dict:
        """Extra draft-forward arguments for a query block of K+1 positions, as vLLM passes them."""
        return {}

    def propose(self, draft: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, bonus: int) -> list[int]:
        """K proposed tokens from the draft's K hidden states and logits (``bonus`` precedes the first),
        as vLLM's proposer picks them under greedy decoding."""
        return logits[0].argmax(dim=-1).tolist()

    def __repr__(self) -> str:
        return f"<draft variant {self.name}>"
