"""Build a DFlash / DFlash2 draft shaped for a given target (nemo_automodel's classes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from dflash_train.draft.anchors import anchor_coverage, documents_of, draw_anchors
from dflash_train.draft.attention import FLEX_LENGTH_MULTIPLE, draft_attention_implementation
from dflash_train.variants import DFlashConfig, DraftVariant, variant_for_architecture, variant_named

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftSpec:
    """What fixes a draft's shape and its contract with the target and vLLM."""

    cfg: DFlashConfig
    layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int

    @property
    def variant(self) -> DraftVariant:
        return variant_named(self.cfg.variant)

    def dflash_config(self) -> dict:
        """The ``dflash_config`` block of the draft's HF config (and of the export)."""
        block = {
            "mask_token_id": int(self.mask_token_id),
            "target_layer_ids": list(self.layer_ids),
            "block_size": int(self.cfg.block_size),
        }
        block.update({key: getattr(self.cfg, key) for key in self.variant.export_config_keys})
        return block


def build_draft_config(target_llm_config, spec: DraftSpec, attention_backend: str):
    """A Qwen3 config for the draft: the target's shape (hidden size, heads, vocab), draft depth.

    Only keys a Qwen3 config defines are taken from the target, so a hybrid target's own keys
    (Nemotron-H's block pattern, Mamba and expert sizes) never reach the draft's ``config.json``;
    a norm epsilon under another name (Nemotron-H's ``layer_norm_epsilon``) is carried over.
    """
    from transformers import Qwen3Config

    target = target_llm_config.get_text_config().to_dict()
    own = set(Qwen3Config().to_dict()) - {"architectures", "layer_types", "max_window_layers", "_name_or_path", "model_type"}
    text = {key: value for key, value in target.items() if key in own}
    if "rms_norm_eps" not in target and "layer_norm_epsilon" in target:
        text["rms_norm_eps"] = target["layer_norm_epsilon"]
    depth = spec.cfg.draft_num_hidden_layers
    text.update(spec.cfg.draft_model_config)
    text.update(
        num_hidden_layers=depth,
        layer_types=["full_attention"] * depth,
        max_window_layers=depth,
        num_target_layers=spec.num_target_layers,
        dflash_config=spec.dflash_config(),
        use_sliding_window=False,
        tie_word_embeddings=False,
    )
    config = Qwen3Config(**text)
    config.architectures = [spec.variant.export_architecture]
    config._attn_implementation = draft_attention_implementation(attention_backend)
    return config


def build_draft(target_llm_config, spec: DraftSpec, attention_backend: str) -> nn.Module:
    """A freshly initialised draft of ``spec.variant`` for this target."""
    draft_cls, _ = spec.variant.load_classes()
    draft = draft_cls(build_draft_config(target_llm_config, spec, attention_backend))
    if spec.cfg.gradient_checkpointing:
        draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return draft


