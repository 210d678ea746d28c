"""From a recipe's ``model`` section to the frozen speech target: one router for training, evaluation and
serving validation, then the tap ids and mask token a draft uses with it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from dflash_train.config.schema import ModelConfig, RunConfig
from dflash_train.config.validate import validate_against_target
from dflash_train.errors import ConfigError
from dflash_train.target.audio import AudioLLM
from dflash_train.target.expert_parallel import expert_parallel_problem
from dflash_train.target.nemotron_h import NEMOTRON_H, NemotronHSpeechLMTarget, backbone_model_type
from dflash_train.target.salm import (
    SALMTarget,
    check_salm_checkpoint,
    load_salm,
    llm_config_for,
    read_state_dict,
    read_target_dims,
    require_audio_tag,
)
from dflash_train.target.taps import derive_target_layer_ids

log = logging.getLogger(__name__)


class LoadedTarget(NamedTuple):
    """The frozen target plus the tap ids and mask token id the draft will use."""

    target: AudioLLM
    layer_ids: list[int]
    mask_token_id: int


def is_nemotron_h_speechlm(name: str | None) -> bool:
    """Whether ``name`` is a local SpeechLM directory whose LLM backbone is Nemotron-H."""
    return name is not None and Path(name).expanduser().is_dir() and backbone_model_type(Path(name).expanduser()) == NEMOTRON_H


def open_speech_target(model: ModelConfig, dtype: torch.dtype = torch.float32) -> AudioLLM:
    """The frozen speech target ``model`` names, loaded strictly, straight into ``dtype`` (no FP32 copy; NeMo's
    own loader, FP32 then a cast, only for a SALM with ``init_from_checkpoint_strict=false``).

    A directory whose ``llm_backbone`` is Nemotron-H (``SALMAutomodel``'s, in its native names or
    HF's) becomes a :class:`~dflash_train.target.nemotron_h.NemotronHSpeechLMTarget`; every other
    target is NeMo's ``SALM`` (:func:`~dflash_train.target.salm.load_salm`). Both take
    ``audio_locator_tag``, ``encoder_chunk_size_seconds`` and ``init_from_checkpoint`` alike.
    """
    if not is_nemotron_h_speechlm(model.pretrained_name):
        return SALMTarget(load_salm(model, dtype))
    path = check_salm_checkpoint(model.pretrained_name, "model.pretrained_name")
    target = NemotronHSpeechLMTarget.from_checkpoint(path, dtype)
    require_audio_tag(model, target.audio_locator_tag)
    if model.encoder_chunk_size_seconds is not None:
        target.salm_config["encoder_chunk_size_seconds"] = model.encoder_chunk_size_seconds
    if model.init_from_checkpoint is not None:
        if not model.init_from_checkpoint_strict:
            raise ConfigError(
                "model.init_from_checkpoint_strict=false: a Nemotron-H SpeechLM target loads its weights strictly; "
                "set it to true"
            )
        target.load_speechlm_weights(read_state_dict(Path(model.init_from_checkpoint)), model.init_from_checkpoint)
    return target.to(dtype)


def check_target_for_run(run: RunConfig, world_size: int = 1) -> list[int]:
    """The draft's tap ids (derived from the target's depth when ``dflash.target_layer_ids`` is null), after
    checking them, the mask token id, the variant's sizes and expert parallelism over ``world_size`` ranks
    against the target's config files, before any weight loads (``dflash-train --cfg job`` runs it too)."""
    from dflash_train.variants import variant_named

    dims = read_target_dims(run.model)
    d = run.dflash
    variant = variant_named(d.variant)
    if not variant.uses_taps:
        layer_ids = []  # the draft reads the target's final hidden state, not taps
    elif d.target_layer_ids is None:
        layer_ids = derive_target_layer_ids(dims.num_layers, variant.tap_count(d))
        log.info("dflash.target_layer_ids derived from target depth %d: %s", dims.num_layers, layer_ids)
    else:
        layer_ids = list(d.target_layer_ids)
    validate_against_target(d, dims, layer_ids)
    problem = expert_parallel_problem(run.trainer.strategy.ep_size, world_size, llm_config_for(run.model))
    if problem:
        raise ConfigError(problem)
    return layer_ids


def load_target_for_run(run: RunConfig, dtype: torch.dtype = torch.float32, world_size: int = 1) -> LoadedTarget:
    """Check the run against the target's config files (:func:`check_target_for_run`), then load and freeze the
    target in ``dtype``."""
    layer_ids = check_target_for_run(run, world_size)
    target = open_speech_target(run.model, dtype)
    d = run.dflash
    mask_token_id = d.mask_token_id if d.mask_token_id is not None else target.default_mask_token_id()
    return LoadedTarget(target, layer_ids, mask_token_id)
