"""The metrics one validation logs: what ``exp_manager.checkpoint_monitor`` may name.

A monitor that validation never logs would only fail at the first validation, after the target loaded
and training ran; the config check (``dflash-train --cfg job``) and every launch refuse it before.
The names follow training/module.py (``on_validation_epoch_end``) and training/serving_validation.py
(``metrics``); tests/test_lifecycle.py compares them with what a real run logs.
"""

from __future__ import annotations

from dflash_train.config.schema import RunConfig
from dflash_train.data.inputs import input_name
from dflash_train.variants import variant_named

PER_SET_METRICS = ("dflash_loss", "dflash_accuracy", "accept_len")  # per validation set, with more than one set


def validation_metrics(run: RunConfig) -> list[str]:
    """Every metric one validation of ``run`` logs; empty without a ``data.validation_ds``."""
    if run.data.validation_ds is None:
        return []
    names = list(dict.fromkeys(input_name(i) for i in run.data.validation_ds.input_cfg))
    keys = [f"val_{name}/{metric}" for name in names for metric in PER_SET_METRICS] if len(names) > 1 else []
    keys += ["val/dflash_loss", "val/dflash_accuracy", "val/valid_blocks", "val/skipped_batches", "val/accept_len",
             "val_acc"]
    if run.dflash.serving_val_samples > 0:
        k = variant_named(run.dflash.variant).speculative_tokens(run.dflash)
        keys += ["val/serving_mal", "val/serving_rounds", "val/serving_failed", "val/serving_seconds"]
        keys += [f"val/serving_{kind}@{p}" for p in range(1, k + 1) for kind in ("acceptance", "conditional")]
    return keys


def describe_metrics(keys: list[str]) -> str:
    """``keys`` in one line, the per-position serving metrics as ``@1..K`` ranges."""
    plain = [key for key in keys if "@" not in key]
    ranged = list(dict.fromkeys(key.split("@")[0] for key in keys if "@" in key))
    last = {name: max(int(key.split("@")[1]) for key in keys if key.startswith(name + "@")) for name in ranged}
    return ", ".join(plain + [f"{name}@1..{last[name]}" for name in ranged])
