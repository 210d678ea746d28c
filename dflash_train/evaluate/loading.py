"""Load what an evaluation needs: the frozen target (checkpoint or recipe), exported drafts, stop tokens.

Shared by ``dflash-eval``, ``dflash-labels`` and ``dflash-exposure``. Every user-fixable
problem is a one-line :class:`~dflash_train.errors.ConfigError`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from dflash_train.config.schema import InputConfig, ModelConfig, RunConfig
from dflash_train.constants import CONFIG_FILE
from dflash_train.data.estimator import AudioTokenEstimator
from dflash_train.data.prompt import ChatMLFormat, build_prompt_format
from dflash_train.errors import ConfigError
from dflash_train.files import read_json_object
from dflash_train.target import FrozenTarget
from dflash_train.target.load import open_speech_target
from dflash_train.target.audio import AudioLLM
from dflash_train.target.salm import check_salm_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's NeMo SALM model (NeMo 3.0.0 ``speechlm2/vllm/salm/model.py``, ``_PERCEPTION_DTYPE``) runs
# the audio perception in bfloat16 whatever the serving dtype. Evaluating with this default
# reproduces served tokens; float32 perception flips greedy near-ties on about 1 request in 4.
SERVING_PERCEPTION_DTYPE = "bfloat16"


@dataclass(frozen=True)
class TargetSource:
    """Where the frozen target comes from: a SALM checkpoint directory, or a recipe's ``model`` section.

    A recipe is composed like ``dflash-train`` composes it (``config_name`` from the
    package's ``conf/`` or from ``config_dir``, plus Hydra ``overrides``) and validated.
    """

    checkpoint: Optional[str] = None
    config_name: Optional[str] = None
    config_dir: Optional[str] = None
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.config_name is None):
            raise ConfigError("give the target as exactly one of --target (SALM checkpoint) and --config-name (recipe)")

    def describe(self) -> str:
        if self.checkpoint is not None:
            return self.checkpoint
        where = f" in {self.config_dir}" if self.config_dir else ""
        return f"recipe {self.config_name}{where}" + (f" {' '.join(self.overrides)}" if self.overrides else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "overrides": list(self.overrides)}

    @classmethod
    def from_dict(cls, data: dict) -> "TargetSource":
        return cls(**{**data, "overrides": tuple(data.get("overrides") or ())})

    def recipe(self) -> Optional[RunConfig]:
        """The composed, validated recipe (``None`` for a checkpoint source)."""
        if self.config_name is None:
            return None
        return compose_recipe(self.config_name, self.config_dir, self.overrides)

    def model_config(self, recipe: Optional[RunConfig]) -> ModelConfig:
        """The ``model`` section that loads this target."""
        if recipe is not None:
            return recipe.model
        path = Path(self.checkpoint)
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise ConfigError(f"--target '{path}' is not a SALM checkpoint directory (config.json + model.safetensors)")
        config = read_json_object(check_salm_checkpoint(path, "--target") / CONFIG_FILE, "point --target at a SALM checkpoint")
        tag = config.get("audio_locator_tag") or ModelConfig.audio_locator_tag
        return ModelConfig(pretrained_name=str(path), audio_locator_tag=tag)


def compose_recipe(config_name: str, config_dir: Optional[str], overrides: Sequence[str]) -> RunConfig:
    """Compose and validate a recipe as ``dflash-train --config-dir --config-name`` does."""
    from dflash_train.config import validate_config
    from dflash_train.config.compose import compose_config

    return validate_config(compose_config(config_name, overrides, config_dir)).run


def torch_dtype(name: str, option: str = "--dtype") -> torch.dtype:
    """The torch dtype named ``name``; a one-line error naming ``option`` if there is none."""
    if name not in DTYPES:
        raise ConfigError(f"{option} {name} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_target(model: ModelConfig, device: str, dtype: str, perception_dtype: Optional[str] = None) -> AudioLLM:
    """The frozen speech target ``model`` names (:func:`~dflash_train.target.load.open_speech_target`) on
    ``device`` in ``dtype``; its perception in ``perception_dtype`` if given."""
    target = open_speech_target(model, torch_dtype(dtype))
    target = target.to(device=torch.device(device))
    if perception_dtype is not None:
        target.run_perception_in(torch_dtype(perception_dtype, "--perception-dtype"))
    return target


def load_draft(path: str, target: FrozenTarget, device: str, dtype: str) -> nn.Module:
    """An exported draft (DFlash / DFlash2, or EAGLE-3 with the target's embedding table, which its export
    shares as vLLM serves it), checked against the target it will propose for."""
    from dflash_train.draft import load_export
    from dflash_train.draft.eagle3 import draft_taps
    from dflash_train.draft.eagle3_export import load_eagle3_export
    from dflash_train.target.vllm_export import draft_method

    problems = []
    if draft_method(path) == "eagle3":
        draft = load_eagle3_export(path)
        taps, vocab = draft_taps(draft), draft.model.embed_tokens.num_embeddings
        taps_key = "eagle_aux_hidden_state_layer_ids (minus one)"
        if vocab != target.vocab_size:
            problems.append(f"vocab_size {vocab} != the target's {target.vocab_size}")
        elif draft.config.hidden_size == target.hidden_size:
            draft.copy_embeddings_from_target(target.embed_tokens)
    else:
        draft = load_export(path)
        taps, taps_key = draft.target_layer_ids, "target_layer_ids"
        if draft.mask_token_id is None or not 0 <= draft.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {draft.mask_token_id} outside the target's {target.vocab_size} embeddings")
    config = draft.config
    bad_taps = [i for i in taps if not 0 <= i < target.num_layers]
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != the target's {target.hidden_size}")
    if bad_taps:
        problems.append(f"{taps_key} {bad_taps} outside the target's {target.num_layers} blocks")
    if problems:
        raise ConfigError(f"draft '{path}' does not fit the target: {'; '.join(problems)}")
    return draft.to(device=torch.device(device), dtype=torch_dtype(dtype)).eval()


def load_mtp_heads(checkpoint: Optional[str], target: FrozenTarget, device: str, dtype: str) -> tuple[nn.Module, int]:
    """The target's own MTP step (a SpeechLM checkpoint with an ``mtp`` block) and its trained head count."""
    from dflash_train.draft.mtp import MTPStep

    if checkpoint is None or not Path(checkpoint).is_dir():
        raise ConfigError("--mtp evaluates the MTP heads stored in the target checkpoint: give it with --target DIR")
    step, heads = MTPStep.from_checkpoint(checkpoint)
    if step.eh_proj.weight.shape[0] != target.hidden_size:
        raise ConfigError(f"the MTP heads of {checkpoint} are {step.eh_proj.weight.shape[0]} wide, the LLM {target.hidden_size}")
    return step.to(device=torch.device(device), dtype=torch_dtype(dtype)).eval(), heads


def export_training_step(export_dir: str) -> Optional[int]:
    """The global step a draft export's weights represent (its ``training_info``), ``None`` if it does not say."""
    from dflash_train.constants import CONFIG_FILE
    from dflash_train.files import read_json_object

    info = read_json_object(Path(export_dir) / CONFIG_FILE, "point --draft at a draft export").get("training_info")
    return info.get("global_step") if isinstance(info, dict) else None


def weights_digest(export_dir: str) -> str:
    """SHA-256 of a draft export's weights file."""
    from dflash_train.constants import WEIGHTS_FILE
    from dflash_train.files import sha256_file

    return sha256_file(Path(export_dir) / WEIGHTS_FILE)


def default_stop_token_ids(prompt_format: ChatMLFormat) -> list[int]:
    """The tokenizer's EOS and the prompt format's end-of-turn token: where a reply ends."""
    tokenizer = prompt_format.tokenizer
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(prompt_format.end)}
    return sorted(i for i in ids if i is not None and i != tokenizer.unk_token_id)