def anchor_count_multiple(block_size: int) -> int:
    """Anchors per row are rounded up to a multiple of this (and to at least two of them), so the draft's
    query length (anchors × block size) is a multiple of ``FLEX_LENGTH_MULTIPLE`` of two tiles or more:
    fewer distinct flex shapes, and never the single-tile class compiled code specialises on."""
    return max(1, FLEX_LENGTH_MULTIPLE // block_size)


def with_stable_anchor_count(trainer_cls: type, multiple: int) -> type:
    """``trainer_cls`` whose per-batch anchor count is rounded up to a multiple of ``multiple``, at least
    ``2 · multiple`` (capped at ``num_anchors``).

    nemo_automodel draws ``min(num_anchors, richest row's valid anchors)`` blocks per row, so
    the block count changes with every batch. The added blocks are the library's own padding
    (anchor 0, ``keep_mask`` false): no label, no loss, no metric; the random draw is unchanged,
    so the same seed selects the same anchors with or without the rounding.
    """

    class StableAnchorCount(trainer_cls):
        def _sample_anchor_positions(self, seq_len, loss_mask, device, doc_remaining=None):
            anchors, keep = super()._sample_anchor_positions(seq_len, loss_mask, device, doc_remaining=doc_remaining)
            drawn = anchors.shape[1]  # above num_anchors only with a per-document budget: never cut
            padded = min(max(self.num_anchors, drawn), max(2 * multiple, -(-drawn // multiple) * multiple))
            if padded > drawn:
                anchors = torch.nn.functional.pad(anchors, (0, padded - drawn))
                keep = torch.nn.functional.pad(keep, (0, padded - drawn), value=False)
            return anchors, keep

    StableAnchorCount.__name__ = StableAnchorCount.__qualname__ = f"StableAnchorCount{trainer_cls.__name__}"
    return StableAnchorCount


@dataclass(frozen=True)
class PreferredRow:
    """A row's preferred anchor positions and the seed that picks which uniformly drawn blocks they replace."""

    positions: list[int]
    seed: int


def with_preferred_anchors(trainer_cls: type) -> type:
    """``trainer_cls`` that can give part of each row's blocks to given positions.

    Before a forward, set ``core.preferred_anchors`` to one :class:`PreferredRow` per row and
    ``core.preferred_fraction`` to f. After the library's uniform draw of a row's ``n`` kept
    anchors, its first ``round(f * n)`` preferred positions that are valid anchors (supervised, a
    full block left in the sequence and the document) each get one block: it replaces a block of
    the uniform draw chosen at random with the row's own seed, so a preferred position the draw
    also picked trains twice, i.e. with double weight. The number of blocks per row, the keep mask
    and every other rule stay the library's; with no preference set the draw is exactly the
    library's.
    """

    class PreferredAnchors(trainer_cls):
        preferred_anchors: list[PreferredRow] | None = None
        preferred_fraction: float = 0.0

        def _sample_anchor_positions(self, seq_len, loss_mask, device, doc_remaining=None):
            anchors, keep = super()._sample_anchor_positions(seq_len, loss_mask, device, doc_remaining=doc_remaining)
            if not self.preferred_anchors or self.preferred_fraction <= 0:
                return anchors, keep
            return replace_with_preferred(
                anchors, keep, self.preferred_anchors, self.preferred_fraction, loss_mask, self.block_size,
                seq_len, doc_remaining,
            )

    PreferredAnchors.__name__ = PreferredAnchors.__qualname__ = f"PreferredAnchors{trainer_cls.__name__}"
    return PreferredAnchors


def replace_with_preferred(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    preferred: list[PreferredRow],
    fraction: float,
    loss_mask: torch.Tensor,
    block_size: int,
    seq_len: int,
    doc_remaining: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept anchors with ``round(fraction * kept)`` of them (at most) given to its valid preferred
    positions, the replaced ones drawn with the row's seed (the rule of :func:`with_preferred_anchors`);
    sorted, same count, same keep mask."""
    supervised = (loss_mask > 0.5).cpu()  # one transfer each, then host lists
    remaining = doc_remaining.cpu() if doc_remaining is not None else None
    rows = anchors.cpu().tolist()
    kept_counts = keep.sum(dim=1).cpu().tolist()
    max_anchor = seq_len - block_size
    for row, wanted in enumerate(preferred):
        kept = int(kept_counts[row])
        valid = []
        for position in wanted.positions:
            ok = 0 <= position <= max_anchor and bool(supervised[row, position])
            if ok and remaining is not None:
                ok = int(remaining[row, position]) >= block_size - 1
            if ok and position not in valid:
                valid.append(position)
        chosen = valid[: round(fraction * kept)]
        if chosen:
            generator = torch.Generator().manual_seed(wanted.seed)
            survivors = torch.randperm(kept, generator=generator)[: kept - len(chosen)].tolist()
            rows[row][:kept] = sorted(chosen + [rows[row][i] for i in survivors])
    return torch.tensor(rows, dtype=anchors.dtype, device=anchors.device), keep


def with_document_budget(trainer_cls: type) -> type:
    """``trainer_cls`` whose packed rows draw up to ``num_anchors`` anchors per document instead of per row
    (``dflash.anchor_budget: per_document``, :mod:`~dflash_train.draft.anchors`). Validity is the library's
    (supervised, a whole block left in the sequence and the document); unpacked rows keep its own draw."""
    from nemo_automodel.components.speculative.dflash import NoValidAnchorsError

    class DocumentBudget(trainer_cls):
        def _sample_anchor_positions(self, seq_len, loss_mask, device, doc_remaining=None):
            if doc_remaining is None:
                return super()._sample_anchor_positions(seq_len, loss_mask, device, doc_remaining=doc_remaining)
            end = max(seq_len - self.block_size, 0) + 1
            valid = (loss_mask[:, :end] > 0.5) & (doc_remaining[:, :end] >= self.block_size - 1)
            anchors, keep = draw_anchors(valid, self.num_anchors, documents_of(doc_remaining)[:, :end])
            if not bool(keep.any()):  # one read, as the library's own count
                raise NoValidAnchorsError("No valid anchor positions in this batch (per-document budget)")
            return anchors, keep

    DocumentBudget.__name__ = DocumentBudget.__qualname__ = f"DocumentBudget{trainer_cls.__name__}"
    return DocumentBudget


def with_anchor_coverage(trainer_cls: type) -> type:
    """``trainer_cls`` that keeps the coverage of its last draw (after every other rule has placed the
    blocks) as ``anchor_coverage_sums``: :func:`~dflash_train.draft.anchors.anchor_coverage` of the
    blocks' predicted positions (``block_size − 1`` after each anchor), a device tensor."""

    class AnchorCoverage(trainer_cls):
        anchor_coverage_sums: torch.Tensor | None = None

        def _sample_anchor_positions(self, seq_len, loss_mask, device, doc_remaining=None):
            anchors, keep = super()._sample_anchor_positions(seq_len, loss_mask, device, doc_remaining=doc_remaining)
            supervised = loss_mask > 0.5
            documents = documents_of(doc_remaining) if doc_remaining is not None else torch.zeros_like(
                supervised, dtype=torch.long)
            self.anchor_coverage_sums = anchor_coverage(anchors, keep, self.block_size - 1, supervised, documents)
            return anchors, keep

    AnchorCoverage.__name__ = AnchorCoverage.__qualname__ = f"AnchorCoverage{trainer_cls.__name__}"
    return AnchorCoverage


def build_trainer_core(
    draft: nn.Module, target, spec: DraftSpec, attention_backend: str, anchor_multiple: int | None = None
) -> nn.Module:
    """nemo_automodel's trainer core (anchors, block mask, decayed CE, metrics) around ``draft``.

    Packed rows may draw their anchors per document (:func:`with_document_budget`); anchors may be
    steered towards given positions (:func:`with_preferred_anchors`, serving-aware training); the
    coverage of every draw is kept (:func:`with_anchor_coverage`); ``anchor_multiple`` rounds the anchor count per batch up
    (:func:`with_stable_anchor_count`); flex runs use :func:`anchor_count_multiple`.
    """
    _, trainer_cls = spec.variant.load_classes()
    if spec.cfg.anchor_budget == "per_document":
        trainer_cls = with_document_budget(trainer_cls)
    trainer_cls = with_preferred_anchors(trainer_cls)
    if anchor_multiple:
        trainer_cls = with_stable_anchor_count(trainer_cls, anchor_multiple)
    trainer_cls = with_anchor_coverage(trainer_cls)
    core = trainer_cls(
        draft_model=draft,
        target_lm_head=target.lm_head,
        target_embed_tokens=target.embed_tokens,
        mask_token_id=spec.mask_token_id,
        block_size=spec.cfg.block_size,
        attention_backend=attention_backend,
        num_anchors=spec.cfg.num_anchors,
        loss_decay_gamma=spec.cfg.loss_decay_gamma,
        **spec.variant.trainer_kwargs(spec.cfg),
    )
    if spec.cfg.step_loss_weights is not None:  # else the library's own decay, untouched
        core.position_weights = spec.variant.step_weights(spec.cfg)
    if spec.cfg.on_policy_from_step >= 0:  # the on-policy stage's loss (variants/dflash.py, ChunkedBlockLoss)
        core.after_rejection_weight = spec.cfg.on_policy_after_rejection_weight
    return core


def warm_start(draft: nn.Module, export_dir: str, spec: DraftSpec) -> None:
    """Load an exported draft into ``draft`` strictly; variant, taps, mask token and the variant's
    shape keys must match the run.

    ``block_size`` may differ (8 → 16): no weight depends on it.
    """
    from pathlib import Path

    from dflash_train.constants import CONFIG_FILE, WEIGHTS_FILE
    from dflash_train.draft.export import DraftExportError, load_strictly
    from dflash_train.errors import ConfigError
    from dflash_train.files import check_safetensors, load_safetensors, read_json_object

    path = Path(export_dir)
    if not (path / CONFIG_FILE).exists() or not (path / WEIGHTS_FILE).exists():
        raise ConfigError(f"dflash.init_from_pretrained='{export_dir}' is not a draft export ({CONFIG_FILE} + {WEIGHTS_FILE})")
    fix = "point dflash.init_from_pretrained at a complete draft export written by dflash-train"
    config = read_json_object(path / CONFIG_FILE, fix)
    check_safetensors(path / WEIGHTS_FILE, fix)  # a truncated copy fails here, before the shape checks
    if config.get("quantization_config") is not None:
        raise ConfigError(
            f"dflash.init_from_pretrained='{export_dir}' is a quantized artifact (quantization_config "
            f"{config['quantization_config'].get('quant_method', '?') if isinstance(config['quantization_config'], dict) else '?'}); "
            "warm start needs a trainable floating-point export (the one dflash-train writes)"
        )
    theirs, ours_rope = _rotary_settings(config), _rotary_settings(draft.config.to_dict())
    if theirs != ours_rope:
        raise ConfigError(
            f"dflash.init_from_pretrained was trained with rotary settings {theirs} but this run's draft uses "
            f"{ours_rope} (they come from the target's LLM config); warm start from a draft of this target family"
        )
    try:
        trained_variant = variant_for_architecture((config.get("architectures") or ["?"])[0])
    except ValueError as err:
        raise ConfigError(f"dflash.init_from_pretrained='{export_dir}': {err}") from None
    if trained_variant.name != spec.variant.name:
        raise ConfigError(
            f"dflash.init_from_pretrained is a {trained_variant.name} draft but this run trains {spec.variant.name}; "
            f"choose dflash={trained_variant.name} or another export"
        )
    trained = config.get("dflash_config", {})
    ours = spec.dflash_config()
    for key in ("target_layer_ids", "mask_token_id", *spec.variant.export_config_keys):
        if key in trained and trained[key] != ours[key]:
            raise ConfigError(
                f"dflash.init_from_pretrained was trained with {key}={trained[key]} but this run uses {ours[key]}; "
                f"set dflash.{key}={trained[key]}"
            )
    weights = load_safetensors(path / WEIGHTS_FILE, fix)
    packed = sorted({str(t.dtype) for t in weights.values() if not t.is_floating_point() or t.element_size() < 2})
    if packed:
        raise ConfigError(
            f"dflash.init_from_pretrained='{export_dir}' holds {', '.join(packed)} tensors (a quantized or packed "
            "artifact); warm start needs a trainable floating-point export (the one dflash-train writes)"
        )
    try:
        load_strictly(draft, weights, source=str(path))
    except DraftExportError as err:
        raise ConfigError(f"dflash.init_from_pretrained: {err}") from None
    log.info("draft: warm start from %s (block_size %s -> %s)", path, trained.get("block_size"), spec.cfg.block_size)


ROTARY_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor")


def _rotary_settings(config: dict) -> dict:
    """The rotary-embedding settings of a config dict (transformers 5's ``rope_parameters`` or the older keys)."""
    settings = {k: config[k] for k in ROTARY_KEYS if config.get(k) is not None}
    parameters = settings.pop("rope_parameters", None)
    if isinstance(parameters, dict):  # transformers 5 folds rope_theta / rope_scaling into rope_parameters
        settings = {**{k: v for k, v in parameters.items() if v is not None}, **settings}
        settings.pop("rope_scaling", None)
    return settings
