"""A trained MTP step written into the frozen target's vLLM-ready SALM directory, its strict reload and warm start.

The export is the target itself (``dflash-export-target``'s layout) with the step's weights
under NeMo's names ``llm.mtp.layers.<j>.*`` in ``model.safetensors`` and an ``mtp`` block in
``config.json``: what vLLM's MTP route serves (``{"method": "mtp"}``, no draft directory) and
what ``dflash-eval --mtp`` decodes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from dflash_train.constants import CONFIG_FILE, MTP_WEIGHT_PREFIX, WEIGHTS_FILE
from dflash_train.draft.mtp import MTPBlock, MTPStep
from dflash_train.errors import ConfigError
from dflash_train.files import require_same_shapes


class MTPExportError(RuntimeError):
    """An MTP export does not hold the trained step or the target it was trained on."""


def mtp_block(heads: int, pattern: str) -> dict:
    """The ``mtp`` block of a trained step: one repeated layer applied ``heads`` times."""
    block = {"enabled": True, "num_nextn_predict_layers": heads, "use_repeated_layer": True, "hybrid_override_pattern": pattern}
    MTPBlock.from_block(block)  # what vLLM's route refuses is never written
    return block


def write_mtp_export(
    out_dir: str | Path,
    target_checkpoint: str | Path,
    step: MTPStep,
    state: dict[str, torch.Tensor],
    heads: int,
    location: str | Path | None = None,
    training_info: Optional[dict] = None,
) -> Path:
    """The vLLM-ready target ``out_dir`` (served from ``location``, default ``out_dir``) with ``state``
    (the step's state dict) as its MTP heads; MTP weights the source held are replaced."""
    from safetensors.torch import load_file, save_file

    from dflash_train.target.vllm_export import export_target

    out_dir = Path(out_dir)
    export_target(target_checkpoint, out_dir, location=location or out_dir)
    weights_file = out_dir / WEIGHTS_FILE
    weights = {k: v for k, v in load_file(str(weights_file)).items() if not k.startswith(MTP_WEIGHT_PREFIX)}
    weights.update(step.checkpoint_state(state))
    weights_file.unlink()  # never write through a link to the source checkpoint
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    config = json.loads((out_dir / CONFIG_FILE).read_text())
    config["mtp"] = mtp_block(heads, step.pattern)
    if training_info is not None:
        config["training_info"] = training_info
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out_dir


def verify_mtp_export(path: str | Path, target_checkpoint: str | Path, step: MTPStep, state: dict[str, torch.Tensor],
                      heads: int) -> int:
    """Reload the export's step strictly and check every MTP tensor equals ``state`` and the target's
    tensors are the source's (same names, same bytes; a LoRA source's with its adapters merged, as
    ``dflash-export-target`` writes them); returns the MTP tensor count."""
    from safetensors import safe_open

    from dflash_train.target.salm import stored_tensor_names
    from dflash_train.target.vllm_export import merged_lora_source

    expected = step.checkpoint_state(state)
    nonfinite = [k for k, t in expected.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if nonfinite:
        raise MTPExportError(
            f"the trained MTP step holds NaN or infinite weights in {nonfinite[:8]}: training diverged; "
            "check the loss curve, lower dflash.lr and resume from an earlier checkpoint"
        )
    reloaded, stored_heads = MTPStep.from_checkpoint(path)
    if stored_heads != heads or reloaded.pattern != step.pattern:
        raise MTPExportError(f"export '{path}' stores {stored_heads} heads of pattern {reloaded.pattern!r}")
    rebuilt = reloaded.checkpoint_state()
    source = Path(target_checkpoint) / WEIGHTS_FILE
    merged = merged_lora_source(Path(target_checkpoint))
    target_names = {n for n in (merged or stored_tensor_names(source)) if not n.startswith(MTP_WEIGHT_PREFIX)}
    differing = []
    with safe_open(str(Path(path) / WEIGHTS_FILE), "pt") as exported, safe_open(str(source), "pt") as original:
        names = set(exported.keys())
        if names - set(expected) != target_names:
            raise MTPExportError(f"export '{path}' does not hold exactly the target's tensors besides the MTP step")
        differing += [k for k in expected if not torch.equal(expected[k], exported.get_tensor(k))]
        differing += [k for k in expected if not torch.equal(expected[k], rebuilt[k])]
        differing += [k for k in sorted(target_names)
                      if not torch.equal(exported.get_tensor(k), merged[k] if merged else original.get_tensor(k))]
    if differing:
        raise MTPExportError(f"export '{path}' differs from the trained step or the target in {sorted(set(differing))[:8]}")
    return len(expected)


def warm_start_mtp(step: MTPStep, path: str | Path) -> int:
    """Load the MTP heads of a SpeechLM checkpoint (an earlier MTP export) into ``step`` strictly; returns
    their trained head count."""
    try:
        stored, heads = MTPStep.from_checkpoint(path)
    except (ConfigError, ValueError, OSError) as err:
        raise ConfigError(f"dflash.init_from_pretrained='{path}' is not an MTP export: {err}") from None
    if stored.pattern != step.pattern:
        raise ConfigError(
            f"dflash.init_from_pretrained was trained with hybrid_override_pattern={stored.pattern!r} but this run "
            f"uses {step.pattern!r}; set dflash.hybrid_override_pattern={stored.pattern!r}"
        )
    ours, theirs = step.state_dict(), stored.state_dict()
    require_same_shapes(ours, theirs, f"dflash.init_from_pretrained='{path}' holds MTP heads of another target's shape")
    step.load_state_dict(theirs, strict=True)
    return heads
