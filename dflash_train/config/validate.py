"""Check a composed recipe against the schema before anything expensive happens.

Three passes, each failing with a one-line :class:`ConfigError` that names the key:
unknown keys (with the nearest valid key; :func:`check_config_keys`, which also checks a
command-line override's key before Hydra composes, :func:`check_override_key`), types and
mandatory values, then the cross-field rules of the recipe (the table :data:`RULES`, then the
variant's own rules).
Rules that need the target's sizes (tap ids, mask token id, the variant's shapes) live in
:func:`validate_against_target`. Nothing here changes a value except that a precision
alias is replaced by the name it stands for.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from pathlib import Path
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, NamedTuple

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dflash_train.config.nemo_inputs import SPLITS, expand_nemo_inputs
from dflash_train.config.nemo_model import resolve_nemo_model_keys
from dflash_train.config.metrics import describe_metrics, is_logged
from dflash_train.config.schema import (
    ATTENTION_BACKENDS,
    CHECKPOINT_MODES,
    EXPORT_CHECKPOINTS,
    LABEL_SOURCES,
    LIGHTNING_PRECISION,
    PERCEPTION_DTYPES,
    PRECISION_ALIASES,
    STRATEGIES,
    RunConfig,
    TrainerConfig,
)
from dflash_train.errors import ConfigError
from dflash_train.variants import ANCHOR_BUDGETS, VARIANTS, DFlashConfig, TargetDims, variant_named

# Draft-config keys the framework derives itself; `dflash.draft_model_config` may not override them.
MANAGED_DRAFT_KEYS = (
    "architectures",
    "dflash_config",
    "hidden_size",
    "num_hidden_layers",
    "num_target_layers",
    "vocab_size",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
)


class ValidatedConfig(NamedTuple):
    """A typed recipe plus the ``lightning.Trainer`` keyword arguments it carries."""

    run: RunConfig
    trainer_kwargs: dict


def missing_keys(cfg: DictConfig | ListConfig, prefix: str = "") -> list[str]:
    """Full dotted keys whose value is the mandatory marker ``???``."""
    found: list[str] = []
    items = cfg.items_ex(resolve=False) if isinstance(cfg, DictConfig) else enumerate(cfg)
    for key, _ in items:
        full = f"{prefix}{key}" if isinstance(cfg, DictConfig) else f"{prefix[:-1]}[{key}]."
        if OmegaConf.is_missing(cfg, key):
            found.append(full.rstrip("."))
            continue
        child = cfg._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none():
            found.extend(missing_keys(child, f"{full}." if isinstance(cfg, DictConfig) else full))
    return found


@lru_cache(maxsize=1)
def lightning_trainer_args() -> frozenset[str]:
    """Argument names of ``lightning.Trainer`` (the keys ``trainer.*`` may pass through)."""
    from lightning import Trainer

    return frozenset(p for p in inspect.signature(Trainer.__init__).parameters if p != "self")


def _nearest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _unknown_key(full: str, valid: list[str]) -> ConfigError:
    """The one error of a key no schema field takes: the full key and the nearest valid one."""
    return ConfigError(f"unknown config key '{full}'{_nearest(full.rsplit('.', 1)[-1], valid)}")


def _check_unknown_keys(node: DictConfig, schema: type, path: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    extra = lightning_trainer_args() if schema is TrainerConfig else frozenset()
    valid = list(fields) + sorted(extra)
    for key in node.keys():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields and key not in extra:
            owners = [name for name, v in VARIANTS.items() if key in {f.name for f in dataclasses.fields(v.config_schema)}]
            if issubclass(schema, DFlashConfig) and owners:
                raise ConfigError(
                    f"config key '{full}' belongs to variant {owners[0]}, not {node.get('variant')}; choose the "
                    f"variant with the config group (dflash={node.get('variant')}) instead of overriding dflash.variant"
                )
            raise _unknown_key(full, valid)
        if key not in fields:
            continue
        child_schema = _dataclass_type(fields[key].type)
        child = node._get_node(key)
        if child_schema is None or child._is_none():
            continue
        if isinstance(child, DictConfig):
            if key == "dflash" and schema is RunConfig:
                child_schema = _variant_schema(child)
            _check_unknown_keys(child, child_schema, full)
        elif isinstance(child, ListConfig):
            for index, item in enumerate(child):
                if isinstance(item, DictConfig):
                    _check_unknown_keys(item, child_schema, f"{full}[{index}]")


def check_override_key(key: str) -> None:
    """A command-line override's dotted ``key`` (``dflash.num_anchors``, ``data.train_ds.input_cfg.0.cuts_path``)
    against the schema, before Hydra composes: a key no field takes is the error a typo in a YAML file gives,
    naming the nearest valid key, instead of Hydra's "not in struct".

    The variant is known only after composition, so under ``dflash`` a key of any variant passes here (the
    composed config is checked against its own variant). Nothing below a pass-through field (a ``dict`` or
    ``Any`` field, a ``lightning.Trainer`` argument under ``trainer``) is checked.
    """
    schema: type | None = RunConfig
    path: list[str] = []
    for part in key.split("."):
        if part.isdigit() and path:  # an item of a list of inputs, written as a YAML typo's error writes it
            path[-1] += f"[{part}]"
            continue
        path.append(part)
        variants = [v.config_schema for v in VARIANTS.values()] if issubclass(schema, DFlashConfig) else [schema]
        fields = {f.name: f for s in variants for f in dataclasses.fields(s)}
        extra = lightning_trainer_args() if schema is TrainerConfig else frozenset()
        if part not in fields and part in extra:
            return
        if part not in fields:
            raise _unknown_key(".".join(path), [*fields, *sorted(extra)])
        schema = _dataclass_type(fields[part].type)
        if schema is None:
            return


def _dataclass_type(annotation: Any) -> type | None:
    """The dataclass a field holds, directly, as ``Optional[...]`` or as the items of a list."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        found = _dataclass_type(arg)
        if found is not None:
            return found
    return None


