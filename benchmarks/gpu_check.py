"""The GPU path in one short run: attention backends agree, a realistic FSDP2 + BF16 fit, checkpoint/export/resume.

    python benchmarks/gpu_check.py                 # one CUDA GPU, < 8 minutes on an H200
    python benchmarks/gpu_check.py --cpu-smoke     # tiny sizes on CPU (sdpa): part of `make test`

Needs torch, lightning, transformers, this project and nemo_automodel; no NeMo: the target is
a random-weight Qwen3 causal LM held by :class:`~dflash_train.target.causal_lm.CausalLMTarget`
and batches are text, so the draft-training path (taps, target-argmax labels, nemo_automodel's
DFlash2 trainer core, our Lightning module, FSDP2, export) is the one speech runs take.

(a) **flex vs sdpa**: the same draft weights, batch and anchor seed through both backends;
    loss and every gradient must agree (GPU only: flex_attention's backward needs CUDA; the
    smoke run records it as not run).
(b) **fit**: ``ModelParallelStrategy`` (FSDP2) at world size 1, ``bf16-flash`` (Lightning
    ``bf16-mixed`` + FSDP2 ``MixedPrecisionPolicy``), a Qwen3 target of hidden 2048, 28 layers,
    vocabulary 151936 and a 6-layer DFlash2 draft, on batches whose shapes change every step,
    with two validation runs in between. Reports the median step time, peak memory, the
    number of distinct graphs ``torch.compile`` built (recompiles; must stay bounded) and
    the model FLOPs utilisation::

        FLOPs/step = 2·P_target·T                    target forward over T real tokens (frozen: no backward)
                   + 6·P_draft·Q                     draft forward + backward over Q = blocks·B query tokens
                   + 12·L_draft·Q·C·H                draft attention (QKᵀ and AV, fwd + bwd), C = context + block length
                   + 4·Q·H·V                         target LM head on the draft's outputs (fwd + input grad; frozen)
        MFU        = FLOPs/step / (step time · peak BF16 dense FLOP/s)   (H200 / H100 SXM: 989 TFLOP/s)

    ``P`` counts parameters without the embedding table, ``L_draft`` draft layers, ``H`` the
    hidden size, ``V`` the vocabulary. ``C`` is approximated by the mean row length.
(c) **checkpoint, export, resume**: save a checkpoint, write and strictly re-verify the
    export, resume from the checkpoint and train two more steps.

Prints one JSON report (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_train.atomic import atomic_directory  # noqa: E402
from dflash_train.data.batch import SpeechBatch  # noqa: E402
from dflash_train.draft import DraftSpec, build_draft  # noqa: E402
from dflash_train.draft.export import full_state_dict, verify_export, write_export  # noqa: E402
from dflash_train.target.causal_lm import CausalLMTarget  # noqa: E402
from dflash_train.target.taps import derive_target_layer_ids  # noqa: E402
from dflash_train.training.module import DFlashDraftModule, ModuleSettings, OptimSettings  # noqa: E402
from dflash_train.variants import DFlash2Config  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H100 / H200 SXM dense BF16


@dataclass
class Sizes:
    """Model and batch sizes of one check."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_layers: int
    block_size: int
    num_anchors: int
    rows: tuple[int, ...]  # rows per batch, cycled
    lengths: tuple[int, ...]  # row lengths, cycled
    steps: int
    val_every: int


GPU = Sizes(2048, 28, 16, 8, 6144, 151936, 6, 8, 512, (4, 2, 3), (2048, 3072, 1536), 12, 4)
CPU = Sizes(64, 4, 4, 2, 128, 512, 2, 4, 16, (2, 3), (40, 56), 6, 2)


def build_target(sizes: Sizes, device: torch.device) -> CausalLMTarget:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        head_dim=sizes.hidden // sizes.heads,
        intermediate_size=sizes.intermediate,
        vocab_size=sizes.vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    return CausalLMTarget(model)


def build_spec(sizes: Sizes, target: CausalLMTarget) -> DraftSpec:
    cfg = DFlash2Config(
        draft_num_hidden_layers=sizes.draft_layers,
        block_size=sizes.block_size,
        num_anchors=sizes.num_anchors,
        selector_rank=min(256, sizes.hidden),
        selector_top_k=16,
    )
    layer_ids = tuple(derive_target_layer_ids(target.num_layers, sizes.draft_layers))
    return DraftSpec(cfg, layer_ids, mask_token_id=sizes.vocab - 1, num_target_layers=target.num_layers)


