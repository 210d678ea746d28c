"""The EAGLE-3 draft's export in vLLM's format (``LlamaForCausalLMEagle3``), its strict reload and warm start.

Weights: the draft's state without the ``model.`` prefix (``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``), without the embedding table: it is the target's, frozen, and vLLM shares the
target's when the export has none. Config: the draft's Llama config with one layer, vLLM's
architecture name and ``eagle_aux_hidden_state_layer_ids``, the taps in vLLM's numbering (a tap of
block *t*'s output is vLLM's aux id *t + 1*, set when the draft was built).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from dflash_train.constants import CONFIG_FILE, WEIGHTS_FILE
from dflash_train.draft.eagle3 import Eagle3Draft, draft_taps
from dflash_train.draft.export import DraftExportError
from dflash_train.errors import ConfigError
from dflash_train.files import read_json_object, require_directory, require_same_shapes
from dflash_train.variants.eagle3 import EAGLE3_VARIANT

SHARED_WEIGHT = "model.embed_tokens.weight"
"""The draft's frozen copy of the target's embedding table: not exported (vLLM shares the target's)."""


def export_name(name: str) -> str:
    """The served name of a draft tensor: vLLM's EAGLE-3 loader adds ``model.`` back to all but the head and maps."""
    return name.removeprefix("model.")


def eagle3_export_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's tensors from the draft's full ``state``: served names, no embedding table, on the CPU."""
    return {export_name(k): v.detach().to("cpu").contiguous() for k, v in state.items() if k != SHARED_WEIGHT}


def eagle3_export_config(draft: Eagle3Draft, training_info=None) -> dict:
    """vLLM's EAGLE-3 config for ``draft`` (its taps already in ``eagle_aux_hidden_state_layer_ids``)."""
    config = draft.config.to_dict()
    for key in ("_attn_implementation", "_attn_implementation_autoset", "attn_implementation"):
        config.pop(key, None)
    config.update(
        architectures=[EAGLE3_VARIANT.export_architecture], model_type="llama", num_hidden_layers=1,
    )
    if training_info is not None:
        config["training_info"] = training_info
    return config


def write_eagle3_export(out_dir: Path, draft: Eagle3Draft, state: dict, training_info=None) -> None:
    """Write the export of the draft holding ``state`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(eagle3_export_state(state), str(out_dir / WEIGHTS_FILE))
    config = eagle3_export_config(draft, training_info)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_eagle3_export(path: str | Path) -> Eagle3Draft:
    """The draft of an EAGLE-3 export, reloaded strictly (only the shared embedding table may be absent; it
    keeps its initial values)."""
    path = require_directory(path, "EAGLE-3 export")
    config = read_json_object(path / CONFIG_FILE, "point at an EAGLE-3 export directory (dflash=eagle3 output_dir)")
    if config.get("architectures") != [EAGLE3_VARIANT.export_architecture]:
        raise DraftExportError(f"'{path}' holds {config.get('architectures')}, not an EAGLE-3 export")
    weights = {("" if k.startswith(("lm_head.", "d2t", "t2d")) else "model.") + k: v
               for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
    draft = Eagle3Draft(LlamaConfig.from_dict({**config, "attn_implementation": "eager"}))
    draft.to(weights["model.fc.weight"].dtype)  # its RMSNorms are built in bfloat16 (nemo_automodel's default)
    result = draft.load_state_dict(weights, strict=False)
    if set(result.missing_keys) != {SHARED_WEIGHT} or result.unexpected_keys:
        raise DraftExportError(
            f"'{path}' does not match an EAGLE-3 draft of its config: missing {sorted(set(result.missing_keys) - {SHARED_WEIGHT}) or 'none'}, "
            f"unexpected {result.unexpected_keys or 'none'}"
        )
    return draft


def verify_eagle3_export(path: str | Path, state: dict, draft: Eagle3Draft) -> int:
    """Reload the export strictly and check it taps ``draft``'s target blocks and every tensor on disk and
    reloaded equals ``state`` (the draft's full state); returns the tensor count."""
    expected = eagle3_export_state(state)
    nonfinite = [k for k, t in expected.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if nonfinite:
        raise DraftExportError(
            f"the trained draft holds NaN or infinite weights in {nonfinite[:8]}: training diverged; lower dflash.lr"
        )
    reloaded = load_eagle3_export(path)
    if draft_taps(reloaded) != draft_taps(draft):
        raise DraftExportError(
            f"export '{path}' taps target blocks {draft_taps(reloaded)}, the draft was trained on {draft_taps(draft)}"
        )
    on_disk = load_file(str(Path(path) / WEIGHTS_FILE))
    rebuilt = eagle3_export_state(reloaded.state_dict())
    differing = [k for k in expected
                 if k not in on_disk or not torch.equal(expected[k], on_disk[k]) or not torch.equal(rebuilt[k], on_disk[k])]
    if differing or set(on_disk) != set(expected):
        raise DraftExportError(f"export '{path}' differs from the trained draft in {differing[:8] or sorted(set(on_disk) ^ set(expected))}")
    return len(expected)


def warm_start_eagle3(draft: Eagle3Draft, path: str | Path) -> None:
    """Load an earlier EAGLE-3 export into ``draft`` (its embedding table stays the target's); the taps and
    every shape must match."""
    try:
        stored = load_eagle3_export(path)
    except (DraftExportError, ConfigError, OSError, KeyError) as err:
        raise ConfigError(f"dflash.init_from_pretrained='{path}' is not an EAGLE-3 export: {err}") from None
    if draft_taps(stored) != draft_taps(draft):
        raise ConfigError(
            f"dflash.init_from_pretrained tapped target blocks {draft_taps(stored)}, this run taps "
            f"{draft_taps(draft)}; set dflash.target_layer_ids={draft_taps(stored)}"
        )
    ours, theirs = draft.state_dict(), stored.state_dict()
    require_same_shapes(ours, theirs, f"dflash.init_from_pretrained='{path}' holds an EAGLE-3 draft of another shape")
    theirs[SHARED_WEIGHT] = ours[SHARED_WEIGHT]
    draft.load_state_dict(theirs, strict=True)