def _variant_schema(dflash: DictConfig) -> type[DFlashConfig]:
    return variant_named(dflash.get("variant", "dflash2")).config_schema


def _run_schema(cfg: DictConfig) -> DictConfig:
    """The structured :class:`RunConfig` for ``cfg``, its ``dflash`` node the chosen variant's own schema."""
    schema = OmegaConf.structured(RunConfig)
    schema.dflash = OmegaConf.structured(_variant_schema(cfg.get("dflash") or OmegaConf.create({})))
    return schema


def read_resolved_config(path: str | Path) -> RunConfig:
    """A run's ``resolved_config.yaml`` (written at train start from the validated recipe) as its :class:`RunConfig`."""
    saved = OmegaConf.load(path)
    return OmegaConf.to_object(OmegaConf.merge(_run_schema(saved), saved))


def _typed(cfg: DictConfig) -> tuple[RunConfig, dict]:
    trainer_node = cfg.get("trainer") or OmegaConf.create({})
    own = {f.name for f in dataclasses.fields(TrainerConfig)}
    trainer_kwargs = {k: v for k, v in OmegaConf.to_container(trainer_node, resolve=True).items() if k not in own}
    body = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    body["trainer"] = {k: v for k, v in (body.get("trainer") or {}).items() if k in own}
    try:
        merged = OmegaConf.merge(_run_schema(cfg), body)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"config key '{key}': {str(err).splitlines()[0]}") from None
    missing = missing_keys(merged)
    if missing:
        raise ConfigError(
            f"mandatory config value(s) not set: {', '.join(missing)}; set them in your run config "
            f"or on the command line (e.g. {missing[0]}=...)"
        )
    run = OmegaConf.to_object(merged)
    run.trainer.precision = PRECISION_ALIASES.get(run.trainer.precision, run.trainer.precision)  # one name per mode
    return run, trainer_kwargs


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class Rule:
    """A cross-field rule of the recipe: ``holds(run)`` or fail with ``message(run)`` (one line, names the fix)."""

    holds: Callable[[RunConfig], bool]
    message: Callable[[RunConfig], str]


def _bf16_modes() -> str:
    return ", ".join(p for p in [*LIGHTNING_PRECISION, *PRECISION_ALIASES] if p.startswith("bf16"))


def _managed_overrides(run: RunConfig) -> list[str]:
    return sorted(set(run.dflash.draft_model_config) & set(MANAGED_DRAFT_KEYS))


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _foreign_audio_tags(run: RunConfig) -> list[str]:
    """``data.<split>.input_cfg[i].audio_locator_tag='...'`` for every input tag that is not the target's."""
    found = []
    for split in SPLITS:
        ds = getattr(run.data, split)
        for i, inp in enumerate(ds.input_cfg if ds is not None else []):
            if inp.audio_locator_tag is not None and inp.audio_locator_tag != run.model.audio_locator_tag:
                found.append(f"data.{split}.input_cfg[{i}].audio_locator_tag='{inp.audio_locator_tag}'")
    return found


