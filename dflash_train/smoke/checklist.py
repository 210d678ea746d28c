"""The smoke's verdict: each runbook item pass / fail with its evidence, and the measured figures.

Everything here reads what the three fits left (:class:`~dflash_train.smoke.meter.FitRecord` of each,
the checkpoints on disk); nothing trains. :func:`markdown` renders one table of items and one of figures.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from dflash_train.smoke.meter import PHASES, FitRecord, StartState



def gpu_key(device_name: Optional[str]) -> Optional[str]:
    """The key of ``dflash-plan``'s GPU table (:data:`~dflash_train.plan.GPUS`: its peak FLOP/s and bandwidths) for a
    ``torch.cuda.get_device_name``, ``None`` for a CPU or a GPU the table does not hold."""
    from dflash_train.plan import GPUS

    name = (device_name or "").upper()
    return next((key for key in GPUS if device_name and key.split("-")[0].upper() in name), None)

MFU_FORMULA = ("MFU = (2·P_target·T + 6·P_draft·Q + 4·Q·H·V) / (step time · peak BF16 FLOP/s); "
               "T = real positions of "
               "the step's batch on all ranks, Q = draft query positions (logged valid blocks × block size, all ranks), "
               "P without embedding tables and LM head, H hidden size, V vocabulary (the target's LM head on the "
               "draft's outputs, forward and input gradient); the draft's attention over its context is left out")


@dataclass
class Item:
    """One checklist line: the runbook item, its verdict and what shows it."""

    name: str
    title: str
    passed: bool
    evidence: str


@dataclass
class FitRun:
    """One of the smoke's three fits: where it ran, what it measured, the steps it should reach."""

    name: str
    run_dir: Path
    record: FitRecord
    expected_steps: int
    error: Optional[str] = None  # the fit raised (a missing shard makes the resume fail)


@dataclass
class Shards:
    """A checkpoint's files against the files its world size needs."""

    checkpoint: Path
    expected: list[str]
    present: list[str]

    @property
    def missing(self) -> list[str]:
        """The expected files that are not there."""
        return [name for name in self.expected if name not in self.present]


def checkpoint_shards(checkpoint: Path, world_size: int) -> Shards:
    """A single-file checkpoint is itself; a distributed one (a directory) needs ``.metadata`` and one
    ``__<rank>_0.distcp`` per rank."""
    if checkpoint.is_dir():
        expected = [".metadata"] + [f"__{rank}_0.distcp" for rank in range(world_size)]
        present = sorted(p.name for p in checkpoint.iterdir())
        return Shards(checkpoint, expected, present)
    present = [checkpoint.name] if checkpoint.is_file() and checkpoint.stat().st_size > 0 else []
    return Shards(checkpoint, [checkpoint.name], present)


def saved_state(checkpoint: Path) -> Optional[StartState]:
    """The step, learning rates and scheduler states a single-file checkpoint holds (``None`` when unreadable)."""
    if not checkpoint.is_file():
        return None
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)
    lrs = [float(g["lr"]) for opt in ckpt.get("optimizer_states", []) for g in opt.get("param_groups", [])]
    return StartState(int(ckpt["global_step"]), lrs, list(ckpt.get("lr_schedulers", [])))


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", … ({len(names)} in all)" if len(names) > limit else "")


def finite_item(fits: list[FitRun]) -> Item:
    """Every loss and every backward's draft gradients finite, on every rank of every fit."""
    counts = [r for fit in fits for r in fit.record.per_rank]
    losses, bad_losses = sum(r["losses"] for r in counts), sum(r["losses_nonfinite"] for r in counts)
    backwards, bad_grads = sum(r["backwards"] for r in counts), sum(r["backwards_with_nonfinite_grads"] for r in counts)
    skipped = sum(fit.record.nonfinite_steps for fit in fits)
    return Item("finite_loss_and_gradients", "finite loss and gradients", losses > 0 and not bad_losses and not bad_grads,
                f"{losses - bad_losses}/{losses} losses finite, {backwards - bad_grads}/{backwards} backward passes with "
                f"every draft gradient finite (all ranks, all fits); steps not applied for a non-finite gradient: {skipped}")


