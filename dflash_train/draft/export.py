"""The draft-only HF export vLLM loads (docs/serving.md), and its strict reload.

The export is a pure state-dict/config adapter: training names in, serving names out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dflash_train.constants import CONFIG_FILE, WEIGHTS_FILE
from dflash_train.files import load_safetensors, read_json_object, require_directory
from dflash_train.variants import variant_for_architecture

# Keys vLLM must not see: it would use them verbatim or expect other layouts.
FORBIDDEN_CONFIG_KEYS = ("eagle_aux_hidden_state_layer_ids", "block_size", "auto_map")
FORBIDDEN_WEIGHT_PREFIXES = ("embed_tokens.", "lm_head.")


class DraftExportError(RuntimeError):
    """An export directory does not match the draft it should hold."""


def full_state_dict(model: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded state dict; a collective under FSDP2 (call it on every rank).

    By default the export's form: on the CPU, and under FSDP2 only rank 0 receives it (the others
    get an empty dict). ``every_rank=True``: every rank receives the whole state on the model's
    device (validation's and mining's serving copies, which every rank decodes with).
    """
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
        return get_model_state_dict(model, options=options)
    return {k: v.detach() if every_rank else v.detach().cpu() for k, v in model.state_dict().items()}


def export_config(draft_config) -> dict:
    """The serving config: vLLM's architecture name, non-causal, no training-only keys."""
    config = draft_config.to_dict()
    variant = variant_for_architecture(config["architectures"][0])
    config["architectures"] = [variant.export_architecture]
    config["model_type"] = "qwen3"
    config["is_causal"] = False
    for key in FORBIDDEN_CONFIG_KEYS:
        config.pop(key, None)
    for key in ("_attn_implementation", "_attn_implementation_autoset"):
        config.pop(key, None)
    return config


def export_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Serving weight names: no ``model.`` prefix, no embedding or LM head (vLLM uses the target's)."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name.startswith(FORBIDDEN_WEIGHT_PREFIXES) or "rotary_emb" in name:
            continue
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def write_export(
    out_dir: str | Path, draft_config, state: dict[str, torch.Tensor], training_info: Optional[dict] = None
) -> Path:
    """Write ``config.json`` and ``model.safetensors``; returns the directory.

    ``training_info`` (the step the weights represent, the run's provenance) is stored in
    ``config.json`` under that key, which vLLM ignores.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = export_config(draft_config)
    if training_info is not None:
        config["training_info"] = training_info
    weights = export_state_dict(state)
    save_file(weights, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def load_export(path: str | Path, attention_backend: str = "sdpa", overrides: dict | None = None) -> nn.Module:
    """Rebuild a draft from an export and load its weights strictly.

    ``overrides`` replace ``dflash_config`` entries before the draft is built (a warm start
    with a different ``block_size`` keeps every weight: none depends on the block size).
    """
    path = require_directory(path, f"a draft export ({CONFIG_FILE} + {WEIGHTS_FILE})")
    if not (path / CONFIG_FILE).exists() or not (path / WEIGHTS_FILE).exists():
        raise DraftExportError(f"'{path}' is not a draft export: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    fix = "re-export the draft (dflash-train writes it at the end of training)"
    raw = read_json_object(path / CONFIG_FILE, fix)
    try:
        variant = variant_for_architecture((raw.get("architectures") or ["?"])[0])
    except ValueError as err:
        raise DraftExportError(f"'{path}': {err}") from None
    if variant.family != "block":
        raise DraftExportError(
            f"'{path}' holds a draft of variant {variant.name}; this loader takes dflash and dflash2 exports (an "
            "eagle3 export: dflash_train.draft.eagle3_export.load_eagle3_export; MTP heads: dflash-eval --mtp)"
        )
    raw["dflash_config"] = {**raw.get("dflash_config", {}), **(overrides or {})}
    return _export_form(raw, variant, load_safetensors(path / WEIGHTS_FILE, fix), str(path), attention_backend)


def serving_draft(draft_config, state: dict[str, torch.Tensor], attention_backend: str = "sdpa") -> nn.Module:
    """The draft exactly as an export of ``state`` would load (its serving config and weight names),
    without writing files: what validation decodes with to measure serving's acceptance mid-training."""
    config = export_config(draft_config)
    variant = variant_for_architecture(config["architectures"][0])
    return _export_form(config, variant, export_state_dict(state), "the training draft", attention_backend)


def _export_form(raw: dict, variant, weights: dict[str, torch.Tensor], source: str, attention_backend: str) -> nn.Module:
    from transformers import Qwen3Config

    config = Qwen3Config(**raw)
    config._attn_implementation = attention_backend
    draft_cls, _ = variant.load_classes()
    draft = draft_cls(config)
    load_strictly(draft, weights, source=source)
    return draft


def load_strictly(draft: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Load export-named ``weights`` into ``draft``; any missing, unexpected or mis-shaped key is an error."""
    own = export_state_dict(draft.state_dict())
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    mis_shaped = sorted(
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in set(own) & set(weights)
        if own[k].shape != weights[k].shape
    )
    if missing or unexpected or mis_shaped:
        raise DraftExportError(
            f"draft weights in '{source}' do not match the draft: missing {missing or 'none'}, "
            f"unexpected {unexpected or 'none'}, shape mismatch (export vs draft) {mis_shaped or 'none'}"
        )
    result = draft.load_state_dict(weights, strict=False)
    leftover = [k for k in result.missing_keys if "rotary_emb" not in k]
    if leftover:
        raise DraftExportError(f"draft weights in '{source}' left {leftover} unloaded")


def verify_export(path: str | Path, state: dict[str, torch.Tensor]) -> int:
    """Reload an export strictly and check every tensor equals ``state``; returns the tensor count."""
    from safetensors.torch import load_file

    expected = export_state_dict(state)
    nonfinite = [k for k, tensor in expected.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if nonfinite:
        raise DraftExportError(
            f"the trained draft holds NaN or infinite weights in {nonfinite[:8]}: training diverged; "
            "check the loss curve, lower dflash.lr and resume from an earlier checkpoint"
        )
    reloaded = load_export(path)
    on_disk = load_file(str(Path(path) / WEIGHTS_FILE))
    rebuilt = export_state_dict(reloaded.state_dict())
    differing = [k for k in expected if not torch.equal(expected[k], on_disk[k]) or not torch.equal(rebuilt[k], on_disk[k])]
    if differing:
        raise DraftExportError(f"export '{path}' differs from the trained draft in {differing[:8]}")
    return len(expected)