RULES: tuple[Rule, ...] = (
    *(
        Rule(
            lambda run, axis=axis: getattr(run.trainer.strategy, axis) == 1,
            lambda run, axis=axis: f"trainer.strategy.{axis}={getattr(run.trainer.strategy, axis)} is not supported: "
            f"only data-parallel FSDP2/DDP is; set trainer.strategy.{axis}=1",
        )
        for axis in ("tp_size", "pp_size", "cp_size")
    ),
    Rule(
        lambda run: run.trainer.strategy.ep_size >= 1,
        lambda run: f"trainer.strategy.ep_size={run.trainer.strategy.ep_size} must be >= 1 (1: the target's experts "
        "stay whole on every rank)",
    ),
    Rule(
        lambda run: run.trainer.strategy.name in STRATEGIES,
        lambda run: f"trainer.strategy.name='{run.trainer.strategy.name}' is unknown; choose one of {list(STRATEGIES)}",
    ),
    Rule(
        lambda run: run.trainer.precision in LIGHTNING_PRECISION,
        lambda run: f"trainer.precision='{run.trainer.precision}' is not supported; use a BF16 mode ({_bf16_modes()}) "
        "or 32-true for CPU tests",
    ),
    Rule(
        lambda run: (run.model.pretrained_name is None) != (run.model.salm is None),
        lambda run: "set exactly one of model.pretrained_name (a SpeechLM checkpoint) and model.salm (or NeMo's "
        "model.pretrained_llm: a SALM to build)",
    ),
    Rule(
        lambda run: run.dflash.block_size >= 2,
        lambda run: f"dflash.block_size={run.dflash.block_size} must be >= 2 (one anchor plus predictions)",
    ),
    Rule(
        lambda run: run.dflash.loss_decay_gamma > 0,
        lambda run: f"dflash.loss_decay_gamma={run.dflash.loss_decay_gamma} must be > 0",
    ),
    Rule(lambda run: run.dflash.num_anchors >= 1, lambda run: f"dflash.num_anchors={run.dflash.num_anchors} must be >= 1"),
    Rule(
        lambda run: run.dflash.anchor_budget in ANCHOR_BUDGETS,
        lambda run: f"dflash.anchor_budget='{run.dflash.anchor_budget}' is unknown; choose one of {list(ANCHOR_BUDGETS)}",
    ),
    Rule(
        lambda run: run.dflash.draft_num_hidden_layers >= 1,
        lambda run: f"dflash.draft_num_hidden_layers={run.dflash.draft_num_hidden_layers} must be >= 1",
    ),
    Rule(lambda run: run.dflash.lr > 0, lambda run: f"dflash.lr={run.dflash.lr} must be > 0"),
    Rule(
        lambda run: run.dflash.nonfinite_step_limit >= 1,
        lambda run: f"dflash.nonfinite_step_limit={run.dflash.nonfinite_step_limit} must be >= 1",
    ),
    Rule(
        lambda run: run.dflash.serving_val_samples >= 0,
        lambda run: f"dflash.serving_val_samples={run.dflash.serving_val_samples} must be >= 0 (0 turns it off)",
    ),
    Rule(
        lambda run: run.dflash.serving_val_max_new_tokens >= 1,
        lambda run: f"dflash.serving_val_max_new_tokens={run.dflash.serving_val_max_new_tokens} must be >= 1",
    ),
    Rule(
        lambda run: run.dflash.serving_val_perception_dtype in PERCEPTION_DTYPES,
        lambda run: f"dflash.serving_val_perception_dtype='{run.dflash.serving_val_perception_dtype}' is unknown; "
        f"choose one of {list(PERCEPTION_DTYPES)}",
    ),
    Rule(
        lambda run: 0.0 <= run.dflash.serving_anchor_fraction <= 1.0,
        lambda run: f"dflash.serving_anchor_fraction={run.dflash.serving_anchor_fraction} must be in [0, 1] (0 turns it off)",
    ),
    Rule(
        lambda run: run.dflash.serving_anchor_every >= 1,
        lambda run: f"dflash.serving_anchor_every={run.dflash.serving_anchor_every} must be >= 1",
    ),
    Rule(
        lambda run: run.dflash.on_policy_from_step >= -1,
        lambda run: f"dflash.on_policy_from_step={run.dflash.on_policy_from_step} must be >= 0, or -1 (off)",
    ),
    Rule(
        lambda run: run.dflash.on_policy_from_step < 0 or not run.data.train_ds.packing,
        lambda run: "dflash.on_policy_from_step needs padded batches (one sample per row): set "
        "data.train_ds.packing=false or on_policy_from_step=-1",
    ),
    Rule(
        lambda run: run.dflash.serving_anchor_fraction == 0 or not run.data.train_ds.packing,
        lambda run: "dflash.serving_anchor_fraction > 0 needs padded batches (one sample per row): set "
        "data.train_ds.packing=false or serving_anchor_fraction=0",
    ),
    Rule(
        lambda run: not run.exp_manager.checkpoint_monitor.startswith("val/serving_")
        or (run.dflash.serving_val_samples > 0 and run.data.validation_ds is not None),
        lambda run: f"exp_manager.checkpoint_monitor={run.exp_manager.checkpoint_monitor} needs serving validation: "
        "set dflash.serving_val_samples > 0 and a data.validation_ds",
    ),
    Rule(
        lambda run: run.exp_manager.checkpoint_mode in CHECKPOINT_MODES,
        lambda run: f"exp_manager.checkpoint_mode='{run.exp_manager.checkpoint_mode}' is unknown; choose one of "
        f"{list(CHECKPOINT_MODES)}",
    ),
    Rule(
        lambda run: run.exp_manager.export_checkpoint in EXPORT_CHECKPOINTS,
        lambda run: f"exp_manager.export_checkpoint='{run.exp_manager.export_checkpoint}' is unknown; choose one of "
        f"{list(EXPORT_CHECKPOINTS)}",
    ),
    Rule(
        lambda run: run.exp_manager.export_checkpoint != "best"
        or (run.exp_manager.save_top_k >= 1 and run.data.validation_ds is not None),
        lambda run: "exp_manager.export_checkpoint=best exports the best validated checkpoint: set "
        "exp_manager.save_top_k >= 1 and a data.validation_ds (or export_checkpoint=last)",
    ),
    Rule(
        lambda run: run.data.validation_ds is None or run.exp_manager.save_top_k == 0
        or is_logged(run, run.exp_manager.checkpoint_monitor),
        lambda run: f"exp_manager.checkpoint_monitor={run.exp_manager.checkpoint_monitor} is not a metric this run's "
        f"validation logs; set it to one of: {describe_metrics(run)}",
    ),
    Rule(
        lambda run: run.dflash.label_source in LABEL_SOURCES,
        lambda run: f"dflash.label_source='{run.dflash.label_source}' is unknown; choose one of {list(LABEL_SOURCES)}",
    ),
    Rule(
        lambda run: run.dflash.attention_backend in (None, *ATTENTION_BACKENDS),
        lambda run: f"dflash.attention_backend='{run.dflash.attention_backend}' is unknown; choose one of "
        f"{list(ATTENTION_BACKENDS)} or null (automatic)",
    ),
    Rule(
        lambda run: run.dflash.compile_recompile_limit >= 1,
        lambda run: f"dflash.compile_recompile_limit={run.dflash.compile_recompile_limit} must be >= 1",
    ),
    Rule(
        lambda run: run.dflash.loss_chunk_size >= 0,
        lambda run: f"dflash.loss_chunk_size={run.dflash.loss_chunk_size} must be >= 0 (positions per LM-head chunk; "
        "0 materialises the full logits)",
    ),
    Rule(
        lambda run: not run.dflash.use_fused_linear_ce,
        lambda run: "dflash.use_fused_linear_ce=true: NeMo's fused linear cross-entropy is not run here; the chunked "
        "loss replaces it (dflash.loss_chunk_size positions per LM-head chunk bound the logits' memory): set "
        "use_fused_linear_ce=false and size the chunks with dflash.loss_chunk_size",
    ),
    Rule(
        lambda run: not run.dflash.projection_only or variant_named(run.dflash.variant).supports_projection_only,
        lambda run: "dflash.projection_only=true requires dflash.variant="
        + " or ".join(name for name, v in VARIANTS.items() if v.supports_projection_only),
    ),
    Rule(
        lambda run: not run.dflash.projection_only or run.dflash.init_from_pretrained is not None,
        lambda run: "dflash.projection_only=true requires dflash.init_from_pretrained (a trained draft to adapt)",
    ),
    Rule(
        lambda run: run.dflash.mask_token_id is None or run.dflash.mask_token_id >= 0,
        lambda run: f"dflash.mask_token_id={run.dflash.mask_token_id} must be a non-negative token id",
    ),
    Rule(
        lambda run: run.dflash.target_layer_ids is None or len(run.dflash.target_layer_ids) > 0,
        lambda run: "dflash.target_layer_ids is empty; list decoder-block indices or set it to null",
    ),
    Rule(
        lambda run: run.dflash.target_layer_ids is None
        or len(set(run.dflash.target_layer_ids)) == len(run.dflash.target_layer_ids),
        lambda run: f"dflash.target_layer_ids={list(run.dflash.target_layer_ids)} repeats a layer; list distinct ids",
    ),
    *(
        Rule(
            lambda run, flag=flag, package=package: not getattr(run.exp_manager, flag) or _importable(package),
            lambda run, flag=flag, package=package: f"exp_manager.{flag}=true needs the {package} package; "
            f"pip install {package} (or set exp_manager.{flag}=false)",
        )
        for flag, package in (("create_wandb_logger", "wandb"), ("create_mlflow_logger", "mlflow"))
    ),
    Rule(
        lambda run: not _foreign_audio_tags(run),
        lambda run: f"{_foreign_audio_tags(run)[0]} differs from model.audio_locator_tag="
        f"'{run.model.audio_locator_tag}' (the target's audio placeholder); make them equal",
    ),
    Rule(
        lambda run: not _managed_overrides(run),
        lambda run: f"dflash.draft_model_config.{_managed_overrides(run)[0]} is managed by the framework; "
        "set it through its dflash.* key instead",
    ),
)
"""Every cross-field rule of the recipe, checked in order; the variant's own rules follow."""