def trainable_item(fits: list[FitRun]) -> Item:
    """The optimizer holds exactly the draft's trainable tensors; no target parameter trains; the target's weights
    end as they began."""
    rec = fits[0].record
    target_trainable = sorted({n for fit in fits for r in fit.record.per_rank for n in r["target_trainable"]})
    changed = [fit.name for fit in fits if any(r["target_unchanged"] is False for r in fit.record.per_rank)]
    optimizer_ok = all(fit.record.optimizer_matches_draft for fit in fits if fit.record.start is not None)
    passed = bool(rec.draft_trainable) and not target_trainable and not changed and optimizer_ok
    evidence = (f"draft: {len(rec.draft_trainable)} tensors, {rec.draft_trainable_count:,} parameters trainable "
                f"({_names(rec.draft_trainable)}); optimizer holds them (same tensor shapes, no target tensor): "
                f"{optimizer_ok}; target parameters "
                f"trainable: {_names(target_trainable) if target_trainable else 'none'}; target weights unchanged by "
                f"training: {'no, in ' + ', '.join(changed) if changed else 'yes (per-tensor sums, every rank)'}")
    return Item("trainable_parameters", "trainable parameters = the draft's; target frozen and unchanged", passed, evidence)


def steps_item(fits: list[FitRun]) -> Item:
    """Each fit's step goes up by one per optimizer step from where it started to its budget."""
    lines, passed = [], True
    for fit in fits:
        steps = fit.record.steps
        start = fit.record.start.step if fit.record.start else None
        # with gradient accumulation a window's first micro-batches end at the step before it
        ok = (fit.error is None and bool(steps) and steps == sorted(steps) and steps[-1] == fit.expected_steps
              and set(steps) - {start} == set(range((start or 0) + 1, fit.expected_steps + 1)))
        passed &= ok
        lines.append(f"{fit.name}: {start} → {steps[-1] if steps else 'none'} (expected {fit.expected_steps})"
                     + (f", failed: {fit.error}" if fit.error else ""))
    return Item("steps_advance", "steps advance", passed, "; ".join(lines))


def skips_item(fits: list[FitRun]) -> Item:
    """The uninterrupted fit's skips by reason; fails only when every step was skipped for want of an anchor."""
    rec = fits[0].record
    reasons = {k: v for k, v in rec.skips.items() if v}
    steps = len(set(rec.steps))
    all_skipped = steps > 0 and rec.skips.get("train/no_valid_anchor", 0) >= steps
    evidence = ("uninterrupted fit: " + (", ".join(f"{k} {int(v)}" for k, v in sorted(reasons.items())) or "no skips")
                + f" over {steps} steps (train/dflash_skipped_step and its reasons; synchronized skips advance the step "
                  "without learning)")
    return Item("skips_by_reason", "skips by reason", not all_skipped, evidence)


def validation_item(fits: list[FitRun]) -> Item:
    """Validation ran and each of its passes had valid blocks (an all-skipped pass logs val_acc=0: no evidence)."""
    blocks = fits[0].record.validations
    return Item("validation_valid_anchors", "validation saw valid anchors", bool(blocks) and all(b > 0 for b in blocks),
                f"{len(blocks)} validation(s) in the uninterrupted fit, valid blocks (all ranks): "
                f"{[int(b) for b in blocks] or 'none ran'}")


def shards_item(shards: list[Shards], world_size: int) -> Item:
    """Every file each saved checkpoint needs at this world size is there."""
    missing = {str(s.checkpoint): s.missing for s in shards if s.missing}
    evidence = "; ".join(f"{s.checkpoint}: {len(s.expected) - len(s.missing)}/{len(s.expected)} files"
                         + (f", missing {s.missing}" if s.missing else "") for s in shards)
    return Item("checkpoint_shards", f"checkpoint shards all present (world size {world_size})",
                bool(shards) and not missing, evidence or "no checkpoint was saved")


