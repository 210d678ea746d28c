"""MTP: one multi-token-prediction step trained on the frozen target, served by vLLM's MTP route.

The step reads the target's final hidden state and the next token's embedding and is applied
D times (``num_nextn_predict_layers``, ``use_repeated_layer: true``); the target's embedding
table and LM head are shared, never trained. The export is the target's vLLM-ready directory
with the step stored as NeMo's ``llm.mtp.layers.*`` and an ``mtp`` block (docs/training.md,
"MTP heads"). The step, its objective and its export are ``dflash_train/draft/mtp*.py``, reached
through the ``mtp`` draft family (:mod:`dflash_train.draft.family`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.variants.base import DFlashConfig, DraftVariant, unused_key_problems


@dataclass
class MTPConfig(DFlashConfig):
    """MTP's ``dflash`` section: the shared keys plus the step's repetition, sublayers and step weights."""

    variant: str = "mtp"
    num_nextn_predict_layers: int = 2
    use_repeated_layer: bool = True
    hybrid_override_pattern: str = "*"


DFLASH_ONLY_KEYS = (
    "block_size",
    "serving_anchor_fraction",
    "on_policy_from_step",
    "target_layer_ids",
    "mask_token_id",
    "draft_model_config",
    "gradient_checkpointing",
    "compile_recompile_limit",
)
"""Shared-schema keys MTP has no use for: a value other than their default is a mistake worth one line.
(``draft_num_hidden_layers`` is ignored instead: the demo recipe sizes DFlash drafts with it.)"""


def valid_anchor_mask(loss_mask: torch.Tensor, doc_remaining: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``[B, S]`` positions *p* that can anchor a D-step chain: the bonus token *p + 1* is supervised and
    ``D + 1`` tokens of *p*'s document follow *p* (the bonus and D labels)."""
    valid = doc_remaining >= num_steps + 1
    supervised_next = torch.zeros_like(valid)
    supervised_next[:, :-1] = loss_mask[:, 1:].bool()
    return valid & supervised_next


class MTP(DraftVariant):
    """Chains of D applications of one MTP step per sampled anchor; the export is a SpeechLM MTP target."""

    name = "mtp"
    config_schema = MTPConfig
    export_architecture = "DFlashSpeechLMMTPModel"
    family = "mtp"
    uses_taps = False
    serving_note = (
        "the export is the target itself with its MTP heads: serve it with method \"mtp\" (no draft directory); "
        "dflash-eval --target EXPORT --mtp reproduces vLLM's counters"
    )

    def config_problems(self, cfg: MTPConfig):
        d = cfg.num_nextn_predict_layers
        if d < 1:
            yield f"dflash.num_nextn_predict_layers={d} must be >= 1 (the draft steps trained per anchor)"
        if not cfg.use_repeated_layer:
            yield (
                "dflash.use_repeated_layer=false trains distinct heads, which vLLM cannot serve (it runs one MTP step "
                "for every draft position); keep use_repeated_layer: true"
            )
        if not cfg.hybrid_override_pattern or set(cfg.hybrid_override_pattern) - {"*"}:
            yield (
                f"dflash.hybrid_override_pattern={cfg.hybrid_override_pattern!r}: the trained MTP step has attention "
                "sublayers only ('*', e.g. '*' or '**')"
            )
        yield from super().config_problems(cfg)
        yield from unused_key_problems(cfg, DFLASH_ONLY_KEYS, "mtp")
        if cfg.attention_backend == "flex_attention":
            yield "dflash.attention_backend=flex_attention: the MTP step trains with sdpa; set it to sdpa or null"

    def load_classes(self):
        raise TypeError(
            "the mtp variant has no nemo_automodel classes: its draft is dflash_train.draft.mtp.MTPStep, trained by "
            "dflash_train.draft.mtp_objective.MTPTrainerCore (the mtp draft family)"
        )

    def draft_positions(self, cfg: MTPConfig) -> int:
        return cfg.num_nextn_predict_layers

    def block_span(self, cfg: MTPConfig) -> int:
        return cfg.num_nextn_predict_layers + 1

    def has_valid_anchor(self, cfg: MTPConfig, loss_mask: torch.Tensor, doc_remaining: torch.Tensor) -> bool:
        return bool(valid_anchor_mask(loss_mask, doc_remaining, cfg.num_nextn_predict_layers).any())

    def speculative_tokens(self, cfg: MTPConfig) -> int:
        return cfg.num_nextn_predict_layers

    def describe_draft(self, cfg: MTPConfig) -> str:
        return f"mtp, one step of pattern {cfg.hybrid_override_pattern!r} applied {cfg.num_nextn_predict_layers} times"

    def step_metrics(self, metrics) -> dict[str, torch.Tensor]:
        accuracy = metrics.step_correct / metrics.step_tokens.clamp_min(1)
        return {f"step{k + 1}_accuracy": accuracy[k] for k in range(accuracy.shape[0])}


MTP_VARIANT = MTP()