def _check_rules(run: RunConfig) -> None:
    for rule in RULES:
        if not rule.holds(run):
            raise ConfigError(rule.message(run))
    for problem in variant_named(run.dflash.variant).config_problems(run.dflash):
        raise ConfigError(problem)


def resolve_nemo_aliases(run: RunConfig) -> None:
    """Give NeMo's packing and sampling keys their one meaning in this project's keys, in place.

    ``model.packed_sequences`` and ``data.<split>.use_packed_sequence_sampling`` are NeMo's names
    for ``packing`` (``packing: false`` is the default, so only a NeMo key saying false against
    packing saying true is a contradiction); ``use_multimodal_sampling: true`` is token-budget
    batching (``batch_tokens``), ``false`` batching by sample count (``batch_size``). What packing
    itself requires is checked with the other data rules (:mod:`dflash_train.data.validate`).
    """
    model_packed = run.model.packed_sequences
    for split in SPLITS:
        ds = getattr(run.data, split)
        if ds is None:
            continue
        key = f"data.{split}"
        sources = {f"{key}.use_packed_sequence_sampling": ds.use_packed_sequence_sampling}
        if split == "train_ds":
            sources["model.packed_sequences"] = model_packed
        said = {name: value for name, value in sources.items() if value is not None}
        if ds.packing:
            said[f"{key}.packing"] = True
        _require(
            len(set(said.values())) <= 1,
            f"{' and '.join(f'{k}={v}' for k, v in said.items())} disagree; they name one setting (packed rows), "
            "set them alike or keep only one",
        )
        ds.packing = any(said.values())
        if ds.use_multimodal_sampling is True:
            _require(ds.batch_tokens is not None, f"{key}.use_multimodal_sampling=true needs batch_tokens (the budget)")
        if ds.use_multimodal_sampling is False:
            _require(
                ds.batch_size is not None and ds.batch_tokens is None,
                f"{key}.use_multimodal_sampling=false batches by sample count: set batch_size and batch_tokens=null",
            )


