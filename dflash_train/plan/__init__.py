"""Will it fit, and how fast can it be: the recipe's training step at full size under fake tensors
(no weights, no GPU), measured for peak memory by category, FLOPs, collectives and a roofline bound.

:func:`plan_run` is the one entry point (``dflash-plan`` and other tools call it)."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from dflash_train.casting import cast_floating
from dflash_train.config.validate import ValidatedConfig
from dflash_train.plan.experts import balanced_expert_routing
from dflash_train.plan.fake import PlannedRun, build_run, fake_world, weights_optional, worst_anchor_draw
from dflash_train.plan.flops import GPUS, StepCost, collective_seconds
from dflash_train.plan.memory import StepMemory
from dflash_train.plan.report import Plan, gpu_figures
from dflash_train.plan.rotary import bounded_rotary_positions
from dflash_train.plan.step import PhaseHooks, phase_contexts, run_step

__all__ = ["GPUS", "Plan", "plan_run", "plan_module_step", "measure_step", "weights_optional"]


def _local_shards(tensors) -> list[torch.Tensor]:
    """This rank's part of each tensor: a DTensor's (FSDP2's draft, the expert-parallel target's experts) local
    shard, whose storage is what the rank holds (a DTensor's own reports the whole tensor's size)."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def measure_step(planned: PlannedRun, world_size: int, cost: Optional[StepCost]) -> StepMemory:
    """Run the planned step twice (the second with the optimizer state in place) and count its memory on
    the second; ``cost`` (when given) counts the second step's FLOPs, bytes and collectives."""
    memory = StepMemory()
    module = planned.module
    memory.register(_local_shards(list(module.target.parameters()) + list(module.target.buffers())), "target_weights")
    memory.register(_local_shards(module.draft.parameters()), "draft_params")
    on_phase = phase_contexts(memory, cost)  # the cost counts only while its mode is on: the second step
    with PhaseHooks(module, on_phase), memory.tracking():
        run_step(module, planned.batch, planned.optimizer, world_size, on_phase, planned.compute_dtype)
        memory.reset_peak()
        with cost if cost is not None else contextlib.nullcontext():
            run_step(module, planned.batch, planned.optimizer, world_size, on_phase, planned.compute_dtype)
    return memory


def plan_module_step(build: Callable[[], tuple], batch, num_anchors: int, gpu: str = "h100",
                     compute_dtype: Optional[torch.dtype] = torch.bfloat16) -> tuple[StepMemory, StepCost]:
    """The plan of a module built outside a recipe (benchmarks/gpu_check.py's, beside what it measures):
    ``build()`` returns ``(module, optimizer)`` and runs under fake tensors over a one-rank fake process group;
    the frozen target is held in ``compute_dtype`` (as a launch loads it) and the step on ``batch`` (every row
    drawing ``num_anchors`` anchors) is measured as :func:`plan_run` measures a recipe's step."""
    def planned(mesh) -> PlannedRun:
        module, optimizer = build()
        if compute_dtype is not None:
            cast_floating(module.target, compute_dtype, frozen=True)
        worst_anchor_draw(module, num_anchors)
        return PlannedRun(module, optimizer, batch, compute_dtype)

    _, memory, cost = _fake_step(planned, 1, gpu)
    return memory, cost


def _fake_step(build: Callable[[object], PlannedRun], world_size: int, gpu: str
               ) -> tuple[PlannedRun, StepMemory, StepCost]:
    """The one sequence every plan runs: a fake ``world_size``-rank process group, balanced expert routing,
    ``build(mesh)`` under fake tensors, then the step measured twice (memory, and the second step's cost on
    ``gpu``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world_size) as mesh, balanced_expert_routing():
        with fake:
            planned = build(mesh)
        cost = StepCost(GPUS[gpu])
        extra_positions = getattr(getattr(planned.module.draft, "config", None), "ttt_steps", 0)  # EAGLE-3 TTT offsets
        with fake, bounded_rotary_positions(planned.module, extra_positions):
            memory = measure_step(planned, world_size, cost)
    return planned, memory, cost


def _check_plannable(run) -> None:
    """What the plan cannot run yet, refused in one line before anything is built: a Nemotron-H target outside
    BF16 (HF's grouped expert matmul has BF16 only under fake tensors)."""
    from dflash_train.errors import ConfigError
    from dflash_train.target.load import is_nemotron_h_speechlm

    if not is_nemotron_h_speechlm(run.model.pretrained_name):
        return
    if not run.trainer.precision.startswith("bf16"):
        raise ConfigError(f"trainer.precision={run.trainer.precision}: dflash-plan plans a Nemotron-H target in BF16 "
                          "only; set trainer.precision=bf16-flash")


def plan_run(validated: ValidatedConfig, gpu: str, world_size: int, gpus_per_node: int = 8) -> Plan:
    """The plan of ``validated`` (a composed, validated recipe) on ``world_size`` ranks of ``gpu`` (a key of
    :data:`GPUS`): the target and draft built from their config files under fake tensors, the recipe's
    step run twice on the worst batch over a fake process group. Reads no weights file."""
    from dflash_train.target.load import check_target_for_run

    run, trainer_kwargs = validated
    _check_plannable(run)
    figures = GPUS[gpu]
    with weights_optional():
        layer_ids = check_target_for_run(run, world_size)
    planned, memory, cost = _fake_step(lambda mesh: build_run(run, trainer_kwargs, layer_ids, mesh), world_size, gpu)
    d = run.dflash
    return Plan(
        gpu=gpu,
        gpu_figures=gpu_figures(figures),
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        variant=d.variant,
        num_anchors=d.num_anchors,
        batch_rows=planned.batch.input_ids.shape[0],
        row_positions=planned.batch.row_lengths[0] - 1 + planned.batch.audio_frames[0],
        supervised_tokens=planned.batch.supervised_tokens,
        max_steps=trainer_kwargs.get("max_steps") if (trainer_kwargs.get("max_steps") or 0) > 0 else None,
        memory_peak_bytes=dict(memory.peak),
        memory_high_water_bytes=dict(memory.high_water),
        flops=dict(cost.flops),
        bytes_moved=dict(cost.bytes),
        roofline_seconds=dict(cost.seconds),
        collective_bytes=dict(cost.collective_bytes),
        collective_group_bytes={str(size): moved for size, moved in sorted(cost.group_bytes.items())},
        collective_seconds=collective_seconds(cost.group_bytes, gpus_per_node, figures),
        knobs={"batch_tokens": run.data.train_ds.batch_tokens, "num_anchors": d.num_anchors,
               "loss_chunk_size": d.loss_chunk_size, "gradient_checkpointing": d.gradient_checkpointing,
               "reshard_after_forward": run.trainer.strategy.reshard_after_forward,
               "ep_size": run.trainer.strategy.ep_size, "precision": run.trainer.precision,
               "strategy": run.trainer.strategy.name},
    )
