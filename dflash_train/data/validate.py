"""Start-up checks of the ``data`` config: cross-field rules, then every dataset path exists.

Each failure is a one-line :class:`ConfigError` naming the key (and the path).
"""

from __future__ import annotations

from pathlib import Path

from dflash_train.config.schema import DataConfig, DatasetConfig, InputConfig
from dflash_train.data.inputs import (
    CONVERSATIONS,
    CUTS,
    INPUT_TYPES,
    MANIFEST,
    SHAR,
    TAG_KEYS,
    TARRED_CONVERSATIONS,
    TARRED_MANIFEST,
    TYPE_SOURCES,
    expand_shards,
    input_path,
    input_source,
    is_remote,
)
from dflash_train.data.prompt import PROMPT_FORMATS
from dflash_train.errors import ConfigError

ASSISTANT_TURNS = ("all", "last")
_SOURCE_KEYS = {
    CUTS: "cuts_path (lhotse cuts)",
    SHAR: "shar_path (a lhotse Shar directory)",
    MANIFEST: "manifest_filepath (NeMo manifest)",
    TARRED_MANIFEST: "manifest_filepath + tarred_audio_filepaths (NeMo tarred audio)",
    CONVERSATIONS: "manifest_filepath (conversation JSONL)",
    TARRED_CONVERSATIONS: "manifest_filepath + tarred_audio_filepaths (tarred conversations)",
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_input(inp: InputConfig, key: str) -> None:
    _require(inp.type in INPUT_TYPES, f"{key}.type='{inp.type}' is unknown; choose one of {list(INPUT_TYPES)}")
    source, allowed = input_source(inp), TYPE_SOURCES[inp.type]
    _require(
        source is not None and source in allowed,
        f"{key}: type {inp.type} reads {_SOURCE_KEYS[allowed[0]]}"
        + "".join(f" or {_SOURCE_KEYS[other]}" for other in allowed[1:])
        + " (exactly one path key)",
    )
    _require(
        inp.tarred_audio_filepaths is None or source in (TARRED_MANIFEST, TARRED_CONVERSATIONS),
        f"{key}.tarred_audio_filepaths goes with manifest_filepath (NeMo tarred audio or tarred conversations)",
    )
    _require(inp.weight > 0, f"{key}.weight={inp.weight} must be > 0")
    unknown = sorted(set(inp.tags or {}) - set(TAG_KEYS))
    _require(not unknown, f"{key}.tags.{unknown[0] if unknown else ''} is unknown; tags are {list(TAG_KEYS)}")
    _require(
        inp.assistant_turns in ASSISTANT_TURNS,
        f"{key}.assistant_turns='{inp.assistant_turns}' is unknown; choose one of {list(ASSISTANT_TURNS)}",
    )
    _require(
        inp.assistant_turns == "all" or inp.type == "multimodal_conversation",
        f"{key}.assistant_turns applies to type multimodal_conversation only",
    )


def _check_split(ds: DatasetConfig, key: str) -> None:
    _require(len(ds.input_cfg) > 0, f"{key}.input_cfg is empty; list at least one input")
    for i, inp in enumerate(ds.input_cfg):
        _check_input(inp, f"{key}.input_cfg[{i}]")
    if ds.packing:
        _require(ds.batch_tokens is not None, f"{key}.packing=true needs batch_tokens (the packed row length)")
        _require(
            ds.batch_size is None,
            f"{key}.batch_size={ds.batch_size} with packing: a packed row is filled to batch_tokens, not by a sample "
            "count; remove batch_size",
        )
    _require(
        ds.batch_size is not None or ds.batch_tokens is not None,
        f"{key}: set batch_tokens (token budget) or batch_size (samples per batch)",
    )
    for name in ("batch_size", "batch_tokens", "max_tokens", "num_buckets", "bucket_estimate_samples",
                 "bucket_buffer_size", "shuffle_buffer_size"):
        value = getattr(ds, name)
        _require(value is None or value >= 1, f"{key}.{name}={value} must be >= 1")
    _require(ds.num_workers >= 0, f"{key}.num_workers={ds.num_workers} must be >= 0")
    _require(ds.prefetch_factor is None or ds.prefetch_factor >= 1, f"{key}.prefetch_factor={ds.prefetch_factor} must be >= 1")
    _require(
        ds.prefetch_factor is None or ds.num_workers > 0,
        f"{key}.prefetch_factor={ds.prefetch_factor} needs num_workers > 0 (batches are prefetched by workers)",
    )
    if ds.packing:
        _require(
            ds.measure_total_length, f"{key}.packing=true needs measure_total_length=true (rows hold whole sequences)"
        )
    if ds.batch_tokens is not None and ds.max_tokens is not None:
        _require(
            ds.max_tokens <= ds.batch_tokens,
            f"{key}.max_tokens={ds.max_tokens} exceeds batch_tokens={ds.batch_tokens}; such samples never fit a batch",
        )
    for name in ("min_duration", "max_duration"):
        value = getattr(ds, name)
        _require(value is None or value >= 0, f"{key}.{name}={value} must be >= 0")
    if ds.min_duration is not None and ds.max_duration is not None:
        _require(
            ds.min_duration <= ds.max_duration,
            f"{key}.min_duration={ds.min_duration} is above max_duration={ds.max_duration}",
        )
    if ds.bucket_bins is not None:
        bins = list(ds.bucket_bins)
        _require(
            len(bins) > 0 and bins == sorted(set(bins)) and bins[0] >= 1,
            f"{key}.bucket_bins={bins} must be distinct ascending token counts >= 1",
        )


def check_data_rules(cfg: DataConfig) -> None:
    """Cross-field rules of the ``data`` section (no file system access)."""
    _require(cfg.prompt_format is not None, f"data.prompt_format is not set; choose one of {sorted(PROMPT_FORMATS)}")
    _require(
        cfg.prompt_format in PROMPT_FORMATS,
        f"data.prompt_format='{cfg.prompt_format}' is unknown; choose one of {sorted(PROMPT_FORMATS)}",
    )
    _check_split(cfg.train_ds, "data.train_ds")
    if cfg.validation_ds is not None:
        _check_split(cfg.validation_ds, "data.validation_ds")


def _check_local_file(path: str, where: str) -> None:
    _require(not Path(path).is_dir(), f"{where} is a directory; give the manifest file (.jsonl or .jsonl.gz)")
    _require(Path(path).is_file(), f"{where} does not exist")
    _require(Path(path).stat().st_size > 0, f"{where} is empty; give a manifest with at least one record")


def _check_paths(inp: InputConfig, key: str) -> None:
    """Local paths must exist (every shard of a sharded one); remote ones are lhotse's to open."""
    if input_source(inp) == SHAR:
        where = f"{key}.shar_path='{inp.shar_path}'"
        if not is_remote(inp.shar_path):
            _require(Path(inp.shar_path).is_dir(), f"{where} is not a directory; give the lhotse Shar directory")
            _require(
                any(Path(inp.shar_path).glob("cuts.*")), f"{where} holds no cuts.* shard; is it a lhotse Shar directory?"
            )
        return
    field = "cuts_path" if inp.cuts_path is not None else "manifest_filepath"
    fields = [(field, input_path(inp))]
    if inp.tarred_audio_filepaths is not None:
        fields.append(("tarred_audio_filepaths", inp.tarred_audio_filepaths))
    for name, value in fields:
        for path in expand_shards(value) if inp.tarred_audio_filepaths is not None else [value]:
            if not is_remote(path):
                shard = "" if path == value else f" (shard {path})"
                _check_local_file(path, f"{key}.{name}='{value}'{shard}")


def validate_data_config(cfg: DataConfig) -> None:
    """Start-up check before any model is built: the rules, then every local input path exists and is not empty.

    Remote paths (``s3://``, ``ais://``, ``http(s)://``, ``pipe:``) are opened by lhotse when read.
    """
    check_data_rules(cfg)
    splits = [("data.train_ds", cfg.train_ds)]
    if cfg.validation_ds is not None:
        splits.append(("data.validation_ds", cfg.validation_ds))
    for key, ds in splits:
        for i, inp in enumerate(ds.input_cfg):
            _check_paths(inp, f"{key}.input_cfg[{i}]")
