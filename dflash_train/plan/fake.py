"""The run at full size without its weights: target and draft built from config files under fake
tensors, over a fake process group of the run's world size, fed the worst batch the recipe allows.

Fake tensors carry shapes, dtypes and storages but no data, so memory is accounted as on the device
and nothing is computed. Three things the real step reads back from its data are given here instead:

* the anchor draw (``_sample_anchor_positions``, MTP's ``sample_anchors``): the real draw keeps
  ``min(num_anchors, valid positions)`` per row, a data-dependent count; the worst batch has at least
  ``num_anchors`` valid positions in every row, so the plan's draw keeps ``num_anchors`` spread over it;
* the perception's first-batch check of its frame counts against the host's (``_frames_checked``,
  marked done while the step is measured: :class:`~dflash_train.plan.step.PhaseHooks`): the batch's
  counts are the estimator's own;
* the batch's host copies (placements, supervised count, documents, anchor runway), which the data
  loader fills on every real batch too.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

import torch

from dflash_train.casting import cast_floating
from dflash_train.config.schema import RunConfig
from dflash_train.data.batch import SpeechBatch
from dflash_train.draft.build import DraftSpec
from dflash_train.errors import ConfigError
from dflash_train.target.salm import SALMTarget
from dflash_train.training.module import DFlashDraftModule
from dflash_train.training.recipe import setup_draft, setup_module


@contextmanager
def weights_optional() -> Iterator[None]:
    """The launch's checks of the target with its weights file allowed to be absent: the plan reads config
    files only. A weights file that is there is still checked whole (a truncated copy still fails)."""
    from unittest import mock

    from dflash_train.target import salm

    check = salm.check_safetensors

    def check_if_present(path: Path, fix: str):
        return check(path, fix) if Path(path).exists() else None

    with mock.patch.object(salm, "check_safetensors", check_if_present):
        yield


@contextmanager
def fake_world(world_size: int) -> Iterator[object]:
    """A fake process group of ``world_size`` ranks (this process is rank 0; collectives move nothing)
    and its one-dimensional data-parallel mesh; torch's own test backend. Torn down on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("dflash-plan needs its own process group; one is already initialised")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def build_salm_from_config(directory: Path, dtype: torch.dtype) -> SALMTarget:
    """NeMo's SALM built from ``directory``'s ``config.json`` alone (its weights file is never opened);
    under fake mode its parameters are fake. The LLM comes from the config's ``pretrained_llm``
    directory's config (``pretrained_weights: false`` in a config built by the tiny builders)."""
    from nemo.collections.speechlm2.models import SALM

    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.pretrained_name={directory} has no config.json: point it at a SALM checkpoint directory")
    config = json.loads(config_file.read_text())
    config["pretrained_weights"] = False
    cwd = os.getcwd()
    os.chdir(directory)  # the config's relative paths (tokenizer, LLM config) are the checkpoint's
    try:
        salm = SALM(config)
    finally:
        os.chdir(cwd)
    cast_floating(salm, dtype, frozen=True)
    return SALMTarget(salm)


def build_nemotron_h_from_config(directory: Path, dtype: torch.dtype):
    """A Nemotron-H SpeechLM target built from ``directory``'s config files alone (``config.json``, the
    backbone's config, the tokenizer), as :meth:`NemotronHSpeechLMTarget.from_checkpoint` builds it before
    it reads the weights; under fake mode its parameters are fake."""
    from nemo.collections.common.tokenizers import AutoTokenizer
    from nemo.collections.speechlm2.modules import AudioPerceptionModule
    from omegaconf import DictConfig
    from transformers import AutoConfig, NemotronHForCausalLM

    from dflash_train.constants import LLM_BACKBONE_DIR
    from dflash_train.target.nemotron_h import NemotronHSpeechLMTarget

    config = json.loads((directory / "config.json").read_text())
    llm = NemotronHForCausalLM(AutoConfig.from_pretrained(directory / LLM_BACKBONE_DIR))
    perception = AudioPerceptionModule(DictConfig(config["perception"]))
    tokenizer = AutoTokenizer(str(directory), use_fast=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [config["audio_locator_tag"]]})
    target = NemotronHSpeechLMTarget(llm, perception, tokenizer, config, directory)
    cast_floating(target, dtype, frozen=True)
    return target.eval()


@dataclass
class PlannedRun:
    """The module, its optimizer and the worst batch, all fake, as :func:`build_run` makes them."""

    module: DFlashDraftModule
    optimizer: torch.optim.Optimizer
    batch: SpeechBatch
    compute_dtype: Optional[torch.dtype]


