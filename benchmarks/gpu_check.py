"""The GPU path in one short run: attention backends agree, a realistic FSDP2 + BF16 fit, checkpoint/export/resume.

    python benchmarks/gpu_check.py                 # one CUDA GPU, about 10 minutes on an H200 (not yet run)
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
    export, resume from the checkpoint and train two more steps; the same steps run uninterrupted
    too, and the two sets of weights are compared (exact on CPU). The fit clips gradients and
    validates, and counts each step's host syncs (CUDA's own sync-debug warnings on a GPU).
(d) **precision**: one step's loss and gradients in FP32 and under BF16 autocast.
(e) **phases**: the median time of each phase of the fit's steps after the first two (data wait, target,
    draft forward with the loss, backward, optimizer and the rest), the device synchronised between them.
    The fit's steps, phases, tokens and host syncs are measured by ``dflash-smoke``'s own callback
    (:class:`~dflash_train.smoke.meter.SmokeMeter`), which ``dflash-smoke`` runs on the user's recipe.
(f) **memory**: peak allocated and reserved memory of a step at 128, 512 and 1024 anchors, beside
    ``dflash-plan``'s prediction of the same step (:func:`dflash_train.plan.plan_module_step`: the same
    target, draft and batch built under fake tensors; its counted peak without optimizer state, and the
    roofline bound of the step on this GPU) and the ratio measured ÷ planned.
(g) **shape sweep** (GPU): 20 batch shapes through the compiled flex step in both grad modes; the
    compile cache entries per compiled function.

Prints one JSON report and a Markdown table of its headline figures (``--out`` also writes both,
``.json`` and ``.md``); the exit code is 0 when every entry of ``checks`` holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import lightning as L
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_train.atomic import atomic_directory  # noqa: E402
from dflash_train.data.batch import SpeechBatch  # noqa: E402
from dflash_train.draft import DraftSpec, build_draft  # noqa: E402
from dflash_train.draft.attention import compiled_entries  # noqa: E402
from dflash_train.draft.export import full_state_dict, verify_export, write_export  # noqa: E402
from dflash_train.target.causal_lm import CausalLMTarget  # noqa: E402
from dflash_train.target.taps import derive_target_layer_ids  # noqa: E402
from dflash_train.smoke.meter import PHASES, SmokeMeter  # noqa: E402
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
    log_every: int
    memory_anchors: tuple[int, ...]  # anchors per row of the memory sweep


GPU = Sizes(2048, 28, 16, 8, 6144, 151936, 6, 8, 512, (4, 2, 3), (2048, 3072, 1536), 25, 10, 4, (128, 512, 1024))
CPU = Sizes(64, 4, 4, 2, 128, 512, 2, 4, 16, (2, 3), (40, 56), 6, 2, 2, (4, 8, 16))


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
        model = Qwen3ForCausalLM(config)  # FP32 (on CPU; the plan's fake copy too, cast by the planner)
    return CausalLMTarget(model.to(torch.bfloat16) if device.type == "cuda" else model)


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


def text_batch(sizes: Sizes, index: int, generator: torch.Generator, rows: int = 0, width: int = 0) -> SpeechBatch:
    """Random tokens; the second half of every row is the supervised reply. Shapes change with ``index``
    (or are ``rows`` × ``width``). The host copies the data loader fills are filled."""
    rows = rows or sizes.rows[index % len(sizes.rows)]
    width = width or sizes.lengths[index % len(sizes.lengths)]
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
    ).with_placements(placeholder_id=-1, audio_frames=[], anchor_runway=int((lengths - 1 - lengths // 2).max()))


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


EMBEDDING_TABLES = ("embed_tokens", "codebook")  # looked up, not multiplied: no FLOPs (DFlash2's selector codebooks)


def count_parameters(module: torch.nn.Module, skip: tuple[str, ...] = EMBEDDING_TABLES) -> int:
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


def _bare_module(sizes: Sizes, target: CausalLMTarget, device: torch.device, **cfg) -> DFlashDraftModule:
    """A module outside Lightning (the phase, memory, precision and shape checks), draft weights seeded."""
    spec = build_spec(sizes, target)
    spec = replace(spec, cfg=replace(spec.cfg, **cfg)) if cfg else spec
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    torch.manual_seed(0)
    draft = build_draft(target.llm_config, spec, backend)
    settings = ModuleSettings(layer_ids=list(spec.layer_ids), attention_backend=backend)
    module = DFlashDraftModule(target, draft, spec, settings)
    return module.to(device) if device.type != "cpu" else module  # built on the CPU (the plan's: fake, not movable)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def anchor_memory(sizes: Sizes, target: CausalLMTarget, device: torch.device) -> dict:
    """Peak allocated and reserved GiB of one training step (forward + backward) at each anchor count, on the
    longest batch; CPU smoke runs the path and reports no figure."""
    result = {}
    batch = text_batch(sizes, 0, torch.Generator().manual_seed(6), rows=max(sizes.rows), width=max(sizes.lengths))
    for anchors in sizes.memory_anchors:
        module = _bare_module(sizes, target, device, num_anchors=anchors)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with _autocast(device):
            metrics = module.run_core(module.prepare(batch.to(device)), rng_key=anchors)
        (metrics.loss * metrics.loss_weight).backward()
        _synchronize(device)
        gib = (lambda value: value / 2**30) if device.type == "cuda" else (lambda value: None)
        allocated = gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        planned = planned_step(sizes, batch, anchors, gpu_key(device))
        result[str(anchors)] = {
            "blocks": float(metrics.valid_blocks),
            "peak_allocated_gib": allocated,
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None,
            **planned,
            "allocated_over_planned": None if allocated is None else allocated / planned["planned_peak_gib"],
        }
        del module, metrics
    return result


def gpu_key(device: torch.device) -> str:
    """The planner's figures for this device (:data:`dflash_train.plan.GPUS`); H100's for CPU and unknown GPUs."""
    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
    return next((key for key in ("h200", "b200", "a100") if key in name), "h100").replace("a100", "a100-80g")


def planned_step(sizes: Sizes, batch: SpeechBatch, anchors: int, gpu: str) -> dict:
    """``dflash-plan``'s prediction of the measured step (same target, draft, batch and anchors, BF16, built under
    fake tensors): the counted peak without optimizer state (the measured step has none) and the roofline bound."""
    from dflash_train.plan import plan_module_step

    def build():
        target = build_target(sizes, torch.device("cpu"))
        module = _bare_module(sizes, target, torch.device("cpu"), num_anchors=anchors)
        return module, torch.optim.AdamW(module.draft.parameters(), foreach=False)

    memory, cost = plan_module_step(build, batch, anchors, gpu)
    counted = sum(memory.peak.values()) - memory.peak.get("optimizer_state", 0)
    return {"planned_peak_gib": counted / 2**30, "planned_step_bound_ms": 1e3 * sum(cost.seconds.values()),
            "planned_gpu": gpu}


def precision_agreement(sizes: Sizes, target: CausalLMTarget, device: torch.device) -> dict:
    """The same draft, batch and anchors in FP32 and under BF16 autocast (the run's precision): relative loss
    difference and the worst relative gradient difference per tensor."""
    batch = text_batch(sizes, 1, torch.Generator().manual_seed(7)).to(device)
    module = _bare_module(sizes, target, device)
    inputs = module.prepare(batch)
    results = {}
    for name, autocast in (("fp32", False), ("bf16", device.type == "cuda")):
        module.draft.zero_grad(set_to_none=True)
        fp32_inputs = replace(inputs, features=inputs.features.float(),
                              embeds=None if inputs.embeds is None else inputs.embeds.float())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            metrics = module.run_core(fp32_inputs, rng_key=11)
        metrics.loss.backward()
        grads = {n: p.grad.float().clone() for n, p in module.draft.named_parameters() if p.grad is not None}
        results[name] = (float(metrics.loss), grads)
    (loss_32, grad_32), (loss_16, grad_16) = results["fp32"], results["bf16"]
    worst = max(((grad_32[n] - grad_16[n]).norm() / grad_32[n].norm().clamp_min(1e-12)).item() for n in grad_32)
    return {"bf16_autocast": device.type == "cuda", "loss_fp32": loss_32, "loss_bf16": loss_16,
            "loss_rel_diff": abs(loss_32 - loss_16) / abs(loss_32), "worst_grad_rel_diff": worst}


SWEEP_ROWS = (1, 2, 3, 5)
SWEEP_LENGTH_FRACTIONS = (0.25, 0.4, 0.55, 0.75, 1.0)  # of the longest row: 4 x 5 = 20 shapes


def shape_sweep(sizes: Sizes, target: CausalLMTarget, device: torch.device) -> dict:
    """torch.compile cache entries of the flex draft step's compiled functions after 20 batch shapes in both
    grad modes (forward + backward in training mode; no_grad as validation runs): the shape classes stay
    few (4 each: grad mode × one row or more) and under ``dflash.compile_recompile_limit``."""
    if device.type != "cuda":
        return {"ran": False, "reason": "the flex path runs on CUDA (CPU: tests/test_compile_shapes.py)"}
    module = _bare_module(sizes, target, device)
    generator = torch.Generator().manual_seed(8)
    shapes = [(rows, max(64, int(max(sizes.lengths) * fraction) // 8 * 8))
              for rows in SWEEP_ROWS for fraction in SWEEP_LENGTH_FRACTIONS]
    started = time.perf_counter()
    for index, (rows, width) in enumerate(shapes):
        batch = text_batch(sizes, index, generator, rows=rows, width=width).to(device)
        with _autocast(device):
            inputs = module.prepare(batch)
            metrics = module.run_core(inputs, rng_key=index)
        (metrics.loss * metrics.loss_weight).backward()
        module.draft.zero_grad(set_to_none=True)
        with torch.no_grad(), _autocast(device):
            module.run_core(inputs, rng_key=index)
    return {"ran": True, "shapes": len(set(shapes)), "entries": compiled_entries(),
            "limit": torch._dynamo.config.recompile_limit, "seconds": time.perf_counter() - started}


def _trainer(sizes: Sizes, device: torch.device, run_dir: Path, max_steps: int, callbacks: list) -> L.Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=False),
        precision="bf16-mixed",
        max_steps=max_steps,
        log_every_n_steps=sizes.log_every,
        use_distributed_sampler=False,  # RandomTextData resumes by position: no sampler of Lightning's in front
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
                              optim=OptimSettings(lr=3e-4, gradient_clip_val=1.0), fsdp_param_dtype=torch.bfloat16)
    return DFlashDraftModule(target, draft, spec, settings)


def fit_and_resume(sizes: Sizes, target: CausalLMTarget, device: torch.device, work: Path) -> dict:
    """(b) and (c)."""
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()
    meter = SmokeMeter(run=None, count_syncs=True)  # dflash-smoke's measurement of a fit
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
    val_loss = trainer.callback_metrics.get("val/dflash_loss")
    grad_norm = module.grad_norm
    resumed = _module(sizes, target, device)
    again = _trainer(sizes, device, work / "resumed", sizes.steps + 2, [])
    again.fit(resumed, datamodule=RandomTextData(sizes), ckpt_path=str(ckpt))
    straight = _module(sizes, target, device)  # the same steps without the interruption
    _trainer(sizes, device, work / "straight", sizes.steps + 2, []).fit(straight, datamodule=RandomTextData(sizes))
    resumed_state, straight_state = full_state_dict(resumed.draft), full_state_dict(straight.draft)
    resume_diff = max((resumed_state[k].float() - straight_state[k].float()).abs().max().item() for k in straight_state)
    record = meter.record
    times = [sum(phases.values()) - phases["data_wait"] for phases in record.phases]
    logs = [step % sizes.log_every == 0 or step >= sizes.steps for step in record.steps]  # Lightning's log steps
    between = [count for log, count in zip(logs[1:], record.syncs[1:]) if not log]  # the first step checks shapes once
    at_log = [count for log, count in zip(logs[1:], record.syncs[1:]) if log]

    p_target = count_parameters(target.causal_lm, skip=("embed_tokens", "lm_head"))
    p_draft = count_parameters(module.draft)
    warm = slice(2, None)  # the first steps compile
    flops = [step_flops(sizes, p_target, p_draft, t, q, c)
             for t, q, c in zip(record.tokens[warm], record.query_tokens[warm], record.row_lengths[warm])]
    median_time = statistics.median(times[warm] or times)
    phases = {name: statistics.median(p[name] for p in record.phases[warm] or record.phases) for name in PHASES}
    return {
        "steps": trainer.global_step,
        "step_time_median_s": median_time,
        "step_times_s": times,
        "phases_s": phases,
        "peak_memory_gib": peak,
        "compiled_graphs": graphs,
        "params_target_non_embedding": p_target,
        "params_draft_non_embedding": p_draft,
        "mfu": (statistics.median(f / t for f, t in zip(flops, times[warm])) / PEAK_BF16_FLOPS
                if device.type == "cuda" else None),
        "export_tensors_verified": tensors,
        "resumed_to_step": again.global_step,
        "resume_weights_max_abs_diff": resume_diff,
        "validation_loss": None if val_loss is None else float(val_loss),
        "gradient_clip_val": module.settings.optim.gradient_clip_val,
        "grad_norm_last": grad_norm,
        "host_syncs_between_log_steps_max": max(between) if between else None,
        "host_syncs_at_log_steps_max": max(at_log) if at_log else None,
        "host_sync_sites": record.sync_sites,
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
    report["precision"] = precision_agreement(sizes, target, device)
    report["memory_by_anchors"] = anchor_memory(sizes, target, device)
    report["shape_sweep"] = shape_sweep(sizes, target, device)
    with tempfile.TemporaryDirectory() as work:
        report["fit"] = fit_and_resume(sizes, target, device, Path(work))
    report["phases_s"] = report["fit"].pop("phases_s")
    report["wall_s"] = time.perf_counter() - started
    report["imported_distributions"] = imported_distributions()
    report["checks"] = checks(report, sizes, device)
    text = json.dumps(report, indent=2)
    print(text)
    print(markdown(report))
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".md").write_text(markdown(report))
    return 0 if all(report["checks"].values()) else 1


MAX_SYNCS_BETWEEN_LOG_STEPS = 3


def checks(report: dict, sizes: Sizes, device: torch.device) -> dict[str, bool]:
    """What must hold for the check to pass (its exit code)."""
    fit, sweep = report["fit"], report["shape_sweep"]
    exact = device.type != "cuda"  # CPU kernels are deterministic; CUDA's atomics may differ in the last bits
    return {
        "backends_agree": report["backend_agreement"].get("agree", True),
        "resumed_to_the_step": fit["resumed_to_step"] == sizes.steps + 2,
        "resume_reproduces_the_weights": fit["resume_weights_max_abs_diff"] <= (0.0 if exact else 1e-3),
        "validation_ran": fit["validation_loss"] is not None,
        "syncs_between_log_steps": (fit["host_syncs_between_log_steps_max"] or 0) <= MAX_SYNCS_BETWEEN_LOG_STEPS,
        "shape_classes_bounded": not sweep["ran"] or max(sweep["entries"].values()) <= 4,
        "bf16_loss_close_to_fp32": report["precision"]["loss_rel_diff"] < 2e-2,
    }


def markdown(report: dict) -> str:
    """The report's headline figures as one Markdown table."""
    fit, phases, precision = report["fit"], report["phases_s"], report["precision"]

    def fmt(value, spec=".3g"):
        return "—" if value is None else format(value, spec)

    rows = [
        ("device", report["device"]),
        ("step time (median, s)", fmt(fit["step_time_median_s"])),
        ("phases (s): " + " / ".join(PHASES), " / ".join(fmt(phases[k]) for k in PHASES)),
        ("MFU", fmt(fit["mfu"], ".1%") if fit["mfu"] is not None else "—"),
        ("peak allocated / reserved GiB by anchors (planned; allocated ÷ planned)", "; ".join(
            f"{a}: {fmt(m['peak_allocated_gib'])} / {fmt(m['peak_reserved_gib'])} ({fmt(m['planned_peak_gib'])}; "
            f"{fmt(m['allocated_over_planned'])})" for a, m in report["memory_by_anchors"].items())),
        ("planned step bound by anchors (ms, dflash-plan's roofline)", "; ".join(
            f"{a}: {fmt(m['planned_step_bound_ms'])}" for a, m in report["memory_by_anchors"].items())),
        ("compile entries over 20 shapes", str(report["shape_sweep"].get("entries", report["shape_sweep"].get("reason")))),
        ("host syncs per step: between log steps / at log steps",
         f"{fit['host_syncs_between_log_steps_max']} / {fit['host_syncs_at_log_steps_max']}"),
        ("BF16 vs FP32: loss rel. diff / worst grad rel. diff",
         f"{fmt(precision['loss_rel_diff'])} / {fmt(precision['worst_grad_rel_diff'])}"),
        ("flex vs sdpa", str(report["backend_agreement"].get("agree", report["backend_agreement"].get("reason")))),
        ("resume: max weight difference vs uninterrupted", fmt(fit["resume_weights_max_abs_diff"])),
        ("checks", ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in report["checks"].items())),
        ("wall time (s)", fmt(report["wall_s"], ".0f")),
    ]
    return "\n".join(["| figure | value |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