def check_config_keys(cfg: DictConfig) -> DictConfig:
    """The first pass: NeMo's ``input_cfg`` forms expanded, then every key against the schema (an unknown one
    names the nearest valid key). It reads no value but ``dflash.variant``, so it runs on a config whose
    mandatory ``???`` values are still unset; returns the expanded config."""
    cfg = expand_nemo_inputs(cfg)
    _check_unknown_keys(cfg, RunConfig)
    return cfg


def validate_config(cfg: DictConfig) -> ValidatedConfig:
    """Validate a composed recipe; returns the typed config or raises a one-line :class:`ConfigError`."""
    cfg = check_config_keys(cfg)
    run, trainer_kwargs = _typed(cfg)
    resolve_nemo_aliases(run)
    resolve_nemo_model_keys(run)
    _check_rules(run)
    return ValidatedConfig(run, trainer_kwargs)


def validate_against_target(d: DFlashConfig, dims: TargetDims, layer_ids: list[int]) -> None:
    """Rules that need the target's depth, hidden size and vocabulary (the variant's included)."""
    bad = [i for i in layer_ids if not 0 <= i < dims.num_layers]
    _require(
        not bad,
        f"dflash.target_layer_ids={list(layer_ids)}: {bad} outside the target's {dims.num_layers} decoder blocks "
        f"(valid ids 0..{dims.num_layers - 1})",
    )
    if d.mask_token_id is not None:
        _require(
            d.mask_token_id < dims.vocab_size,
            f"dflash.mask_token_id={d.mask_token_id} is outside the target vocabulary (size {dims.vocab_size})",
        )
    for problem in variant_named(d.variant).target_problems(d, dims):
        raise ConfigError(problem)