def build_run(run: RunConfig, trainer_kwargs: dict, layer_ids: list[int], mesh, target=None,
              worst_anchors: bool = True) -> PlannedRun:
    """The recipe's draft, module and optimizer on ``target`` (built from config when ``None``), the draft
    sharded over ``mesh`` when the strategy is FSDP2, and the worst batch. Call under the tensor mode the
    plan runs in (fake, or none for the check against real tensors, which may keep the module's own anchor
    draw: ``worst_anchors=False``)."""
    half = torch.bfloat16 if run.trainer.precision.startswith("bf16") else None
    # serving validation decodes at validation time, not in the training step the plan measures
    run = replace(run, dflash=replace(run.dflash, serving_val_samples=0))
    if target is None:
        from dflash_train.target.load import is_nemotron_h_speechlm

        directory = Path(run.model.pretrained_name).expanduser()
        build = build_nemotron_h_from_config if is_nemotron_h_speechlm(str(directory)) else build_salm_from_config
        target = build(directory, half or torch.float32)
    if run.trainer.strategy.ep_size > 1 and not target.experts_sharded:  # as the module's setup shards them
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # its device mesh is built on real tensors; the fake experts stay fake
            target.shard_experts(run.trainer.strategy.ep_size, torch.device("cpu"))
    d = run.dflash
    mask = d.mask_token_id if d.mask_token_id is not None else target.default_mask_token_id()
    spec = DraftSpec(d, tuple(layer_ids), mask, target.num_layers)
    backend = "sdpa"  # flex attention has no CPU path; its memory is SDPA's (both keep output + logsumexp)
    draft = setup_draft(run, target, spec, backend)
    module = setup_module(run, target, draft, spec, backend, None, half, dict(trainer_kwargs))
    if run.trainer.strategy.name == "fsdp2" and mesh is not None:
        module._device_mesh = mesh
        module.configure_model()
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    if worst_anchors:
        worst_anchor_draw(module, d.num_anchors)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the frame estimator checks itself on real lengths; the batch is small
        batch = worst_batch(run, target)
    return PlannedRun(module, optimizer, batch, half)


def worst_anchor_draw(module: DFlashDraftModule, num_anchors: int) -> None:
    """The core draws ``num_anchors`` anchors in every row (the worst case), with no read of the data: DFlash's
    and DFlash2's ``_sample_anchor_positions``, MTP's ``sample_anchors``."""
    core = module.core

    def spread(rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        count = max(1, min(num_anchors, width))
        anchors = (torch.arange(count, device=device) * max(1, width // count)).expand(rows, count).contiguous()
        return anchors, torch.ones(rows, count, dtype=torch.bool, device=device)

    if hasattr(core, "sample_anchors"):
        core.sample_anchors = lambda valid, documents=None: spread(valid.shape[0], valid.shape[1], valid.device)
    else:
        core._sample_anchor_positions = (
            lambda seq_len, loss_mask, device, doc_remaining=None: spread(loss_mask.shape[0], seq_len, device))


@dataclass(frozen=True)
class BatchShape:
    """The worst batch's shape: rows, text tokens and audio samples per row, perception frames per audio."""

    rows: int
    text_tokens: int
    audio_samples: int
    audio_frames: int

    @property
    def positions(self) -> int:
        """LLM positions per row (text plus the audio's frames in place of its placeholder)."""
        return self.text_tokens - 1 + self.audio_frames


def worst_shape(run: RunConfig, target) -> BatchShape:
    """The largest batch the recipe's training split admits: ``batch_tokens`` filled with rows of the longest
    sample (``max_tokens``, else the whole budget; a packed row is ``batch_tokens`` long), each with one audio
    of ``max_duration`` (else 30 s) and supervised text after it."""
    from dflash_train.data.estimator import AudioTokenEstimator

    ds = run.data.train_ds
    if ds.batch_tokens is None:
        raise ConfigError("dflash-plan sizes the batch from data.train_ds.batch_tokens; set it (batch_size alone "
                          "leaves the row length unknown)")
    length = ds.batch_tokens if ds.packing or ds.max_tokens is None else min(ds.max_tokens, ds.batch_tokens)
    samples = int((ds.max_duration or 30.0) * target.sampling_rate)
    frames = AudioTokenEstimator.from_target(target).frames(samples)
    if frames >= length - 8:
        raise ConfigError(f"one audio of {ds.max_duration} s is {frames} LLM positions, no room for text in a row of "
                          f"{length}; raise data.train_ds.max_tokens or lower data.train_ds.max_duration")
    return BatchShape(max(1, ds.batch_tokens // length), length - frames + 1, samples, frames)


PROMPT = 4  # text positions before the audio placeholder; the reply follows it


def worst_batch(run: RunConfig, target) -> SpeechBatch:
    """A collated batch of :func:`worst_shape` with its host copies filled as the data loader fills them:
    one audio per row after a short prompt, every text position after it supervised."""
    shape = worst_shape(run, target)
    rows, length = shape.rows, shape.text_tokens
    ids = torch.full((rows, length), target.pad_id, dtype=torch.long)
    ids[:, PROMPT] = target.audio_locator_tag_id
    loss_mask = torch.zeros(rows, length, dtype=torch.bool)
    loss_mask[:, PROMPT + 1:] = True
    return SpeechBatch(
        input_ids=ids,
        loss_mask=loss_mask,
        lengths=torch.full((rows,), length),
        audios=torch.zeros(rows, shape.audio_samples),
        audio_lens=torch.full((rows,), shape.audio_samples),
        audios_per_row=[1] * rows,
        sample_ids=[f"plan-{i}" for i in range(rows)],
        row_lengths=[length] * rows,
        audio_positions=[[PROMPT]] * rows,
        audio_frames=[shape.audio_frames] * rows,
        supervised_tokens=rows * (length - PROMPT - 1),
        max_documents=1,
        anchor_runway=length - PROMPT - 1,
    )