def resume_item(saved: Optional[StartState], resumed: FitRun, straight: FitRun, exact: bool) -> Item:
    """The resumed fit starts at the saved step, LRs and scheduler states and ends with the uninterrupted fit's
    weights (bit-equal when ``exact``)."""
    if resumed.error is not None or resumed.record.start is None:
        return Item("exact_resume", "resumed step, LR, scheduler and weights", False,
                    f"the resumed fit did not run: {resumed.error}")
    start = resumed.record.start
    same_state = saved is not None and (start.step, start.lrs, start.schedulers) == (saved.step, saved.lrs,
                                                                                      saved.schedulers)
    a, b = resumed.record.final_state, straight.record.final_state
    same_names = bool(a) and a.keys() == b.keys()
    worst = max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=math.inf) if same_names else math.inf
    tolerance = 0.0 if exact else 1e-3
    passed = same_state and same_names and worst <= tolerance
    saved_text = ("unreadable" if saved is None
                  else f"step {saved.step}, lr {saved.lrs}, {len(saved.schedulers)} scheduler(s)")
    evidence = (f"saved: {saved_text}; resumed: step {start.step}, lr {start.lrs}, scheduler states "
                f"{'equal' if saved is not None and start.schedulers == saved.schedulers else 'differ'}; final weights vs "
                f"the uninterrupted fit at step {straight.expected_steps}: max abs diff {worst:.3g} over {len(a)} tensors "
                f"(allowed {tolerance:g}{', exact on CPU' if exact else ''})")
    return Item("exact_resume", "resumed step, LR, scheduler and weights", passed, evidence)


def export_item(final: FitRun) -> Item:
    """The final export reloaded strictly with the variant's class, every tensor equal to the trained weights."""
    rec = final.record
    passed = rec.export_error is None and bool(rec.export_tensors)
    outcome = (f"reloaded strictly, {rec.export_tensors} tensors equal the trained weights" if passed
               else rec.export_error or "no export was written")
    evidence = f"{final.run_dir / 'export'}: {outcome}"
    return Item("export_reload", "export reloads strictly and equals the weights", passed, evidence)


@dataclass
class Figures:
    """The measured figures of the uninterrupted fit after warm-up (rank 0's timing; memory of every rank)."""

    warmup_steps: int
    measured_steps: int
    phase_median_s: dict[str, float]
    step_median_s: float
    tokens_per_s: float
    mfu: Optional[float]
    mfu_note: str
    memory: list[dict]
    host_syncs_per_step_median: Optional[float]
    host_syncs_per_step_max: Optional[int]
    host_sync_sites: list[str]
    compile_cache_entries: int
    plan: dict = field(default_factory=dict)  # dflash-plan's prediction of each figure, where it ran


