"""DFlash2: DFlash plus an in-block causal convolution and a low-rank candidate selector."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.variants.base import DFlashConfig, automodel_speculative_dflash
from dflash_train.variants.dflash import DFlash


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlash2's ``dflash`` section: the shared keys plus the convolution and the selector."""

    variant: str = "dflash2"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_weight: float = 1.0


SHAPE_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlash2(DFlash):
    """Proposals walk the selector's candidates greedily; its loss and recall are logged."""

    name = "dflash2"
    config_schema = DFlash2Config
    export_architecture = "DFlash2DraftModel"
    architecture_aliases = ("Qwen3DFlash2DraftModel", "DFlashQwen3DFlash2DraftModel")
    export_config_keys = SHAPE_KEYS
    supports_projection_only = True
    serves_on_vllm_cpu = False
    serving_note = (
        "vLLM serves DFlash2 drafts only with its V2 model runner (GPU, Triton); "
        "for vLLM's CPU build train a DFlash draft (dflash=dflash)"
    )

    def load_classes(self):
        dflash = automodel_speculative_dflash()
        return dflash.Qwen3DFlash2DraftModel, dflash.DFlash2TrainerModule

    def trainer_kwargs(self, cfg: DFlash2Config) -> dict:
        return {"selector_loss_weight": cfg.selector_loss_weight}

    def config_problems(self, cfg: DFlash2Config):
        for key in SHAPE_KEYS:
            if getattr(cfg, key) < 1:
                yield f"dflash.{key}={getattr(cfg, key)} must be >= 1"
        if cfg.selector_loss_weight < 0:
            yield f"dflash.selector_loss_weight={cfg.selector_loss_weight} must be >= 0"

    def target_problems(self, cfg: DFlash2Config, dims):
        if dims.hidden_size % cfg.conv_group_size:
            yield f"dflash.conv_group_size={cfg.conv_group_size} must divide the target hidden size {dims.hidden_size}"
        if cfg.selector_top_k > dims.vocab_size:
            yield f"dflash.selector_top_k={cfg.selector_top_k} exceeds the target vocabulary ({dims.vocab_size})"

    def step_metrics(self, metrics) -> dict[str, float]:
        return {
            "base_loss": float(metrics.base_loss),
            "selector_loss": float(metrics.selector_loss),
            "base_accept_len": float(metrics.base_accept_len),
            "candidate_recall": float(metrics.candidate_recall),
        }

    def decode_forward_kwargs(self, num_speculative_tokens: int) -> dict:
        # the in-block convolutions span the whole query block: vLLM sets their block to 1 + K
        return {"conv_block_size": num_speculative_tokens + 1}

    def propose(self, draft, hidden, logits, bonus) -> list[int]:
        anchor = torch.tensor([bonus], dtype=torch.long, device=logits.device)
        path, _, _ = draft.candidate_selector.walk(hidden, logits, anchor, temperature=0.0)
        return path[0].tolist()


DFLASH2 = DFlash2()
