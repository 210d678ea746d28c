"""Check a composed recipe against the schema before anything expensive happens.

Three passes, each failing with a one-line :class:`ConfigError` that names the key:
unknown keys (with the nearest valid key), types and mandatory values, then the
cross-field rules of the recipe. Rules that need the target's sizes (tap ids, mask
token id, DFlash2 group size) live in :func:`validate_against_target`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from functools import lru_cache
from typing import Any, NamedTuple

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dflash_train.config.schema import (
    ATTENTION_BACKENDS,
    LABEL_SOURCES,
    LIGHTNING_PRECISION,
    PRECISION_ALIASES,
    STRATEGIES,
    VARIANTS,
    DFlash2Config,
    DFlashConfig,
    RunConfig,
    TrainerConfig,
)
from dflash_train.errors import ConfigError

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


class TargetDims(NamedTuple):
    """The target sizes that recipe values are checked against."""

    num_layers: int
    hidden_size: int
    vocab_size: int


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


def _check_unknown_keys(node: DictConfig, schema: type, path: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    extra = lightning_trainer_args() if schema is TrainerConfig else frozenset()
    valid = list(fields) + sorted(extra)
    for key in node.keys():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields and key not in extra:
            owners = [name for name, cls in VARIANTS.items() if key in {f.name for f in dataclasses.fields(cls)}]
            if issubclass(schema, DFlashConfig) and owners:
                raise ConfigError(
                    f"config key '{full}' belongs to variant {owners[0]}, not {node.get('variant')}; choose the "
                    f"variant with the config group (dflash={node.get('variant')}) instead of overriding dflash.variant"
                )
            raise ConfigError(f"unknown config key '{full}'{_nearest(str(key), valid)}")
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
    variant = dflash.get("variant", "dflash2")
    if variant not in VARIANTS:
        raise ConfigError(f"dflash.variant='{variant}' is not a known variant; choose one of {sorted(VARIANTS)}")
    return VARIANTS[variant]


def _typed(cfg: DictConfig) -> tuple[RunConfig, dict]:
    trainer_node = cfg.get("trainer") or OmegaConf.create({})
    own = {f.name for f in dataclasses.fields(TrainerConfig)}
    trainer_kwargs = {k: v for k, v in OmegaConf.to_container(trainer_node, resolve=True).items() if k not in own}
    body = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    body["trainer"] = {k: v for k, v in (body.get("trainer") or {}).items() if k in own}
    schema = OmegaConf.structured(RunConfig)
    schema.dflash = OmegaConf.structured(_variant_schema(cfg.get("dflash") or OmegaConf.create({})))
    try:
        merged = OmegaConf.merge(schema, body)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"config key '{key}': {str(err).splitlines()[0]}") from None
    missing = missing_keys(merged)
    if missing:
        raise ConfigError(
            f"mandatory config value(s) not set: {', '.join(missing)}; set them in your run config "
            f"or on the command line (e.g. {missing[0]}=...)"
        )
    return OmegaConf.to_object(merged), trainer_kwargs


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_rules(run: RunConfig) -> None:
    strategy = run.trainer.strategy
    for axis in ("tp_size", "pp_size", "cp_size"):
        value = getattr(strategy, axis)
        _require(
            value == 1,
            f"trainer.strategy.{axis}={value} is not supported: only data-parallel FSDP2/DDP is; "
            f"set trainer.strategy.{axis}=1",
        )
    _require(
        strategy.ep_size == 1,
        f"trainer.strategy.ep_size={strategy.ep_size}: expert parallelism of the target needs nemo_automodel's GPU "
        "target path, which this build does not include; set trainer.strategy.ep_size=1",
    )
    _require(
        strategy.name in STRATEGIES,
        f"trainer.strategy.name='{strategy.name}' is unknown; choose one of {list(STRATEGIES)}",
    )
    run.trainer.precision = PRECISION_ALIASES.get(run.trainer.precision, run.trainer.precision)
    _require(
        run.trainer.precision in LIGHTNING_PRECISION,
        f"trainer.precision='{run.trainer.precision}' is not supported; use a BF16 mode "
        f"({', '.join(p for p in [*LIGHTNING_PRECISION, *PRECISION_ALIASES] if p.startswith('bf16'))}) "
        "or 32-true for CPU tests",
    )
    model = run.model
    _require(
        (model.pretrained_name is None) != (model.salm is None),
        "set exactly one of model.pretrained_name (a SALM checkpoint) and model.salm (a SALM config to build)",
    )
    d = run.dflash
    _require(d.block_size >= 2, f"dflash.block_size={d.block_size} must be >= 2 (one anchor plus predictions)")
    _require(d.loss_decay_gamma > 0, f"dflash.loss_decay_gamma={d.loss_decay_gamma} must be > 0")
    _require(d.num_anchors >= 1, f"dflash.num_anchors={d.num_anchors} must be >= 1")
    _require(d.draft_num_hidden_layers >= 1, f"dflash.draft_num_hidden_layers={d.draft_num_hidden_layers} must be >= 1")
    _require(d.lr > 0, f"dflash.lr={d.lr} must be > 0")
    _require(
        d.label_source in LABEL_SOURCES,
        f"dflash.label_source='{d.label_source}' is unknown; choose one of {list(LABEL_SOURCES)}",
    )
    _require(
        d.attention_backend is None or d.attention_backend in ATTENTION_BACKENDS,
        f"dflash.attention_backend='{d.attention_backend}' is unknown; choose one of {list(ATTENTION_BACKENDS)} "
        "or null (automatic)",
    )
    _require(
        not d.use_fused_linear_ce,
        "dflash.use_fused_linear_ce=true is not supported (the decayed block loss needs per-slot weights); "
        "set it to false",
    )
    if d.projection_only:
        _require(
            isinstance(d, DFlash2Config),
            "dflash.projection_only=true requires dflash.variant=dflash2",
        )
        _require(
            d.init_from_pretrained is not None,
            "dflash.projection_only=true requires dflash.init_from_pretrained (a trained draft to adapt)",
        )
    _require(
        d.mask_token_id is None or d.mask_token_id >= 0,
        f"dflash.mask_token_id={d.mask_token_id} must be a non-negative token id",
    )
    if d.target_layer_ids is not None:
        ids = list(d.target_layer_ids)
        _require(len(ids) > 0, "dflash.target_layer_ids is empty; list decoder-block indices or set it to null")
        _require(len(set(ids)) == len(ids), f"dflash.target_layer_ids={ids} repeats a layer; list distinct ids")
    managed = sorted(set(d.draft_model_config) & set(MANAGED_DRAFT_KEYS))
    _require(
        not managed,
        f"dflash.draft_model_config.{managed[0] if managed else ''} is managed by the framework; "
        "set it through its dflash.* key instead",
    )
    if isinstance(d, DFlash2Config):
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            _require(getattr(d, key) >= 1, f"dflash.{key}={getattr(d, key)} must be >= 1")
        _require(d.selector_loss_weight >= 0, f"dflash.selector_loss_weight={d.selector_loss_weight} must be >= 0")


def validate_config(cfg: DictConfig) -> ValidatedConfig:
    """Validate a composed recipe; returns the typed config or raises a one-line :class:`ConfigError`."""
    _check_unknown_keys(cfg, RunConfig)
    run, trainer_kwargs = _typed(cfg)
    _check_rules(run)
    return ValidatedConfig(run, trainer_kwargs)


def validate_against_target(d: DFlashConfig, dims: TargetDims, layer_ids: list[int]) -> None:
    """Rules that need the target's depth, hidden size and vocabulary."""
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
    if isinstance(d, DFlash2Config):
        _require(
            dims.hidden_size % d.conv_group_size == 0,
            f"dflash.conv_group_size={d.conv_group_size} must divide the target hidden size {dims.hidden_size}",
        )
        _require(
            d.selector_top_k <= dims.vocab_size,
            f"dflash.selector_top_k={d.selector_top_k} exceeds the target vocabulary ({dims.vocab_size})",
        )