SPLITS = {"validation": "validation_ds", "train": "train_ds"}


def recipe_input(recipe: RunConfig, split: str) -> InputConfig:
    """The single input of a recipe's ``split`` (``validation`` or ``train``): the default data set."""
    ds = getattr(recipe.data, SPLITS[split])
    inputs = list(ds.input_cfg) if ds is not None else []
    if len(inputs) != 1:
        raise ConfigError(f"the recipe has {len(inputs)} {split} inputs; pass --cuts or --manifest to choose one")
    return inputs[0]


@dataclass
class TargetContext:
    """The loaded target with its data-side settings resolved: explicit flags first, then the recipe's."""

    target: AudioLLM
    model: ModelConfig
    prompt_format: ChatMLFormat
    estimator: AudioTokenEstimator
    data: InputConfig
    system_prompt: Optional[str]

    def checkpoint(self) -> Optional[str]:
        """The target checkpoint as an absolute path (``None`` for a target built from ``model.salm``)."""
        name = self.model.pretrained_name
        return str(Path(name).resolve()) if name and Path(name).exists() else name


def load_target_context(
    source: TargetSource,
    data: Optional[InputConfig],
    split: str,
    prompt_format: Optional[str],
    system_prompt: Optional[str],
    dtype: str,
    device: str,
    perception_dtype: str = SERVING_PERCEPTION_DTYPE,
) -> TargetContext:
    """Load the target as serving runs it; ``data`` defaults to the recipe's ``split`` input, the prompt to the recipe's."""
    recipe = source.recipe()
    if recipe is not None:
        data = data or recipe_input(recipe, split)
        prompt_format = prompt_format or recipe.data.prompt_format
        system_prompt = system_prompt if system_prompt is not None else recipe.data.system_prompt
    if data is None:
        raise ConfigError("no data: pass --cuts or --manifest (or a recipe with a single input)")
    model = source.model_config(recipe)
    target = load_target(model, device, dtype, perception_dtype)
    fmt = build_prompt_format(prompt_format or "qwen", target.tokenizer, model.audio_locator_tag)
    return TargetContext(target, model, fmt, AudioTokenEstimator.from_target(target), data, system_prompt)
