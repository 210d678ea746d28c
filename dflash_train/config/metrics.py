"""The metrics one validation logs: what ``exp_manager.checkpoint_monitor`` may name.

A monitor that validation never logs would only fail at the first validation, after the target loaded
and training ran; the config check (``dflash-train --cfg job``) and every launch refuse it before.
The names follow training/module.py (``on_validation_epoch_end``) and training/serving_validation.py
(``metrics``); tests/test_lifecycle.py compares them with what a real run logs.
"""

from __future__ import annotations

import re

from dflash_train.config.schema import RunConfig
from dflash_train.variants import variant_named

PER_SET_METRICS = ("dflash_loss", "dflash_accuracy", "accept_len")  # per validation set, with more than one set
PER_SET = re.compile(rf"val_[^/]+/({'|'.join(PER_SET_METRICS)})")


def validation_metrics(run: RunConfig) -> list[str]:
    """Every metric one validation of ``run`` logs over all its sets; empty without a ``data.validation_ds``."""
    if run.data.validation_ds is None:
        return []
    keys = ["val/dflash_loss", "val/dflash_accuracy", "val/valid_blocks", "val/skipped_batches", "val/accept_len",
            "val_acc"]
    if run.dflash.serving_val_samples > 0:
        k = variant_named(run.dflash.variant).speculative_tokens(run.dflash)
        keys += ["val/serving_mal", "val/serving_rounds", "val/serving_failed", "val/serving_seconds"]
        keys += [f"val/serving_{kind}@{p}" for p in range(1, k + 1) for kind in ("acceptance", "conditional")]
    return keys


def _several_sets(run: RunConfig) -> bool:
    return run.data.validation_ds is not None and len(run.data.validation_ds.input_cfg) > 1


def is_logged(run: RunConfig, key: str) -> bool:
    """Whether a validation of ``run`` logs ``key``. A set's own metrics (``val_<set>/accept_len``, logged with
    several validation sets) are matched by their form: the set names are the data inputs' (data/inputs.py)."""
    return key in validation_metrics(run) or (_several_sets(run) and PER_SET.fullmatch(key) is not None)


def describe_metrics(run: RunConfig) -> str:
    """What a validation of ``run`` logs, in one line: the per-position serving metrics as ``@1..K`` ranges."""
    keys = validation_metrics(run)
    plain = [key for key in keys if "@" not in key]
    ranged = list(dict.fromkeys(key.split("@")[0] for key in keys if "@" in key))
    last = {name: max(int(key.split("@")[1]) for key in keys if key.startswith(name + "@")) for name in ranged}
    per_set = [f"val_<set>/{{{','.join(PER_SET_METRICS)}}}"] if _several_sets(run) else []
    return ", ".join(plain + [f"{name}@1..{last[name]}" for name in ranged] + per_set)
