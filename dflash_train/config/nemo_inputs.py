"""NeMo's ways of writing ``input_cfg``, turned into this project's flat list of inputs before validation.

NeMo's lhotse data configs allow, besides a list of inputs:

- ``input_cfg: /path/to/inputs.yaml`` (a YAML file holding that list);
- entries ``{type: group, input_cfg: [...], weight: w, tags: {...}}`` that blend their children.

A group is flattened into its children: a child's weight becomes ``w * child_weight / sum of its
siblings' weights`` (the same sampling probabilities, as the training blend normalizes weights),
and the group's ``tags`` are defaults its children may override. Nested groups and YAML files that
name YAML files are expanded the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dflash_train.errors import ConfigError

GROUP = "group"
SPLITS = ("train_ds", "validation_ds")


def _load_yaml_list(path: str, key: str) -> list:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}='{path}' does not exist; point it at a YAML file holding the list of inputs")
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except Exception as err:  # a YAML syntax error of any kind: name the file
        raise ConfigError(f"{key}='{path}' is not valid YAML ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not isinstance(loaded, list):
        raise ConfigError(f"{key}='{path}' holds a {type(loaded).__name__}, not a list of inputs")
    return loaded


def flatten_inputs(
    value: Any, key: str, group_weight: float | None = None, tags: dict | None = None
) -> list[dict]:
    """The flat input list of an ``input_cfg`` value (a list, or a YAML path); ``key`` names it in errors.

    ``group_weight``: these are a group's children, whose weights share the group's.
    """
    if isinstance(value, str):
        value = _load_yaml_list(value, key)
    if not isinstance(value, list):
        raise ConfigError(f"{key} must be a list of inputs or a path to a YAML file holding one")
    entries = [e for e in value if isinstance(e, dict)]
    if len(entries) != len(value):
        raise ConfigError(f"{key} holds an entry that is not a mapping; each input is {{type: ..., ...}}")
    total = sum(float(e.get("weight", 1.0)) for e in entries)
    flat = []
    for i, entry in enumerate(entries):
        entry_weight = float(entry.get("weight", 1.0))
        scale = entry_weight if group_weight is None else group_weight * entry_weight / total
        merged_tags = {**(tags or {}), **(entry.get("tags") or {})}
        if entry.get("type") == GROUP:
            if "input_cfg" not in entry:
                raise ConfigError(f"{key}[{i}] is a group without input_cfg; list its inputs")
            flat += flatten_inputs(entry["input_cfg"], f"{key}[{i}].input_cfg", scale, merged_tags)
            continue
        out = {**entry, "weight": scale}
        if merged_tags:
            out["tags"] = merged_tags
        flat.append(out)
    return flat


def expand_nemo_inputs(cfg: DictConfig) -> DictConfig:
    """``cfg`` with every split's ``input_cfg`` flattened (YAML paths read, groups expanded)."""
    data = cfg.get("data")
    if not isinstance(data, DictConfig):
        return cfg
    changed = {}
    for split in SPLITS:
        ds = data.get(split)
        if not isinstance(ds, DictConfig) or OmegaConf.is_missing(ds, "input_cfg"):
            continue
        raw = ds.input_cfg
        value = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, ListConfig) else raw
        needs = isinstance(value, str) or any(isinstance(e, dict) and e.get("type") == GROUP for e in value or [])
        if needs:
            changed[split] = flatten_inputs(value, f"data.{split}.input_cfg")
    if not changed:
        return cfg
    cfg = cfg.copy()
    with_flags = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    for split, inputs in changed.items():
        cfg.data[split].input_cfg = inputs
    OmegaConf.set_struct(cfg, with_flags)
    return cfg