def text_batch(sizes: Sizes, index: int, generator: torch.Generator) -> SpeechBatch:
    """Random tokens; the second half of every row is the supervised reply. Shapes change with ``index``."""
    rows = sizes.rows[index % len(sizes.rows)]
    width = sizes.lengths[index % len(sizes.lengths)]
    lengths = torch.tensor([width - 7 * r for r in range(rows)])
    ids = torch.randint(0, sizes.vocab - 1, (rows, width), generator=generator)
    positions = torch.arange(width)[None, :]
    loss_mask = (positions >= lengths[:, None] // 2) & (positions < lengths[:, None])
    return SpeechBatch(
        input_ids=ids,
        loss_mask=loss_mask,
        lengths=lengths,
        audios=torch.zeros(0, 1),
        audio_lens=torch.zeros(0, dtype=torch.long),
        audios_per_row=[0] * rows,
        sample_ids=[f"b{index}-r{r}" for r in range(rows)],
    )


def _unchanged(batch):
    return batch


def _loader(batches: list[SpeechBatch]):
    from torch.utils.data import DataLoader

    return DataLoader(batches, batch_size=None, collate_fn=_unchanged)


class RandomTextData(L.LightningDataModule):
    """Seeded text batches of changing shapes; validation has its own fixed batches. Resumes by position."""

    def __init__(self, sizes: Sizes):
        super().__init__()
        self.sizes = sizes

    def _batches(self, seed: int, count: int, start: int = 0) -> list[SpeechBatch]:
        generator = torch.Generator().manual_seed(seed)
        batches = [text_batch(self.sizes, i, generator) for i in range(start + count)]
        return batches[start:]

    def train_dataloader(self):
        from dflash_train.data.resume import batches_consumed

        start = batches_consumed(self.trainer)
        return _loader(self._batches(seed=1, count=4 * self.sizes.steps, start=start))

    def val_dataloader(self):
        return _loader(self._batches(seed=2, count=2))


class StepMeter(L.Callback):
    """Wall time of every training step (device-synchronised), tokens and query tokens per step."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.query_tokens: list[float] = []
        self.row_lengths: list[float] = []

    def _sync(self, module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._sync(module)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._sync(module)
        self.times.append(time.perf_counter() - self._started)
        self.tokens.append(int(batch.lengths.sum()))
        self.row_lengths.append(float(batch.lengths.float().mean()))
        blocks = float(trainer.callback_metrics.get("train/valid_blocks", 0.0))
        self.query_tokens.append(blocks * module.spec.cfg.block_size)


def count_parameters(module: torch.nn.Module, skip: tuple[str, ...] = ("embed_tokens",)) -> int:
    return sum(p.numel() for name, p in module.named_parameters() if not any(s in name for s in skip))


def step_flops(sizes: Sizes, p_target: int, p_draft: int, tokens: int, query: float, context: float) -> float:
    """The FLOPs of one step, by the formula in the module docstring."""
    h, v = sizes.hidden, sizes.vocab
    return 2 * p_target * tokens + 6 * p_draft * query + 12 * sizes.draft_layers * query * context * h + 4 * query * h * v


def backend_agreement(sizes: Sizes, target: CausalLMTarget, device: torch.device) -> dict:
    """(a): the same draft, batch and anchors through sdpa and flex_attention; loss and gradient differences."""
    if device.type != "cuda":
        return {"ran": False, "reason": "flex_attention's backward needs CUDA"}
    spec = build_spec(sizes, target)
    batch = text_batch(sizes, 0, torch.Generator().manual_seed(3))
    results = {}
    reference = None
    for backend in ("sdpa", "flex_attention"):
        draft = build_draft(target.llm_config, spec, backend).to(device)
        if reference is None:
            reference = {k: v.clone() for k, v in draft.state_dict().items()}
        draft.load_state_dict(reference)
        module = DFlashDraftModule(target, draft, spec, ModuleSettings(layer_ids=list(spec.layer_ids),
                                                                     attention_backend=backend,
                                                                     stable_shapes=True)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            metrics = module.run_core(module.prepare(batch.to(device)), rng_key=7)
        metrics.loss.backward()
        grads = {n: p.grad.float().clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[backend] = (float(metrics.loss), grads)
    (loss_s, grad_s), (loss_f, grad_f) = results["sdpa"], results["flex_attention"]
    worst = max(((grad_s[n] - grad_f[n]).norm() / grad_s[n].norm().clamp_min(1e-12)).item() for n in grad_s)
    return {"ran": True, "loss_sdpa": loss_s, "loss_flex": loss_f, "loss_rel_diff": abs(loss_s - loss_f) / abs(loss_s),
            "worst_grad_rel_diff": worst, "agree": abs(loss_s - loss_f) / abs(loss_s) < 2e-2 and worst < 5e-2}


def _trainer(sizes: Sizes, device: torch.device, run_dir: Path, max_steps: int, callbacks: list) -> L.Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=False),
        precision="bf16-mixed",
        max_steps=max_steps,
        val_check_interval=sizes.val_every,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
    )


def _module(sizes: Sizes, target: CausalLMTarget, device: torch.device) -> DFlashDraftModule:
    spec = build_spec(sizes, target)
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    torch.manual_seed(0)
    draft = build_draft(target.llm_config, spec, backend)
    settings = ModuleSettings(layer_ids=list(spec.layer_ids), attention_backend=backend,
                              optim=OptimSettings(lr=3e-4), fsdp_param_dtype=torch.bfloat16)
    return DFlashDraftModule(target, draft, spec, settings)


def fit_and_resume(sizes: Sizes, target: CausalLMTarget, device: torch.device, work: Path) -> dict:
    """(b) and (c)."""
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()
    meter = StepMeter()
    module = _module(sizes, target, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = _trainer(sizes, device, work, sizes.steps, [meter])
    trainer.fit(module, datamodule=RandomTextData(sizes))
    graphs = int(dynamo_utils.counters["stats"].get("unique_graphs", 0))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    ckpt = work / "check.ckpt"
    trainer.save_checkpoint(str(ckpt))
    state = full_state_dict(module.draft)
    with atomic_directory(work / "export") as staging:
        write_export(staging, module.draft.config, state)
        tensors = verify_export(staging, state)
    resumed = _module(sizes, target, device)
    again = _trainer(sizes, device, work, sizes.steps + 2, [])
    again.fit(resumed, datamodule=RandomTextData(sizes), ckpt_path=str(ckpt))

    p_target = count_parameters(target.causal_lm, skip=("embed_tokens", "lm_head"))
    p_draft = count_parameters(module.draft)
    warm = slice(2, None)  # the first steps compile
    times = meter.times[warm] or meter.times
    flops = [step_flops(sizes, p_target, p_draft, t, q, c)
             for t, q, c in zip(meter.tokens[warm], meter.query_tokens[warm], meter.row_lengths[warm])]
    median_time = statistics.median(times)
    return {
        "steps": trainer.global_step,
        "step_time_median_s": median_time,
        "step_times_s": meter.times,
        "peak_memory_gib": peak,
        "compiled_graphs": graphs,
        "params_target_non_embedding": p_target,
        "params_draft_non_embedding": p_draft,
        "mfu": statistics.median(f / t for f, t in zip(flops, times)) / PEAK_BF16_FLOPS if device.type == "cuda" else None,
        "export_tensors_verified": tensors,
        "resumed_to_step": again.global_step,
    }


def imported_distributions() -> dict[str, str]:
    """``{distribution: version}`` of every installed distribution whose modules this run imported (what a
    stock image must have or ``gpu_check.sh`` must carry)."""
    from importlib.metadata import packages_distributions, version

    owners = packages_distributions()
    names = {dist for module in list(sys.modules) for dist in owners.get(module.partition(".")[0], [])}
    return {name: version(name) for name in sorted(names)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU with sdpa (CI)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --cpu-smoke")
    sizes, device = (CPU, torch.device("cpu")) if args.cpu_smoke else (GPU, torch.device("cuda", 0))
    started = time.perf_counter()
    target = build_target(sizes, device)
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "sizes": asdict(sizes)}
    report["backend_agreement"] = backend_agreement(sizes, target, device)
    with tempfile.TemporaryDirectory() as work:
        report["fit"] = fit_and_resume(sizes, target, device, Path(work))
    report["wall_s"] = time.perf_counter() - started
    report["imported_distributions"] = imported_distributions()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    fit = report["fit"]
    ok = fit["resumed_to_step"] == sizes.steps + 2 and report["backend_agreement"].get("agree", True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
