"""DFlash2: DFlash plus an in-block causal convolution and a low-rank candidate selector."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from dflash_train.distributed import all_reduce_sum
from dflash_train.loss.head import logits_at
from dflash_train.variants.base import DFlashConfig, automodel_speculative_dflash
from dflash_train.variants.dflash import ChunkedBlockLoss, DFlash, with_chunked_loss


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
        core = with_chunked_loss(ChunkedSelectorLoss, dflash.DFlash2TrainerModule)
        return dflash.Qwen3DFlash2DraftModel, pooled_selector_core(core)

    def trainer_kwargs(self, cfg: DFlash2Config) -> dict:
        return {**super().trainer_kwargs(cfg), "selector_loss_weight": cfg.selector_loss_weight}

    def config_problems(self, cfg: DFlash2Config):
        yield from super().config_problems(cfg)
        for key in SHAPE_KEYS:
            if getattr(cfg, key) < 1:
                yield f"dflash.{key}={getattr(cfg, key)} must be >= 1"
        if cfg.selector_loss_weight < 0:
            yield f"dflash.selector_loss_weight={cfg.selector_loss_weight} must be >= 0"

    def target_problems(self, cfg: DFlash2Config, dims):
        yield from super().target_problems(cfg, dims)
        if dims.hidden_size % cfg.conv_group_size:
            yield f"dflash.conv_group_size={cfg.conv_group_size} must divide the target hidden size {dims.hidden_size}"
        if cfg.selector_top_k > dims.vocab_size:
            yield f"dflash.selector_top_k={cfg.selector_top_k} exceeds the target vocabulary ({dims.vocab_size})"

    def step_metrics(self, metrics) -> dict[str, torch.Tensor]:
        names = ("base_loss", "selector_loss", "base_accept_len", "candidate_recall")
        return {name: torch.as_tensor(getattr(metrics, name)) for name in names}

    def decode_forward_kwargs(self, num_speculative_tokens: int) -> dict:
        # the in-block convolutions span the whole query block: vLLM sets their block to 1 + K
        return {"conv_block_size": num_speculative_tokens + 1}

    def propose(self, draft, hidden, logits, bonus) -> list[int]:
        anchor = torch.tensor([bonus], dtype=torch.long, device=logits.device)
        path, _, _ = draft.candidate_selector.walk(hidden, logits, anchor, temperature=0.0)
        return path[0].tolist()


class ChunkedSelectorLoss(ChunkedBlockLoss):
    """DFlash2's step with the chunked head (:class:`ChunkedBlockLoss`): the block loss (CE, or the run's
    distillation terms), plus the selector's CE against the labels
    over each position's top-k candidates, whose unary scores (their logits) are recomputed from the ``k``
    head rows alone, so no ``[positions, V]`` logits are held for them either.

    The two terms are also left as ``block_ce`` / ``selector_weight`` for :func:`pooled_selector_core`,
    which pools the selector term over ranks.
    """

    def objective(self, hidden, target_ids, mask, teacher=None):
        dflash = automodel_speculative_dflash()
        selector = self.draft_model.candidate_selector
        targets = target_ids[:, :, 1:]
        weights = self.depth_weighted(mask)
        head = self.head_loss(hidden, targets, weights, teacher, top_k=selector.top_k)
        loss_weight = weights.sum()
        block_ce = head.weighted_loss / (loss_weight + 1e-6)

        candidates = head.top_ids
        unary = logits_at(hidden, self.lm_head, candidates, **self.output_transform())
        # teacher-forced predecessor: position k is scored after the token at anchor + k - 1
        scores = selector.pair_scores(hidden, unary, candidates, target_ids[:, :, :-1])
        in_candidates = candidates == targets.unsqueeze(-1)
        selector_mask = mask * in_candidates.any(dim=-1).to(mask.dtype)
        selector_weights = self.depth_weighted(selector_mask)
        nll = F.cross_entropy(
            scores.reshape(-1, scores.shape[-1]).float(),
            in_candidates.to(torch.int64).argmax(dim=-1).reshape(-1),
            reduction="none",
        ).view_as(selector_mask)
        selector_loss = (nll * selector_weights).sum() / (selector_weights.sum() + 1e-6)
        self.block_ce, self.selector_weight = block_ce, selector_weights.sum().detach()

        with torch.no_grad():
            supervised = mask.bool()
            valid_tokens = mask.sum()
            denominator = valid_tokens.clamp_min(1)
            selected = candidates.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
            correct_tokens = ((selected == targets) & supervised).sum()
            accept_len, accept_len_sum, valid_blocks = dflash.core.compute_acceptance_stats(selected, targets, supervised)
            base_correct_tokens = ((head.predictions == targets) & supervised).sum()
            base_accept_len, base_accept_len_sum, _ = dflash.core.compute_acceptance_stats(
                head.predictions, targets, supervised
            )
        return dflash.DFlash2StepMetrics(
            loss=block_ce + self.selector_loss_weight * selector_loss,
            loss_weight=loss_weight.detach(),
            accuracy=correct_tokens / denominator,
            valid_tokens=valid_tokens,
            correct_tokens=correct_tokens,
            accept_len=accept_len,
            accept_len_sum=accept_len_sum,
            valid_blocks=valid_blocks,
            base_loss=block_ce.detach(),
            selector_loss=selector_loss.detach(),
            base_accuracy=base_correct_tokens / denominator,
            base_correct_tokens=base_correct_tokens,
            base_accept_len=base_accept_len,
            base_accept_len_sum=base_accept_len_sum,
            candidate_recall=selector_mask.sum() / denominator,
        )


def pooled_selector_core(core_cls: type) -> type:
    """``core_cls`` (nemo_automodel's DFlash2 trainer core) whose selector term is averaged over every rank's
    batch, so that N ranks train like one process on the concatenated batch.

    The library's step loss is ``CE_w + λ · Σ w_sel·NLL / Σ w_sel``: the block CE's weighted mean plus the
    selector's NLL averaged over the positions whose target is among its candidates (w_sel), both over
    this process's batch. The training module pools ``loss · loss_weight`` over ranks and divides by
    the window's Σ w, which is exact for the CE but turns the selector term into a mean of per-rank
    means. Here each forward all-reduces (Σ w, Σ w_sel) of this micro-batch over the data-parallel ranks
    and scales the selector sum by their ratio, so that summed over ranks and divided by Σ w the step
    minimises ``CE_w + λ · Σ w_sel·NLL / Σ w_sel`` with both sums over every rank's rows: the library's
    objective on the concatenated batch. Every rank runs the core once per micro-batch (a rank without
    anchors runs a placeholder, marked ``placeholder`` by the module and counted as zero), so the
    all-reduce is in step. With gradient accumulation each micro-batch's selector mean is weighted by its
    share of the window's Σ w.

    The two terms are read as ``block_ce`` / ``selector_weight``: set directly by
    :class:`ChunkedSelectorLoss`, caught from the library's loss and selector weighting otherwise.
    """

    class PooledSelector(core_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.placeholder = False  # set by the training module around a placeholder forward
            self._selector_scored = False
            self.selector_weight: torch.Tensor | None = None
            self.block_ce: torch.Tensor | None = None
            self.loss_fn.register_forward_hook(self._keep_block_ce)

        def _keep_block_ce(self, module, args, output) -> None:
            self.block_ce = output.total_loss  # the block CE's mean, still in the graph

        def _selector_scores(self, hidden, logits, target_ids):
            self._selector_scored = True
            return super()._selector_scores(hidden, logits, target_ids)

        def _depth_weights(self, mask):
            weights = super()._depth_weights(mask)
            if self._selector_scored:  # the library weighs the selector's mask right after scoring it
                self._selector_scored = False
                self.selector_weight = weights.sum().detach()
            return weights

        def forward(self, *args, **kwargs):
            self.selector_weight = self.block_ce = None
            metrics = super().forward(*args, **kwargs)
            if self.selector_weight is None or self.block_ce is None:
                raise RuntimeError(f"{core_cls.__name__} no longer weighs its selector term as DFlash2 expects")
            local = torch.stack([metrics.loss_weight.detach(), self.selector_weight]).double()
            if self.placeholder:
                local = torch.zeros_like(local)
            weight, selector_weight = all_reduce_sum(local)
            # metrics.loss - CE_w is the library's λ · Σ w_sel·NLL / (Σ w_sel + 1e-6) over this batch
            selector_sum = (metrics.loss - self.block_ce) * (self.selector_weight + 1e-6)
            scale = torch.where(selector_weight > 0, weight / selector_weight.clamp_min(1e-12), 0.0)
            loss = self.block_ce + selector_sum * scale.to(selector_sum.dtype) / metrics.loss_weight.clamp_min(1e-12)
            self.block_ce = None
            return replace(metrics, loss=loss)

    PooledSelector.__name__ = PooledSelector.__qualname__ = f"PooledSelector{core_cls.__name__}"
    return PooledSelector


DFLASH2 = DFlash2()