def figures(straight: FitRecord, synced: FitRecord, params: dict[str, int], world_size: int,
            device_name: Optional[str]) -> Figures:
    """Medians over the uninterrupted fit's steps after the first fifth (compilation, first shapes), leaving out the
    data wait of batches that followed a validation or a checkpoint write."""
    n = len(straight.phases)
    warm = max(1, n // 5) if n > 1 else 0
    kept = range(warm, n)
    phases = {p: statistics.median([straight.phases[i][p] for i in kept if p != "data_wait"
                                    or not straight.after_validation[i]] or [0.0]) for p in PHASES}
    step_times = [sum(straight.phases[i].values()) - (straight.phases[i]["data_wait"] if straight.after_validation[i] else 0)
                  for i in kept]
    step = statistics.median(step_times) if step_times else math.nan
    tokens = statistics.median([straight.tokens[i] for i in kept]) * world_size if n else 0
    queries = [straight.query_tokens[i] for i in kept if not math.isnan(straight.query_tokens[i])]
    from dflash_train.plan import GPUS

    key = gpu_key(device_name)
    peak = GPUS[key].bf16_flops if key else None
    mfu, note = None, MFU_FORMULA
    if peak is None:
        note += f"; not computed: no BF16 peak for {device_name or 'a CPU'}"
    elif queries:
        q = statistics.median(queries)  # train/valid_blocks is summed over the ranks already
        flops = 2 * params["target"] * tokens + 6 * params["draft"] * q + 4 * q * params["hidden"] * params["vocab"]
        mfu = flops / (step * peak * world_size)
        note += f"; peak {peak:.3g} FLOP/s per GPU × {world_size}"
    syncs = synced.syncs[1:] or synced.syncs  # the first step also checks shapes once
    return Figures(warm, len(kept), phases, step, tokens / step if step else math.nan, mfu, note, straight.memory,
                   statistics.median(syncs) if syncs else None, max(syncs) if syncs else None, synced.sync_sites,
                   straight.compile_entries)


def report_dict(items: list[Item], figs: Figures, context: dict) -> dict:
    """The JSON report: the run's context, every item, the figures."""
    return {**context, "passed": all(i.passed for i in items), "failed": [i.name for i in items if not i.passed],
            "items": [asdict(i) for i in items], "figures": asdict(figs)}


def _gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f} GiB"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _with_plan(figs: Figures, key: str, measured: Optional[float], show: Callable[[float], str]) -> str:
    """``measured`` as ``show`` writes it, with dflash-plan's prediction in the same unit and their ratio beside it."""
    if measured is None:
        return "n/a"
    predicted = figs.plan.get(key)
    if not predicted:
        return show(measured)
    return f"{show(measured)} (plan {show(predicted)}, measured/plan {measured / predicted:.2f})"


def markdown(items: list[Item], figs: Figures, context: dict) -> str:
    """The checklist table, then the figures table."""
    lines = [f"# dflash-smoke: {context['recipe']} ({context['world_size']} process(es), {context['device']})", "",
             "| item | result | evidence |", "| --- | --- | --- |"]
    lines += [f"| {i.title} | {'pass' if i.passed else '**FAIL**'} | {i.evidence.replace('|', '/')} |" for i in items]
    lines += ["", f"Figures of the uninterrupted fit after {figs.warmup_steps} warm-up step(s), median of "
                  f"{figs.measured_steps}:", "", "| figure | value |", "| --- | --- |"]
    for phase, seconds in figs.phase_median_s.items():
        lines.append(f"| step time: {phase} | {_with_plan(figs, phase, seconds, _ms)} |")
    lines.append(f"| step time (sum of phases) | {_with_plan(figs, 'step_s', figs.step_median_s, _ms)} |")
    lines.append(f"| tokens/s (all ranks) | {_with_plan(figs, 'tokens_per_s', figs.tokens_per_s, lambda v: f'{v:,.0f}')} |")
    lines.append(f"| MFU | {_with_plan(figs, 'mfu', figs.mfu, lambda v: f'{100 * v:.1f}%')} |")
    for rank, mem in enumerate(figs.memory):
        if mem["allocated_gib"] is not None:
            allocated = _with_plan(figs, "peak_allocated_gib", mem["allocated_gib"], _gib)
            lines.append(f"| peak memory, rank {rank} | allocated {allocated}, reserved {_gib(mem['reserved_gib'])} |")
        else:
            lines.append(f"| peak memory, rank {rank} | process peak RSS {_gib(mem['process_peak_rss_gib'])} (CPU) |")
    lines.append(f"| host syncs per step | median {figs.host_syncs_per_step_median}, max {figs.host_syncs_per_step_max} |")
    lines.append(f"| compile cache entries (recompiles) | {figs.compile_cache_entries} |")
    lines += ["", figs.mfu_note, "", context["plan_note"], ""]
    failed = [i.name for i in items if not i.passed]
    lines.append(f"**FAILED: {', '.join(failed)}**" if failed else "All items passed.")
    return "\n".join(lines) + "\n"
